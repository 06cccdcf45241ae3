"""LoCoMo (long-term conversational memory) files: a JSON list of samples, two speakers each.

Mapping onto the raw turn frame (``import_locomo``):

- Each conversation has two speakers and EACH speaker becomes a user:
  ``user_id = f"{sample_id}-{slug(speaker)}"`` (e.g. ``conv-26-caroline``). A user's history is
  the whole conversation: their own turns have role ``user``, the other speaker's (or any third
  speaker's) turns role ``other``. Every turn therefore appears once per user.
- ``speaker`` = the speaker's name, ``conversation_id`` = ``sample_id``,
  ``session_id`` = ``session_<s>``, ``source_ref`` = the turn's ``dia_id`` (e.g. ``"D1:3"``),
  ``turn_index`` = position in that user's history (0..N-1, session then turn order),
  ``source_row`` = 1-based position of the sample in the file's list.
- ``timestamp`` = the session's ``session_<s>_date_time`` ("1:56 pm on 8 May, 2023") as
  ISO-8601 UTC text; all turns of a session share it (LoCoMo has no per-turn time and we do not
  invent one). The source gives no time zone: the wall-clock time is taken as UTC. A date-time
  this module cannot parse is passed through unchanged so validation quarantines it; a session
  without a date-time gets a null timestamp. ``session_N_date_time`` keys without a
  ``session_N`` list are ignored.
- Images: when a turn has a ``blip_caption`` (the dataset's caption of the photo the speaker
  shared), `` [shares a photo: <caption>]`` is appended to the text (a photo-only turn becomes
  ``[shares a photo: <caption>]``), so the fact that a photo was shared is not lost.

Nothing is dropped: a file that is not JSON, a sample or session of the wrong shape, or a turn
that is not an object becomes a ParseFailure (turn-level failures once per user, like the rows).

``load_locomo_qa`` / ``load_locomo_qa_with_stats`` parse the ``qa`` items defensively for
evaluation (see their docstrings).
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from qumem_pipeline.ingest.importers.base import ImportResult, ParseFailure, escape_raw, raw_frame

SESSION_KEY = re.compile(r"^session_(\d+)$")
DIA_ID = re.compile(r"^D(\d+):(\d+)$")
# Tolerant evidence token: "D1:3", "D 1:3", and the typo "D:11:26" (-> "D11:26").
EVIDENCE_TOKEN = re.compile(r"D\s*:?\s*(\d+)\s*:\s*(\d+)")
CATEGORY_NAMES = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}
_DATE_FORMATS = (
    "%I:%M %p on %d %B, %Y",
    "%I:%M %p on %d %b, %Y",
    "%I:%M %p on %d %B %Y",
    "%I:%M %p on %d %b %Y",
    "%H:%M on %d %B, %Y",
    "%H:%M on %d %B %Y",
)


# --------------------------------------------------------------------------- helpers


def slug(name: str) -> str:
    """Lower-case ASCII slug of a speaker name: 'José María' -> 'jose-maria'."""
    folded = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^a-z0-9]+", "-", folded.lower()).strip("-")


def user_id_for(sample_id: str, speaker: str) -> str:
    """The user id of one speaker of one LoCoMo conversation, e.g. ('conv-26', 'Caroline') -> 'conv-26-caroline'.

    Characters outside the user-id pattern are replaced with '-'; the result is validated later
    (an unusable id is quarantined by validation, never silently changed further here).
    """
    sid = re.sub(r"[^A-Za-z0-9_.\-]+", "-", str(sample_id))
    sid = re.sub(r"\.{2,}", ".", sid).lstrip("-_.") or "sample"
    return f"{sid}-{slug(speaker) or 'speaker'}"


def parse_locomo_datetime(value: str) -> str | None:
    """'1:56 pm on 8 May, 2023' -> '2023-05-08T13:56:00Z' (wall-clock time taken as UTC); None if unparseable."""
    s = re.sub(r"\s+", " ", value.strip())
    s = re.sub(r"(?i)\b([ap])\.?m\.?\b", lambda m: m.group(1).upper() + "M", s)
    for fmt in _DATE_FORMATS:
        try:
            dt = datetime.strptime(s, fmt)
        except ValueError:
            continue
        return dt.replace(tzinfo=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return None


def _read_json(path: str) -> tuple[object | None, ParseFailure | None]:
    src = str(path)
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, ParseFailure(src, None, "(file)", f"not valid UTF-8 at byte {e.start}", escape_raw(data[:4096]))
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, ParseFailure(
            src, None, "(file)", f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}", escape_raw(text)
        )


def _samples(obj: object) -> list | None:
    """The list of samples: the file's list, or a single sample object."""
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict) and "conversation" in obj:
        return [obj]
    return None


def _sessions(conv: dict) -> list[tuple[int, object]]:
    found = []
    for key, value in conv.items():
        m = SESSION_KEY.match(key)
        if m:
            found.append((int(m.group(1)), value))
    return sorted(found, key=lambda kv: kv[0])


def _turn_text(turn: dict) -> tuple[str | None, str | None]:
    """(text, problem): the turn's text with the photo caption appended."""
    text = turn.get("text")
    if text is not None and not isinstance(text, str):
        return None, f"text is {type(text).__name__}, expected a string"
    caption = turn.get("blip_caption")
    if isinstance(caption, str) and caption.strip():
        photo = f"[shares a photo: {caption.strip()}]"
        text = f"{text} {photo}" if text else photo
    return text, None


# --------------------------------------------------------------------------- turns


def import_locomo(path: str) -> ImportResult:
    """Import a LoCoMo-format file: two users per conversation (see the module docstring)."""
    src = str(path)
    obj, failure = _read_json(path)
    if failure is not None:
        return ImportResult(raw=raw_frame([]), failures=[failure])
    samples = _samples(obj)
    if samples is None:
        return ImportResult(
            raw=raw_frame([]),
            failures=[
                ParseFailure(
                    src, None, "(file)", f"expected a JSON list of LoCoMo samples, got {type(obj).__name__}",
                    escape_raw(json.dumps(obj, ensure_ascii=False)[:4096]),
                )
            ],
        )
    records: list[dict] = []
    failures: list[ParseFailure] = []
    for row, sample in enumerate(samples, start=1):
        recs, fails = _import_sample(src, row, sample)
        records.extend(recs)
        failures.extend(fails)
    return ImportResult(raw=raw_frame(records), failures=failures)


def _sample_failure(src: str, row: int, sample: object, reason: str, field_name: str = "(conversation)") -> ParseFailure:
    return ParseFailure(src, row, field_name, reason, escape_raw(json.dumps(sample, ensure_ascii=False, default=str)))


def _import_sample(src: str, row: int, sample: object) -> tuple[list[dict], list[ParseFailure]]:
    if not isinstance(sample, dict):
        return [], [_sample_failure(src, row, sample, f"sample is {type(sample).__name__}, expected an object")]
    sample_id = sample.get("sample_id")
    conv = sample.get("conversation")
    if not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool) or str(sample_id).strip() == "":
        return [], [_sample_failure(src, row, sample, "sample has no sample_id", "sample_id")]
    sample_id = str(sample_id)
    if not isinstance(conv, dict):
        return [], [_sample_failure(src, row, sample, f"sample {sample_id}: 'conversation' is missing or not an object", "conversation")]
    speakers = [conv.get("speaker_a"), conv.get("speaker_b")]
    if not all(isinstance(s, str) and s.strip() for s in speakers):
        return [], [_sample_failure(src, row, conv, f"sample {sample_id}: speaker_a/speaker_b missing", "speaker_a")]
    uids = [user_id_for(sample_id, s) for s in speakers]
    if uids[0] == uids[1]:  # two speakers with the same slug: keep them apart
        uids = [f"{uids[0]}-a", f"{uids[1]}-b"]

    records: list[dict] = []
    failures: list[ParseFailure] = []
    history: list[tuple[str, str, dict, str | None]] = []  # (session_id, timestamp, turn, text)
    for s, turns in _sessions(conv):
        session_id = f"session_{s}"
        if not isinstance(turns, list):
            failures.append(
                _sample_failure(src, row, turns, f"sample {sample_id}: {session_id} is {type(turns).__name__}, expected a list", session_id)
            )
            continue
        when = conv.get(f"{session_id}_date_time")
        if isinstance(when, str) and when.strip():
            ts = parse_locomo_datetime(when) or when  # unparseable: pass through, validation quarantines
        else:
            ts = None
        for turn in turns:
            if not isinstance(turn, dict):
                for uid in uids:
                    failures.append(
                        ParseFailure(src, row, "(turn)", f"sample {sample_id} {session_id}: turn is {type(turn).__name__}, expected an object",
                                     escape_raw(json.dumps(turn, ensure_ascii=False, default=str)), user_id=uid)
                    )
                continue
            text, problem = _turn_text(turn)
            if problem is not None:
                for uid in uids:
                    failures.append(
                        ParseFailure(src, row, "text", f"sample {sample_id} {session_id} {turn.get('dia_id')}: {problem}",
                                     escape_raw(json.dumps(turn, ensure_ascii=False, default=str)), user_id=uid)
                    )
                continue
            history.append((session_id, ts, turn, text))

    for uid, me in zip(uids, speakers):
        for idx, (session_id, ts, turn, text) in enumerate(history):
            spk = turn.get("speaker")
            if isinstance(spk, str) and spk.strip():
                role = "user" if spk == me else "other"
            else:
                role, spk = None, None  # no speaker: validation quarantines the missing role
            dia = turn.get("dia_id")
            records.append(
                {
                    "user_id": uid,
                    "conversation_id": sample_id,
                    "session_id": session_id,
                    "turn_index": idx,
                    "role": role,
                    "speaker": spk,
                    "text": text,
                    "timestamp": ts,
                    "source_ref": dia if isinstance(dia, str) else (str(dia) if dia is not None else None),
                    "source_file": src,
                    "source_row": row,
                }
            )
    return records, failures


def locomo_user_ids(path: str) -> list[str]:
    """The user ids import_locomo produces for a file (two per well-formed conversation)."""
    res = import_locomo(path)
    return res.raw["user_id"].unique(maintain_order=True).to_list()


# --------------------------------------------------------------------------- QA


@dataclass
class LocomoQAStats:
    """What load_locomo_qa kept, repaired and skipped (nothing is skipped silently)."""

    items: int = 0
    evidence_ids: int = 0  # evidence ids kept
    evidence_repaired: int = 0  # ids recovered from malformed strings ("D8:6; D9:17", "D:11:26")
    evidence_malformed: int = 0  # evidence strings holding no recognisable id ("D")
    evidence_unknown: int = 0  # well-formed ids that name no turn of that conversation
    items_without_evidence: int = 0  # items left with no usable evidence id
    answers_converted: int = 0  # non-string answers (e.g. the integer 2022) turned into text
    adversarial: int = 0  # category 5 items answered with adversarial_answer
    items_skipped: int = 0  # qa entries that are not objects or lack a question
    skipped: list[dict] = field(default_factory=list)  # {sample_id, qa_index, what, value}

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "skipped"} | {"skipped": list(self.skipped)}


def _answer_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def load_locomo_qa(path: str) -> list[dict]:
    """The QA items of a LoCoMo file; see load_locomo_qa_with_stats for what is skipped."""
    return load_locomo_qa_with_stats(path)[0]


def load_locomo_qa_with_stats(path: str) -> tuple[list[dict], LocomoQAStats]:
    """Parse every ``qa`` item defensively.

    Each item: ``sample_id``, ``qa_index`` (position in the sample's list), ``user_ids`` (both
    speakers' users), ``category`` (int or None), ``category_name``, ``question``, ``answer``
    (text; integers converted; category 5 uses ``adversarial_answer`` when present),
    ``adversarial`` (bool), ``evidence`` (dia ids that exist in that conversation, de-duplicated,
    in order), ``evidence_raw`` (as in the file), ``evidence_skipped`` (what was dropped).

    Malformed evidence strings are split ("D1:3 D1:5", "D8:6; D9:17") and the typo "D:11:26" is
    read as "D11:26"; strings with no id ("D") and ids that name no turn of the conversation are
    dropped and counted in the returned LocomoQAStats.
    """
    stats = LocomoQAStats()
    obj, failure = _read_json(path)
    if failure is not None:
        raise ValueError(f"{path}: {failure.reason}")
    samples = _samples(obj)
    if samples is None:
        raise ValueError(f"{path}: expected a JSON list of LoCoMo samples, got {type(obj).__name__}")
    items: list[dict] = []
    for sample in samples:
        if not isinstance(sample, dict):
            continue
        sample_id = str(sample.get("sample_id"))
        conv = sample.get("conversation") if isinstance(sample.get("conversation"), dict) else {}
        known = {
            t.get("dia_id")
            for _, turns in _sessions(conv)
            if isinstance(turns, list)
            for t in turns
            if isinstance(t, dict)
        }
        speakers = [conv.get("speaker_a"), conv.get("speaker_b")]
        uids = [user_id_for(sample_id, s) for s in speakers if isinstance(s, str) and s.strip()]
        if len(uids) == 2 and uids[0] == uids[1]:
            uids = [f"{uids[0]}-a", f"{uids[1]}-b"]
        qa = sample.get("qa") if isinstance(sample.get("qa"), list) else []
        for qi, q in enumerate(qa):
            if not isinstance(q, dict) or not isinstance(q.get("question"), str):
                stats.items_skipped += 1
                stats.skipped.append({"sample_id": sample_id, "qa_index": qi, "what": "item", "value": q})
                continue
            cat = q.get("category")
            try:
                cat = int(cat) if cat is not None and not isinstance(cat, bool) else None
            except (TypeError, ValueError):
                cat = None
            adversarial = cat == 5
            raw_answer = q.get("adversarial_answer") if adversarial and "adversarial_answer" in q else q.get("answer")
            if adversarial:
                stats.adversarial += 1
            if raw_answer is not None and not isinstance(raw_answer, str):
                stats.answers_converted += 1
            evidence, skipped = _parse_evidence(q.get("evidence"), known, stats)
            for what, value in skipped:
                stats.skipped.append({"sample_id": sample_id, "qa_index": qi, "what": what, "value": value})
            if not evidence:
                stats.items_without_evidence += 1
            stats.items += 1
            stats.evidence_ids += len(evidence)
            items.append(
                {
                    "sample_id": sample_id,
                    "qa_index": qi,
                    "user_ids": uids,
                    "category": cat,
                    "category_name": CATEGORY_NAMES.get(cat),
                    "question": q["question"],
                    "answer": _answer_text(raw_answer),
                    "adversarial": adversarial,
                    "evidence": evidence,
                    "evidence_raw": q.get("evidence"),
                    "evidence_skipped": [v for _, v in skipped],
                }
            )
    return items, stats


def _parse_evidence(raw: object, known: set, stats: LocomoQAStats) -> tuple[list[str], list[tuple[str, object]]]:
    if raw is None:
        return [], []
    entries = raw if isinstance(raw, list) else [raw]
    kept: list[str] = []
    skipped: list[tuple[str, object]] = []
    for entry in entries:
        if not isinstance(entry, str):
            stats.evidence_malformed += 1
            skipped.append(("malformed", entry))
            continue
        s = entry.strip()
        if DIA_ID.match(s):
            ids, repaired = [s], False
        else:
            ids = [f"D{a}:{b}" for a, b in EVIDENCE_TOKEN.findall(s)]
            repaired = True
            if not ids:
                stats.evidence_malformed += 1
                skipped.append(("malformed", entry))
                continue
        for i in ids:
            if i not in known:
                stats.evidence_unknown += 1
                skipped.append(("unknown", i))
                continue
            if repaired:
                stats.evidence_repaired += 1
            if i not in kept:
                kept.append(i)
    return kept, skipped


def dialogue_ids(path: str) -> dict[str, list[str]]:
    """sample_id -> the dia_ids of its turns, in order (for evaluation lookups)."""
    obj, failure = _read_json(path)
    if failure is not None:
        raise ValueError(f"{path}: {failure.reason}")
    out: dict[str, list[str]] = {}
    for sample in _samples(obj) or []:
        if isinstance(sample, dict) and isinstance(sample.get("conversation"), dict):
            out[str(sample.get("sample_id"))] = [
                t.get("dia_id")
                for _, turns in _sessions(sample["conversation"])
                if isinstance(turns, list)
                for t in turns
                if isinstance(t, dict)
            ]
    return out


__all__ = [
    "import_locomo",
    "load_locomo_qa",
    "load_locomo_qa_with_stats",
    "LocomoQAStats",
    "parse_locomo_datetime",
    "user_id_for",
    "slug",
    "locomo_user_ids",
    "dialogue_ids",
]
