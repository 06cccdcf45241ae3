"""The decomposer's prompts, output JSON schema and input episodes, kept apart so PROMPT_VERSION fingerprints exactly these texts."""

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from qumem_pipeline.llm.base import ChatRequest

MEMORY_TYPES = ("fact", "preference", "insight")

SYSTEM_PROMPT = (
    "You are a memory decomposer for a personal assistant. You read one episode of a conversation "
    "between a user and an assistant and extract atomic memories about the user. Each memory states "
    "exactly one independently retrievable item of user information in one short self-contained "
    "sentence that names the user (e.g. 'The user ...' or the speaker's name), and lists the ids of the "
    "turns that support it. Use only information stated or directly shown in the episode; never invent "
    "details. If there is nothing of the requested type, return an empty list. Answer with JSON only."
)

# The paper's definitions (QUMem §3.3), one instruction per memory type; each goes last in the prompt.
TYPE_INSTRUCTIONS = {
    "fact": (
        "Task: extract FACTUAL memories. Factual memories record concrete user experiences, behaviors, "
        "activities, states, or events, without inferring broader tendencies. Cover the whole episode: "
        "every user turn that states a concrete fact about the user (an event, plan, purchase, person, place "
        "or date) gives at least one memory, a turn with several such facts gives one memory for each, and "
        "each memory keeps the names, numbers and specific details its turn gives."
    ),
    "preference": (
        "Task: extract PREFERENCE memories. Preference memories record the user's choices, tendencies, "
        "requirements, and constraints concerning specific objects or contexts, together with directly "
        "associated rationales."
    ),
    "insight": (
        "Task: extract TRANSFERABLE INSIGHT memories. Transferable insights abstract user-specific decision "
        "principles from concrete choices, feedback, and their rationales; they can be applied to new "
        "objects or contexts but must stay grounded in the episode's evidence."
    ),
}
OUTPUT_INSTRUCTION = (
    'Return {"memories": [{"content": "...", "evidence_turn_ids": [turn ids]}]}, citing turn ids '
    "exactly as numbered in the transcript."
)

MAX_MEMORIES_PER_CALL = 12
MAX_CONTENT_CHARS = 300
MAX_EVIDENCE_IDS = 8
MAX_TURN_ID = 2**31 - 1


def memory_schema(turn_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The JSON schema of every decomposer call's output (identical for the three types).

    Without arguments: the schema output is validated against. With the episode's `turn_ids`: the
    tighter schema decoding is constrained to (`ChatRequest.constraint_schema`): evidence ids
    bounded to the episode's range, at most one memory per turn and one evidence id per turn, so a schema-constrained backend can only cite that episode's
    turns (unbounded, SmolLM2 through vLLM cites turn 1 of a [4..6] episode and every memory is
    dropped). Validation stays unbounded: from a server that ignores the constraint, ids outside
    the episode (or in gaps of a non-contiguous one) are dropped and counted, not quarantined.
    """
    lo, hi = (min(turn_ids), max(turn_ids)) if turn_ids else (0, MAX_TURN_ID)
    # bounded: at most one memory per turn and every turn cited once (no runaway repeated items)
    n_mem = min(MAX_MEMORIES_PER_CALL, max(1, len(set(turn_ids)))) if turn_ids else MAX_MEMORIES_PER_CALL
    n_ev = min(MAX_EVIDENCE_IDS, len(set(turn_ids))) if turn_ids else MAX_EVIDENCE_IDS
    return {
        "type": "object",
        "properties": {
            "memories": {
                "type": "array",
                "maxItems": n_mem,
                "items": {
                    "type": "object",
                    "properties": {
                        "content": {"type": "string", "minLength": 1, "maxLength": MAX_CONTENT_CHARS},
                        "evidence_turn_ids": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": n_ev,
                            "items": {"type": "integer", "minimum": lo, "maximum": hi},
                        },
                    },
                    "required": ["content", "evidence_turn_ids"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["memories"],
        "additionalProperties": False,
    }


def _prompt_fingerprint() -> str:
    blob = json.dumps(
        {"system": SYSTEM_PROMPT, "types": TYPE_INSTRUCTIONS, "out": OUTPUT_INSTRUCTION, "schema": memory_schema(),
         "decoding_bounds": "episode-range, max items per turn"},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


PROMPT_VERSION = f"decompose-v1-{_prompt_fingerprint()}"


# -- input contract ---------------------------------------------------------------------------
@dataclass
class Turn:
    turn_index: int
    role: str
    text: str
    speaker: str | None = None
    timestamp: datetime | None = None


@dataclass
class Episode:
    user_id: str
    episode_id: str
    turns: list[Turn] = field(default_factory=list)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def coerce_episode(obj: Any) -> Episode:
    """Accept an Episode, a dict, or any object with user_id / episode_id / turns."""
    if isinstance(obj, Episode):
        return obj
    turns = []
    for t in _get(obj, "turns") or []:
        ts = _get(t, "timestamp")
        if isinstance(ts, datetime) and ts.tzinfo is None:
            ts = ts.replace(tzinfo=timezone.utc)
        turns.append(
            Turn(
                turn_index=int(_get(t, "turn_index")),
                role=str(_get(t, "role") or "user"),
                text=str(_get(t, "text") or ""),
                speaker=_get(t, "speaker"),
                timestamp=ts if isinstance(ts, datetime) else None,
            )
        )
    turns.sort(key=lambda t: t.turn_index)
    return Episode(user_id=str(_get(obj, "user_id")), episode_id=str(_get(obj, "episode_id")), turns=turns)


# -- prompts ----------------------------------------------------------------------------------
def render_transcript(episode: Episode) -> str:
    lines = []
    for t in episode.turns:
        who = f"{t.speaker} ({t.role})" if t.speaker else t.role
        text = " ".join(t.text.split())
        lines.append(f"[{t.turn_index}] {who}: {text}")
    first = next((t.timestamp for t in episode.turns if t.timestamp), None)
    header = "Transcript"
    if first is not None:
        header += f" (started {first.strftime('%Y-%m-%d %H:%M')} UTC)"
    return header + ":\n" + "\n".join(lines)


def shared_prefix_text(episode: Episode) -> str:
    """The user-message text shared by the three calls (everything before the type instruction)."""
    return render_transcript(episode) + "\n\n"


def build_messages(episode: Episode, mem_type: str) -> list[dict[str, str]]:
    user = shared_prefix_text(episode) + TYPE_INSTRUCTIONS[mem_type] + "\n" + OUTPUT_INSTRUCTION
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def _request_id(ep: Episode, mem_type: str, attempt: int) -> str:
    return f"{ep.user_id}/{ep.episode_id}/{mem_type}/a{attempt}"


def build_requests(
    episodes: Iterable[Any], max_tokens: int = 512, types: Sequence[str] = MEMORY_TYPES
) -> list[ChatRequest]:
    """One request per (episode, type); an episode's three requests are adjacent."""
    schema = memory_schema()  # what output is validated against; ids outside the episode are dropped later
    reqs = []
    for raw in episodes:
        ep = coerce_episode(raw)
        bounded = memory_schema([t.turn_index for t in ep.turns])
        for t in types:
            reqs.append(
                ChatRequest(
                    request_id=_request_id(ep, t, 1),
                    messages=build_messages(ep, t),
                    json_schema=schema,
                    constraint_schema=bounded,
                    max_tokens=max_tokens,
                    schema_name=f"{t}_memories",
                    metadata={"user_id": ep.user_id, "episode_id": ep.episode_id, "type": t, "attempt": 1},
                )
            )
    return reqs
