"""Typed memory decomposition (QUMem §3.3): each episode -> factual, preference and insight memories.

For every episode the same decomposer is invoked three times, once per memory type d in
{fact, preference, insight}; each call returns atomic memories with the turns that support them.
A memory's temporal position is its latest evidence turn, and `valid_from` that turn's timestamp.

Prompts are *prefix-shared*: the system text and the episode transcript (turns numbered by their
turn ids) come first and are byte-identical across the three calls; the type-specific instruction
comes last, so a prefix cache (vLLM's, on by default) prefills an episode once for three calls.
The whole run's episodes (all users) go to the backend as one continuous stream of calls.

Nothing here imports Dagster; the memories asset calls `decompose_episodes`.
"""

import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import polars as pl

from qumem_pipeline.memories.checkpoints import CallOutcome, CheckpointStore, call_key
from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMBackend, LLMError, generate_each
from qumem_pipeline.contracts.stage_versions import stage_version

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
        "activities, states, or events, without inferring broader tendencies."
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

# -- output tables ----------------------------------------------------------------------------
MEMORY_SCHEMA = pl.Schema(
    {
        "memory_id": pl.String,
        "user_id": pl.String,
        "type": pl.String,
        "content": pl.String,
        "episode_id": pl.String,
        "evidence_turn_ids": pl.List(pl.Int64),
        "position": pl.Int64,
        "valid_from": pl.Datetime("us", "UTC"),
        "model": pl.String,
        "prompt_version": pl.String,
        "code_version": pl.String,
        "created_at": pl.Datetime("us", "UTC"),
    }
)

DECOMPOSE_QUARANTINE_SCHEMA = pl.Schema(
    {
        "user_id": pl.String,
        "episode_id": pl.String,
        "type": pl.String,
        "request_id": pl.String,
        "reason": pl.String,
        "raw": pl.String,
        "attempts": pl.Int64,
        "model": pl.String,
        "prompt_version": pl.String,
        "code_version": pl.String,
        "created_at": pl.Datetime("us", "UTC"),
    }
)

LEDGER_SCHEMA = pl.Schema(
    {
        "request_id": pl.String,
        "user_id": pl.String,
        "episode_id": pl.String,
        "type": pl.String,
        "attempt": pl.Int64,  # 1 = first call, 2 = the retry after bad output
        "status": pl.String,  # ok | retried | quarantined
        "episode_turns": pl.Int64,
        "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64,
        "cached_tokens": pl.Int64,  # as reported by the server; null when it reports none
        "shared_prefix_tokens": pl.Int64,  # prompt tokens shared by the episode's three calls
        "latency_s": pl.Float64,
        "transport_attempts": pl.Int64,
        "backend": pl.String,
        "model": pl.String,
        "prompt_version": pl.String,
        "code_version": pl.String,
        "created_at": pl.Datetime("us", "UTC"),
    }
)


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


# -- memory rows ------------------------------------------------------------------------------
_WS = re.compile(r"\s+")


def normalize_content(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).casefold()
    t = _WS.sub(" ", t).strip()
    return t.rstrip(" .!;,")


def memory_id(user_id: str, episode_id: str, mem_type: str, content: str) -> str:
    key = "\x1f".join([user_id, episode_id, mem_type, normalize_content(content)])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


@dataclass
class DecomposeStats:
    episodes: int = 0
    turns: int = 0
    calls: int = 0
    retries: int = 0
    quarantined: int = 0
    memories: int = 0
    duplicates_collapsed: int = 0
    evidence_ids_dropped: int = 0
    memories_dropped_no_evidence: int = 0
    memories_dropped_empty: int = 0
    reused_calls: int = 0  # ledger rows restored from a checkpoint instead of sent again

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def memories_from_output(
    ep: Episode,
    mem_type: str,
    parsed: dict[str, Any],
    stats: DecomposeStats,
    *,
    model: str,
    prompt_version: str,
    code_version: str,
    created_at: datetime,
) -> list[dict[str, Any]]:
    by_index = {t.turn_index: t for t in ep.turns}
    merged: dict[str, dict[str, Any]] = {}
    for item in parsed.get("memories") or []:
        content = " ".join(str(item.get("content") or "").split())
        if not normalize_content(content):
            stats.memories_dropped_empty += 1
            continue
        ids = []
        for raw_id in item.get("evidence_turn_ids") or []:
            if isinstance(raw_id, int) and not isinstance(raw_id, bool) and raw_id in by_index:
                ids.append(raw_id)
            else:
                stats.evidence_ids_dropped += 1
        if not ids:
            stats.memories_dropped_no_evidence += 1
            continue
        mid = memory_id(ep.user_id, ep.episode_id, mem_type, content)
        if mid in merged:
            stats.duplicates_collapsed += 1
            merged[mid]["evidence_turn_ids"] = sorted(set(merged[mid]["evidence_turn_ids"]) | set(ids))
            continue
        merged[mid] = {"memory_id": mid, "content": content, "evidence_turn_ids": sorted(set(ids))}
    rows = []
    for m in merged.values():
        position = max(m["evidence_turn_ids"])
        ts = by_index[position].timestamp
        rows.append(
            {
                "memory_id": m["memory_id"],
                "user_id": ep.user_id,
                "type": mem_type,
                "content": m["content"],
                "episode_id": ep.episode_id,
                "evidence_turn_ids": m["evidence_turn_ids"],
                "position": position,
                "valid_from": ts,
                "model": model,
                "prompt_version": prompt_version,
                "code_version": code_version,
                "created_at": created_at,
            }
        )
    return rows


# -- the run ----------------------------------------------------------------------------------
@dataclass
class DecomposeOutput:
    memories: pl.DataFrame
    quarantine: pl.DataFrame
    ledger: pl.DataFrame
    stats: DecomposeStats
    summary: dict[str, Any]
    call_keys_by_user: dict[str, set[str]] = field(default_factory=dict)  # checkpoint keys still in use


def _prefix_tokens_fn(backend: LLMBackend) -> Callable[[Episode], int] | None:
    """Exact shared-prefix length in tokens when the backend can tokenize prompts."""
    ids_fn = getattr(backend, "prompt_token_ids", None)
    if ids_fn is None:
        return None

    def fn(ep: Episode) -> int:
        seqs = [ids_fn(build_messages(ep, t)) for t in MEMORY_TYPES]
        n = 0
        for toks in zip(*seqs):
            if len(set(toks)) != 1:
                break
            n += 1
        return n

    return fn


def _estimated_prefix_tokens(ep: Episode, prompt_tokens: int, mem_type: str) -> int:
    """Without a tokenizer: the prompt's tokens scaled by the shared prefix's share of its characters."""
    msgs = build_messages(ep, mem_type)
    total = sum(len(m["content"]) for m in msgs)
    shared = len(SYSTEM_PROMPT) + len(shared_prefix_text(ep))
    return int(prompt_tokens * shared / max(1, total))


def decompose_episodes(
    episodes: Iterable[Any],
    backend: LLMBackend,
    *,
    created_at: datetime,
    max_tokens: int = 512,
    types: Sequence[str] = MEMORY_TYPES,
    prompt_version: str = PROMPT_VERSION,
    code_version: str | None = None,  # None: this code's memories stage version
    checkpoint: CheckpointStore | None = None,
    batch_episodes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DecomposeOutput:
    """Decompose every episode (all users); retry bad output once, then quarantine.

    The calls go to the backend continuously (`generate_each`: a bounded number in flight, the
    backend's concurrency, each slot refilled the moment its call finishes), so no call waits for
    the slowest of a batch. Each finished call is handed to `checkpoint.record` as it finishes
    (the store writes them within a second or a few dozen calls) and the store is flushed before
    this returns or raises, so an endpoint failure loses no answered call. With a `checkpoint`,
    calls finished by an earlier (crashed or failed) run are restored, not repeated. The tables
    come out in (episode, type) order whatever the completion order, so a resumed run equals an
    uninterrupted one. `batch_episodes` is accepted for older callers and no longer used.

    `progress(done, total)` is called after each finished call with the calls sent so far (the
    calls restored from a checkpoint are not counted: they cost nothing).

    Raises `LLMEndpointError` when the endpoint stays unreachable after the backend's retries,
    after every call that did finish is checkpointed (`exc.finished_outcomes`).
    """
    del batch_episodes  # the old checkpoint-batch size: calls are now submitted continuously
    if created_at.tzinfo is None:
        created_at = created_at.replace(tzinfo=timezone.utc)
    eps = [coerce_episode(e) for e in episodes]
    by_key = {(e.user_id, e.episode_id): e for e in eps}
    if len(by_key) != len(eps):
        raise ValueError("duplicate (user_id, episode_id) in the episodes handed to decompose_episodes")
    stats = DecomposeStats(episodes=len(eps), turns=sum(len(e.turns) for e in eps))
    run = _CallRunner(backend, created_at=created_at, prompt_version=prompt_version, by_key=by_key)

    restored = checkpoint.load(sorted({e.user_id for e in eps})) if checkpoint is not None else {}
    outcomes: dict[str, CallOutcome] = {}
    todo: list[ChatRequest] = []
    requests = build_requests(eps, max_tokens=max_tokens, types=types)
    keys = [run.key_of(r) for r in requests]
    for req, k in zip(requests, keys):
        if k in restored:
            outcomes[k] = restored[k]
            stats.reused_calls += len(restored[k].ledger)
        else:
            todo.append(req)

    fresh: list[CallOutcome] = []

    def finished(o: CallOutcome) -> None:
        outcomes[o.key] = o
        fresh.append(o)
        if checkpoint is not None:
            checkpoint.record(o)
        if progress is not None:
            progress(len(fresh), len(todo))

    try:
        generate_each(backend, todo, lambda req, res: run.on_result(req, res, finished))
    except LLMError as exc:
        exc.finished_outcomes = list(fresh)  # type: ignore[attr-defined]
        raise
    finally:
        if checkpoint is not None:
            checkpoint.flush()  # what finished is on disk before this returns or raises
    return _assemble(eps, keys, outcomes, stats, code_version=code_version or stage_version("memories"))


class _CallRunner:
    """Turns each finished request into a final outcome, or into its one retry after bad output."""

    def __init__(self, backend: LLMBackend, *, created_at: datetime, prompt_version: str,
                 by_key: dict[tuple[str, str], Episode]) -> None:
        self.backend = backend
        self.model = backend.model_name
        self.created_at = created_at
        self.prompt_version = prompt_version
        self.by_key = by_key
        self._prefix_fn = _prefix_tokens_fn(backend)
        self._prefix_cache: dict[tuple[str, str], int] = {}
        self._first_rows: dict[str, dict[str, Any]] = {}  # call key -> ledger row of a retried first attempt

    def key_of(self, req: ChatRequest) -> str:
        md = req.metadata
        return call_key(md["user_id"], md["episode_id"], md["type"], req.messages, self.prompt_version,
                        self.model, req.max_tokens if md["attempt"] == 1 else md["first_max_tokens"])

    def on_result(self, req: ChatRequest, res: ChatResult,
                  finished: Callable[[CallOutcome], None]) -> list[ChatRequest] | None:
        """A final outcome goes to `finished`; bad first output becomes one retry request."""
        md = req.metadata
        attempt = md["attempt"]
        if res.ok or attempt == 2:
            finished(self._finish(req, res, attempt, self._first_rows))
            return None
        self._first_rows[self.key_of(req)] = self._ledger_row(req, res, attempt, "retried")
        new_tokens = req.max_tokens * 2 if res.error_kind == "length" else req.max_tokens
        return [ChatRequest(
            request_id=_request_id(self.by_key[(md["user_id"], md["episode_id"])], md["type"], 2),
            messages=req.messages, json_schema=req.json_schema, constraint_schema=req.constraint_schema,
            max_tokens=new_tokens, schema_name=req.schema_name,
            metadata={**md, "attempt": 2, "first_error": res.error, "first_max_tokens": req.max_tokens},
        )]

    def _finish(self, req: ChatRequest, res: ChatResult, attempt: int, first_rows: dict) -> CallOutcome:
        md = req.metadata
        key = self.key_of(req)
        ledger = [first_rows.pop(key)] if attempt == 2 else []
        quarantine = None
        if res.ok:
            ledger.append(self._ledger_row(req, res, attempt, "ok"))
        else:
            ledger.append(self._ledger_row(req, res, attempt, "quarantined"))
            quarantine = {
                "user_id": md["user_id"], "episode_id": md["episode_id"], "type": md["type"],
                "request_id": req.request_id,
                "reason": f"{res.error} (first attempt: {md.get('first_error')})" if attempt == 2 else str(res.error),
                "raw": res.raw_text, "attempts": attempt, "model": self.model,
                "prompt_version": self.prompt_version,
            }
        return CallOutcome(key=key, user_id=md["user_id"], episode_id=md["episode_id"], type=md["type"],
                           status="ok" if res.ok else "quarantined", output=res.parsed if res.ok else None,
                           quarantine=quarantine, ledger=ledger, created_at=self.created_at)

    def _ledger_row(self, req: ChatRequest, res: ChatResult, attempt: int, status: str) -> dict[str, Any]:
        md = req.metadata
        ep = self.by_key[(md["user_id"], md["episode_id"])]
        key = (ep.user_id, ep.episode_id)
        if key not in self._prefix_cache and self._prefix_fn is not None:
            self._prefix_cache[key] = self._prefix_fn(ep)
        shared = self._prefix_cache.get(key)
        if shared is None:
            shared = _estimated_prefix_tokens(ep, res.prompt_tokens, md["type"])
        return {
            "request_id": req.request_id, "user_id": ep.user_id, "episode_id": ep.episode_id, "type": md["type"],
            "attempt": attempt, "status": status, "episode_turns": len(ep.turns),
            "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "cached_tokens": res.cached_tokens, "shared_prefix_tokens": shared, "latency_s": res.latency_s,
            "transport_attempts": res.attempts, "backend": self.backend.backend_name, "model": self.model,
            "prompt_version": self.prompt_version,
        }


def _assemble(eps: list[Episode], keys: list[str], outcomes: dict[str, CallOutcome], stats: DecomposeStats,
              *, code_version: str) -> DecomposeOutput:
    """The three tables from the outcomes, in request (episode, type) order."""
    by_key = {(e.user_id, e.episode_id): e for e in eps}
    memories: list[dict[str, Any]] = []
    quarantine: list[dict[str, Any]] = []
    ledger: list[dict[str, Any]] = []
    for k in keys:
        o = outcomes[k]
        ledger.extend({**row, "code_version": code_version, "created_at": o.created_at} for row in o.ledger)
        stats.calls += len(o.ledger)
        stats.retries += sum(1 for row in o.ledger if row["status"] == "retried")
        if o.status == "ok":
            prompt_version = o.ledger[-1]["prompt_version"]
            memories.extend(memories_from_output(
                by_key[(o.user_id, o.episode_id)], o.type, o.output or {}, stats, model=o.ledger[-1]["model"],
                prompt_version=prompt_version, code_version=code_version, created_at=o.created_at,
            ))
        else:
            stats.quarantined += 1
            quarantine.append({**(o.quarantine or {}), "code_version": code_version, "created_at": o.created_at})
    stats.memories = len(memories)
    mem_df = pl.DataFrame(memories, schema=MEMORY_SCHEMA) if memories else MEMORY_SCHEMA.to_frame()
    mem_df = mem_df.sort(["user_id", "episode_id", "type", "position", "memory_id"])
    q_df = pl.DataFrame(quarantine, schema=DECOMPOSE_QUARANTINE_SCHEMA) if quarantine else DECOMPOSE_QUARANTINE_SCHEMA.to_frame()
    l_df = pl.DataFrame(ledger, schema=LEDGER_SCHEMA) if ledger else LEDGER_SCHEMA.to_frame()
    summary = summarize_ledger(l_df, n_turns=stats.turns)
    summary.update({f"n_{k}": v for k, v in stats.as_dict().items()})
    keys_by_user: dict[str, set[str]] = {}
    for k in keys:
        keys_by_user.setdefault(outcomes[k].user_id, set()).add(k)
    return DecomposeOutput(memories=mem_df, quarantine=q_df, ledger=l_df, stats=stats, summary=summary,
                           call_keys_by_user=keys_by_user)


def summarize_ledger(ledger: pl.DataFrame, n_turns: int) -> dict[str, Any]:
    """Per-run cost figures (the paper's Table 4 units) from the token ledger.

    `computed_prefill_tokens` is what a prefix cache leaves to compute: within an episode the first
    call prefills its whole prompt, every later call (other types, retries) only what follows the
    shared prefix. `prefill_saved_tokens` is the rest.
    """
    turns = max(1, int(n_turns))
    calls = ledger.height
    prompt = int(ledger["prompt_tokens"].sum() or 0) if calls else 0
    completion = int(ledger["completion_tokens"].sum() or 0) if calls else 0
    computed = 0
    if calls:
        g = (
            ledger.with_row_index("_i")
            .sort("_i")
            .with_columns(pl.col("_i").rank("ordinal").over(["user_id", "episode_id"]).alias("_k"))
        )
        computed = int(
            g.select(
                pl.when(pl.col("_k") == 1)
                .then(pl.col("prompt_tokens"))
                .otherwise((pl.col("prompt_tokens") - pl.col("shared_prefix_tokens")).clip(lower_bound=0))
                .sum()
            ).item()
            or 0
        )
    reported_cached = ledger["cached_tokens"].drop_nulls() if calls else pl.Series([], dtype=pl.Int64)
    return {
        "turns": int(n_turns),
        "llm_calls": calls,
        "calls_per_100_turns": 100.0 * calls / turns,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_per_turn": prompt / turns,
        "completion_tokens_per_turn": completion / turns,
        "tokens_per_turn": (prompt + completion) / turns,
        "computed_prefill_tokens": computed,
        "computed_prefill_tokens_per_turn": computed / turns,
        "prefill_saved_tokens": prompt - computed,
        "prefill_saved_fraction": (prompt - computed) / prompt if prompt else 0.0,
        "reported_cached_tokens": int(reported_cached.sum()) if len(reported_cached) else None,
        "mean_latency_s": float(ledger["latency_s"].mean()) if calls else 0.0,
    }
