"""PersonaMem contexts (personalized response selection benchmark): one user per context.

Two layouts of the benchmark are read, both as one file:

- **shared contexts** (the 128k release, ``shared_contexts_*.jsonl``): each line is
  ``{context_id: [message, ...]}``, messages ``{role, content}`` in OpenAI chat form (system / user /
  assistant). A persona's sessions open with a system message ("Current user persona: ...") and
  are mixed with unrelated Q&A filler; the filler is kept (the pipeline must cope with chatter).
- **per-question contexts** (earlier releases, ``contexts.json``): one JSON object mapping each
  question id to its own list of messages; every role is "user" and the speaker is marked inside
  the text ("Patient:", "Therapist:", "User:", "Assistant:").

Mapping onto the raw turn frame:

- ``user_id = "pm-" + the first 16 characters of the context (or question) id`` (ids are long
  hashes; 16 hex characters keep them unique in practice and readable); ``conversation_id`` the
  whole id.
- ``turn_index`` = the message's position in its list (0..N-1), so a question "asked after message
  ``end_index_in_shared_context``" is asked as of ``turn_index = end_index``.
- ``role``: a speaker marked in the text decides (Patient/User/Student/Client -> ``user``, the
  others -> ``assistant``); otherwise the message's role; ``system`` becomes ``other`` (speaker
  ``system``): the persona card is part of what every strategy may read, as in the benchmark.
- ``speaker`` = the marked name ("Patient") with the mark taken off the text, else the role.
- ``session_id`` = ``session-<n>``: a new session at every system message (each persona session
  opens with one).
- No timestamps: the source has none beyond dates inside the text; history order is the message order.

Nothing is dropped: a line or file that is not JSON, or a message of the wrong shape, becomes a
ParseFailure naming the row and field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qumem_pipeline.ingest.importers.base import ImportResult, ParseFailure, escape_raw, raw_frame

USER_ID_PREFIX = "pm-"
ID_CHARS = 16
# "Patient: ..." / "Therapist: ..." speaker marks inside a message's text
SPEAKER_MARK = re.compile(r"^\s*([A-Z][A-Za-z ]{1,30}?)\s*:\s*")
USER_SPEAKERS = frozenset({"patient", "user", "student", "client", "customer", "learner", "human"})
KNOWN_SPEAKERS = USER_SPEAKERS | frozenset({"therapist", "assistant", "tutor", "counselor", "counsellor", "agent",
                                            "ai", "bot", "system", "advisor", "coach", "lawyer", "doctor"})


def user_id_for(context_id: str) -> str:
    """The user id of one PersonaMem context (or per-question context)."""
    cid = re.sub(r"[^A-Za-z0-9_.\-]+", "-", str(context_id)).strip("-_.") or "context"
    return USER_ID_PREFIX + cid[:ID_CHARS]


def split_speaker(text: str) -> tuple[str | None, str]:
    """('Patient', rest) when the text starts with a known speaker mark, else (None, text)."""
    m = SPEAKER_MARK.match(text)
    if m and m.group(1).strip().lower() in KNOWN_SPEAKERS:
        return m.group(1).strip(), text[m.end():]
    return None, text


def is_personamem(path: str | Path) -> bool:
    """True when the file's first record is a PersonaMem context (either layout)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return b'"role"' in head and b'"content"' in head and re.match(rb'\s*\{\s*"[^"]+"\s*:\s*\[\s*\{', head) is not None


def import_personamem(path: str) -> ImportResult:
    """Import a PersonaMem contexts file of either layout (see the module docstring)."""
    src = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return ImportResult(raw=raw_frame([]), failures=[ParseFailure(src, None, "(file)", f"unreadable: {e}", None)])
    contexts, failures = _contexts(src, text)
    records: list[dict] = []
    for row, cid, messages in contexts:
        recs, fails = context_records(src, row, cid, messages)
        records.extend(recs)
        failures.extend(fails)
    return ImportResult(raw=raw_frame(records), failures=failures)


def _contexts(src: str, text: str) -> tuple[list[tuple[int, str, object]], list[ParseFailure]]:
    """(row, context id, messages) per context: one JSON object (per-question layout) or one object per line."""
    stripped = text.lstrip()
    try:  # the per-question layout, or a one-line shared-contexts file
        obj = json.loads(stripped)
        if isinstance(obj, dict):
            return [(i, str(k), v) for i, (k, v) in enumerate(obj.items(), start=1)], []
    except ValueError:
        pass
    out, failures = [], []
    for row, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            failures.append(ParseFailure(src, row, "(line)", f"not JSON: {e}", escape_raw(line)))
            continue
        if not isinstance(obj, dict) or not obj:
            failures.append(ParseFailure(src, row, "(line)", "expected {context_id: [messages]}", escape_raw(line)))
            continue
        out += [(row, str(k), v) for k, v in obj.items()]
    return out, failures


def context_records(src: str, row: int, context_id: str, messages: object) -> tuple[list[dict], list[ParseFailure]]:
    """The raw turn records of one context; messages of the wrong shape become failures."""
    user = user_id_for(context_id)
    if not isinstance(messages, list):
        return [], [ParseFailure(src, row, context_id, f"expected a list of messages, got {type(messages).__name__}",
                                 escape_raw(json.dumps(messages, ensure_ascii=False, default=str)), user)]
    records, failures, session = [], [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            failures.append(ParseFailure(src, row, f"{context_id}[{i}]", "expected {role: str, content: str}",
                                         escape_raw(json.dumps(m, ensure_ascii=False, default=str)), user))
            continue
        role = m["role"].strip().lower()
        if role == "system" and i > 0:
            session += 1
        speaker, body = split_speaker(m["content"]) if role != "system" else (None, m["content"])
        if speaker is not None:
            role = "user" if speaker.lower() in USER_SPEAKERS else "assistant"
        elif role == "system":
            role, speaker = "other", "system"
        else:
            speaker = role
        records.append({"user_id": user, "conversation_id": context_id, "session_id": f"session-{session}",
                        "turn_index": i, "role": role, "speaker": speaker, "text": body, "timestamp": None,
                        "source_ref": f"{context_id[:ID_CHARS]}:{i}", "source_file": src, "source_row": row})
    return records, failures
