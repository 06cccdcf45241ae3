"""PersonaMem questions and contexts, loaded as the harness's conversations (one user per context).

Two layouts (``ingest.importers.personamem`` reads both contexts files):
- the 128k release: ``shared_contexts_*.jsonl`` (one line per shared context) beside
  ``questions_*.csv`` whose rows name their ``shared_context_id`` and ``end_index_in_shared_context``;
- earlier releases: ``contexts.json`` (question id -> its own messages) beside ``questions.csv``
  keyed by ``question_id``; each question is asked after its context's last message.

Questions are split dev/test by a hash of the question text (``split_of``): the two 128k contexts
ask the same questions over the same persona sessions, so a split by context would confirm nothing.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from qumem_pipeline.eval.locomo.units import Conversation

OPTION_LABEL = re.compile(r"^\s*\(([a-dA-D])\)\s*")
LETTERS = ("a", "b", "c", "d")


@dataclass(frozen=True)
class PMQuestion:
    key: str  # "<question_id>": unique per row of the questions file
    question_id: str
    sample_id: str  # the context's user id (the harness's conversation id)
    qtype: str
    topic: str
    question: str
    options: tuple[str, ...]  # option texts, labels "(a) " taken off
    correct: int  # index into options
    as_of: int  # the last message index the question may use
    split: str  # "dev" | "test"

    @property
    def category(self) -> str:  # the harness's per-category tables read this
        return self.qtype


def split_of(question_text: str) -> str:
    """'dev' or 'test' by the first byte of sha256 over the question text (about half each)."""
    return "dev" if hashlib.sha256(question_text.strip().encode("utf-8")).digest()[0] % 2 == 0 else "test"


def parse_options(raw: str) -> tuple[str, ...]:
    """The four option texts of an ``all_options`` cell (a Python-literal list), labels removed."""
    try:
        opts = ast.literal_eval(raw)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"all_options is not a Python list literal: {e}") from e
    if not isinstance(opts, (list, tuple)) or len(opts) != 4 or not all(isinstance(o, str) for o in opts):
        raise ValueError(f"all_options: expected a list of 4 strings, got {type(opts).__name__} of {len(opts) if hasattr(opts, '__len__') else '?'}")
    return tuple(OPTION_LABEL.sub("", o, count=1).strip() for o in opts)


def parse_correct(raw: str) -> int:
    m = re.search(r"\(?\s*([a-dA-D])\s*\)?", raw or "")
    if m is None:
        raise ValueError(f"correct_answer {raw!r}: expected one of (a)..(d)")
    return LETTERS.index(m.group(1).lower())


def default_paths(root: str | Path) -> tuple[Path, Path]:
    """(contexts, questions) in a PersonaMem directory of either layout."""
    root = Path(root)
    for ctx_glob, q_glob in (("shared_contexts*.jsonl", "questions*.csv"), ("contexts.json", "questions.csv")):
        ctxs, qs = sorted(root.glob(ctx_glob)), sorted(root.glob(q_glob))
        if ctxs and qs:
            return ctxs[0], qs[0]
    raise FileNotFoundError(f"{root}: no PersonaMem files (shared_contexts*.jsonl + questions*.csv, "
                            "or contexts.json + questions.csv)")


@dataclass
class PersonaMemData:
    conversations: list[Conversation]
    questions: list[PMQuestion]
    info: dict


def load(contexts_path: str | Path, questions_path: str | Path, *, contexts: Sequence[str] | None = None) -> PersonaMemData:
    """Conversations (validated turns, one user each) and every question that names a loaded context.

    ``contexts``: keep only these context user ids (``pm-<16 chars>``) or context-id prefixes."""
    from qumem_pipeline.ingest.importers.personamem import import_personamem, user_id_for
    from qumem_pipeline.ingest.validate import validate

    imported = import_personamem(str(contexts_path))
    if imported.failures:
        f = imported.failures[0]
        raise ValueError(f"{contexts_path}: {len(imported.failures)} unreadable records, first row {f.source_row} "
                         f"field {f.field}: {f.reason}")
    res = validate(imported)
    turns = res.turns
    rows = list(csv.DictReader(open(questions_path, newline="", encoding="utf-8")))
    shared = bool(rows) and "shared_context_id" in rows[0]
    questions, bad = [], []
    for i, r in enumerate(rows, start=2):  # line 1 is the header
        try:
            cid = r["shared_context_id"] if shared else r["question_id"]
            end = int(r["end_index_in_shared_context"]) if shared else None
            q = r["question"]
            questions.append(PMQuestion(
                key=r["question_id"], question_id=r["question_id"], sample_id=user_id_for(cid),
                qtype=r.get("question_type") or "unknown", topic=r.get("topic") or "", question=q,
                options=parse_options(r["all_options"]), correct=parse_correct(r["correct_answer"]),
                as_of=end if end is not None else -1, split=split_of(q)))
        except (KeyError, ValueError) as e:
            bad.append({"line": i, "question_id": r.get("question_id"), "reason": str(e)})
    if bad:
        raise ValueError(f"{questions_path}: {len(bad)} bad question rows, first line {bad[0]['line']} "
                         f"(question_id {bad[0]['question_id']}): {bad[0]['reason']}")
    keep = None if not contexts else {c if c.startswith("pm-") else user_id_for(c) for c in contexts}
    convs = []
    for (uid,), t in sorted(turns.partition_by("user_id", as_dict=True).items()):
        if keep is not None and uid not in keep:
            continue
        convs.append(_conversation(uid, t.sort("turn_index")))
    last = {c.sample_id: int(c.turns["turn_index"].max()) for c in convs}
    questions = [_with_as_of(q, last[q.sample_id]) for q in questions if q.sample_id in last]
    info = {"contexts_file": str(contexts_path), "questions_file": str(questions_path),
            "layout": "shared" if shared else "per-question", "contexts": len(convs), "turns": turns.height,
            "quarantined_turns": res.quarantine.height, "questions": len(questions),
            "distinct_questions": len({q.question for q in questions})}
    return PersonaMemData(convs, questions, info)


def _with_as_of(q: PMQuestion, last: int) -> PMQuestion:
    if 0 <= q.as_of <= last:
        return q
    from dataclasses import replace

    return replace(q, as_of=last)


def _conversation(uid: str, turns: pl.DataFrame) -> Conversation:
    """One user's context as the harness's conversation (the user is its only speaker-user)."""
    return Conversation(sample_id=uid, user_id=uid, user_ids=[uid], turns=turns,
                        dia_by_user_turn={uid: dict(zip(turns["turn_index"].to_list(), turns["source_ref"].to_list()))},
                        speaker_prefix=True, turns_by_user={uid: turns})


def up_to(conv: Conversation, as_of: int) -> Conversation:
    """The conversation as known after message ``as_of``: no turn after it can be retrieved or shown."""
    if as_of >= int(conv.turns["turn_index"].max()):
        return conv
    return _conversation(conv.user_id, conv.turns.filter(pl.col("turn_index") <= as_of))
