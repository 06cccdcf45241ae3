"""Step 0 of the LoCoMo harness, load: conversations, QA items and memories tables.

Enters: a LoCoMo-format JSON file (optionally sliced to some conversations / first sessions) and,
optionally, a memories Parquet table. Leaves: ``Conversation``s (through the product's importer and
validation), ``QAItem``s with the gold evidence that names a valid turn, and what was skipped.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from qumem_pipeline.eval.locomo.score import QAItem
from qumem_pipeline.eval.locomo.units import Conversation


def load_conversations(path: str, limit: int | None = None) -> tuple[list[Conversation], dict]:
    from qumem_pipeline.ingest.importers.locomo import import_locomo
    from qumem_pipeline.ingest.validate import validate

    res = validate(import_locomo(path))
    turns = res.turns
    info = {"valid_turns": turns.height, "quarantined_rows": res.quarantine.height}
    order = turns["conversation_id"].unique(maintain_order=True).to_list()
    if limit is not None:
        order = order[:limit]
    convs = []
    for sid in order:
        t = turns.filter(pl.col("conversation_id") == sid).sort(["user_id", "turn_index"])
        users = t["user_id"].unique(maintain_order=True).to_list()
        by_user = {u: t.filter(pl.col("user_id") == u).sort("turn_index") for u in users}
        dia_maps = {u: dict(zip(g["turn_index"].to_list(), g["source_ref"].to_list())) for u, g in by_user.items()}
        convs.append(Conversation(sid, users[0], users, by_user[users[0]], dia_maps, turns_by_user=by_user))
    return convs, info


def _speaker_a_first(convs: list[Conversation], qa: list[dict]) -> None:
    """Use the QA items' user order (speaker_a first) for each conversation's primary user."""
    order = {q["sample_id"]: q["user_ids"] for q in qa}
    for c in convs:
        want = order.get(c.sample_id)
        if want and want[0] in c.dia_by_user_turn and want[0] != c.user_id:
            c.user_id = want[0]
            if c.turns_by_user:
                c.turns = c.turns_by_user[want[0]]
            c.user_ids = [u for u in want if u in c.dia_by_user_turn] + [u for u in c.user_ids if u not in want]


def read_memories(path: str | os.PathLike) -> pl.DataFrame:
    """A memories table: one Parquet file, a Parquet table directory, a Delta table or a data root."""
    p = Path(path)
    if p.is_dir() and (p / "memories").is_dir():
        p = p / "memories"
    if (p / "_delta_log").is_dir():  # the pipeline's table store: its active version, never old files
        from qumem_pipeline.storage.layout import DataLayout

        df = DataLayout(p.parent).read_table("memories")
        if df is None or df.height == 0:
            raise FileNotFoundError(f"no memories in the table store under {path}")
    else:
        files = [p] if p.is_file() else sorted(x for x in p.rglob("*.parquet") if not x.name.startswith(".tmp-"))
        if not files:
            raise FileNotFoundError(f"no Parquet files under {path}")
        df = pl.read_parquet(files, hive_partitioning=False)
    missing = {"user_id", "content", "evidence_turn_ids"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: not a memories table (missing {sorted(missing)})")
    return df


def slice_locomo(path: str, out_dir: str | os.PathLike, conversations: Sequence[str] | None = None,
                 max_sessions: int | None = None) -> tuple[Path, dict]:
    """A LoCoMo file cut to some conversations and/or their first ``max_sessions`` sessions.

    QA items are kept only when every evidence id lies in a kept session, so a sliced run never
    asks for evidence its units cannot contain. Written as a new file so the real importer and QA
    loader read it unchanged.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of LoCoMo samples")
    if conversations:
        known = {str(x.get("sample_id")) for x in data if isinstance(x, dict)}
        missing = [c for c in conversations if c not in known]
        if missing:
            raise ValueError(f"{path}: no conversation(s) {missing}; the file has {sorted(known)}")
        data = [x for x in data if isinstance(x, dict) and str(x.get("sample_id")) in set(conversations)]
    info = {"conversations": [str(x.get("sample_id")) for x in data], "max_sessions": max_sessions,
            "qa_items_dropped_evidence_outside_slice": 0}
    if max_sessions is not None:
        if max_sessions < 1:
            raise ValueError("--max-sessions must be >= 1")
        for sample in data:
            info["qa_items_dropped_evidence_outside_slice"] += _cut_sessions(sample, max_sessions)
    out = Path(out_dir) / (Path(path).stem + ".slice.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(".tmp-" + out.name)
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, out)
    return out, info


def _cut_sessions(sample: dict, max_sessions: int) -> int:
    """Drop sessions after ``max_sessions`` and the QA items citing them (in place); returns items dropped."""
    conv = sample.get("conversation") or {}
    for key in list(conv):
        m = re.match(r"^session_(\d+)(_date_time)?$", key)
        if m and int(m.group(1)) > max_sessions:
            del conv[key]
    kept, dropped = [], 0
    for q in sample.get("qa") or []:
        ev = [str(e) for e in (q.get("evidence") or [])]
        sess = [int(m.group(1)) for e in ev for m in [re.match(r"^D(\d+):\d+$", e)] if m]
        if sess and len(sess) == len(ev) and max(sess) <= max_sessions:
            kept.append(q)
        else:
            dropped += 1
    sample["qa"] = kept
    return dropped


@dataclass
class LocomoData:
    """A loaded (possibly sliced) LoCoMo file: conversations with their primary user set, raw QA items."""

    conversations: list[Conversation]
    qa: list[dict]
    qa_stats: object  # LocomoQAStats
    slice_info: dict | None
    load_info: dict


def load_dataset(path: str, *, conversations: Sequence[str] | None = None, max_sessions: int | None = None,
                 limit_conversations: int | None = None, speaker_prefix: bool = True) -> LocomoData:
    """Slice (when asked), import, validate; speaker_a's user becomes each conversation's primary user."""
    from qumem_pipeline.ingest.importers.locomo import load_locomo_qa_with_stats

    slice_info = None
    with tempfile.TemporaryDirectory(prefix="locomo-slice-") as tmp:
        data_path = str(path)
        if conversations or max_sessions is not None:
            sliced, slice_info = slice_locomo(path, tmp, conversations, max_sessions)
            data_path = str(sliced)
        convs, load_info = load_conversations(data_path, limit_conversations)
        qa_all, qa_stats = load_locomo_qa_with_stats(data_path)
    _speaker_a_first(convs, qa_all)
    for c in convs:
        c.speaker_prefix = speaker_prefix
    return LocomoData(convs, qa_all, qa_stats, slice_info, load_info)


def qa_items(convs: list[Conversation], qa: list[dict], qa_stats=None) -> tuple[dict[str, list[QAItem]], dict]:
    """Per conversation, the QA items with at least one gold evidence id naming a valid turn; the
    counts of what was left out start the report's ``skipped``."""
    conv_by_id = {c.sample_id: c for c in convs}
    skipped: dict = {"items_without_valid_evidence": 0, "evidence_ids_not_in_valid_turns": 0,
                     "items_outside_limited_conversations": 0}
    if qa_stats is not None:
        skipped["qa_loader"] = {k: v for k, v in qa_stats.as_dict().items() if k != "skipped"}
    items_by_conv: dict[str, list[QAItem]] = defaultdict(list)
    for q in qa:
        conv = conv_by_id.get(q["sample_id"])
        if conv is None:
            skipped["items_outside_limited_conversations"] += 1
            continue
        known = set(conv.turns["source_ref"].to_list())
        gold = [d for d in q["evidence"] if d in known]
        skipped["evidence_ids_not_in_valid_turns"] += len(q["evidence"]) - len(gold)
        if not gold:
            skipped["items_without_valid_evidence"] += 1
            continue
        items_by_conv[conv.sample_id].append(QAItem(conv.sample_id, q["category"], q["question"], frozenset(gold)))
    return items_by_conv, skipped
