"""LoCoMo retrieval harness: evidence recall at equal word budgets for different retrieval units.

For every conversation of a LoCoMo-format file, each QA item is answered with as_of = the end of
the conversation. Retrieval runs over units built from the conversation and the question; units are
ranked by cosine similarity (all-MiniLM-L6-v2, unit-norm vectors) and taken in rank order until a
word budget (128 / 256 / 512 / 1024 words of retrieved text) is spent. Recall is the share of the
item's gold evidence turns (``evidence`` dia_ids that name a turn of the conversation) covered by
the retrieved text, averaged over items with at least one valid evidence id.

Units (each covers a set of turns and costs its own word count):

- ``turns``: one turn, text ``"<speaker>: <text>"`` (photo captions as the importer renders them);
- ``fixed_chunks``: non-overlapping windows of 2, 4 and 8 consecutive turns within a session (the
  last window of a session may be shorter); each size is reported, and ``fixed_chunks`` holds the
  size with the best mean recall over the four budgets (``window_turns`` says which);
- ``sessions``: a whole session;
- ``episodes``: the continuity classifier's episodes (``build_episodes_for_users``);
- ``memories``: typed memories from a memories Parquet table (``--memories``); a memory costs the
  words of its content and covers its evidence turns. Both speakers' memories are pooled (a
  question may concern either speaker).

Both users of a conversation hold the whole conversation (LoCoMo importer), so turn-based units are
built once from speaker_a's user history; the evidence is the same turns for both.

Budget rule: units are taken whole while they fit. The unit that crosses the budget is truncated to
the remaining words (rather than dropped, which would penalise large units twice, or counted whole,
which would overspend): its turns are taken in order while they fit, and the turn that crosses
counts as covered only when at least half of its words fit (``MIN_COVER_FRACTION``); a memory is one
piece, so a truncated memory counts only when at least half of its words fit. Then retrieval stops.

Embedding inputs are truncated at the model's 256 word pieces; long units (sessions, large windows,
episodes) are embedded from their beginning only - one reason bigger raw units lose with a small
embedder.

Headline figures (``retrieval``) are over categories 1-4; ``retrieval_with_adversarial`` adds
category 5 (adversarial). ``per_category`` has every category.

Strategies side by side (``--strategies qumem,adamem,topk``): each query strategy's ranked retrieval
under the same word budgets, one row per strategy in every table (see ``qumem_pipeline.adamem.eval_units``).

CLI: ``python -m qumem_pipeline.eval_locomo PATH [--json] [--memories PARQUET_DIR] [--limit-conversations N]
[--strategies qumem,adamem,topk]``;
with ``--json`` the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

BUDGETS = (128, 256, 512, 1024)
WINDOW_SIZES = (2, 4, 8)
MIN_COVER_FRACTION = 0.5
UNIT_KINDS = ("turns", "fixed_chunks", "sessions", "episodes", "memories")
HEADLINE_CATEGORIES = (1, 2, 3, 4)
ALL_CATEGORIES = (1, 2, 3, 4, 5)
BUDGET_RULE = (
    "units taken whole in rank order while they fit; the unit crossing the budget is truncated to the "
    "remaining words: its turns count while they fit, the crossing turn (or a memory) counts when >= half "
    "of its words fit"
)


# ---------------------------------------------------------------------------------------- units


def word_count(text: str | None) -> int:
    return len(text.split()) if text else 0


@dataclass
class EvalUnit:
    """A retrievable unit: its text (embedded) and pieces, each covering turns at a word cost."""

    text: str
    pieces: list[tuple[frozenset, int]]  # (dia_ids covered, words), in text order

    @property
    def words(self) -> int:
        return sum(w for _, w in self.pieces)


def budgeted_coverage(ranked: Iterable[EvalUnit], budgets: Sequence[int] = BUDGETS,
                      min_fraction: float = MIN_COVER_FRACTION) -> dict[int, set]:
    """Turns covered at each budget by taking units in rank order (see the module's budget rule)."""
    budgets = sorted(budgets)
    out: dict[int, set] = {}
    covered: set = set()
    spent = 0
    bi = 0
    units = iter(ranked)
    exhausted = False
    while bi < len(budgets):
        b = budgets[bi]
        # finish every budget already reached before taking more units
        if exhausted:
            out[b] = set(covered)
            bi += 1
            continue
        try:
            unit = next(units)
        except StopIteration:
            exhausted = True
            continue
        # walk this unit's pieces, closing every budget it crosses
        for ids, w in unit.pieces:
            while bi < len(budgets) and spent + w > budgets[bi]:
                remaining = budgets[bi] - spent
                partial = set(covered)
                if w > 0 and remaining >= min_fraction * w:
                    partial |= ids
                out[budgets[bi]] = partial
                bi += 1
            covered |= ids
            spent += w
        if bi < len(budgets) and spent == budgets[bi]:
            out[budgets[bi]] = set(covered)
            bi += 1
    return out


def budgeted_recall(ranked: Iterable[EvalUnit], gold: Iterable, budgets: Sequence[int] = BUDGETS,
                    min_fraction: float = MIN_COVER_FRACTION) -> dict[int, float]:
    gold = set(gold)
    if not gold:
        raise ValueError("recall needs at least one gold evidence turn")
    cov = budgeted_coverage(ranked, budgets, min_fraction)
    return {b: len(cov[b] & gold) / len(gold) for b in budgets}


@dataclass
class Conversation:
    sample_id: str
    user_id: str  # speaker_a's user: whose history holds both speakers' turns
    user_ids: list[str]
    turns: pl.DataFrame  # that user's validated turns, sorted by turn_index
    dia_by_user_turn: dict[str, dict[int, str]]  # user -> turn_index -> dia_id
    speaker_prefix: bool = True

    def lines(self) -> list[tuple[str, str, str]]:
        """(dia_id, session_id, rendered text) per turn."""
        return [
            (d, s, f"{sp}: {t}" if sp and self.speaker_prefix else t)
            for d, s, sp, t in zip(self.turns["source_ref"].to_list(), self.turns["session_id"].to_list(),
                                   self.turns["speaker"].to_list(), self.turns["text"].to_list())
        ]


def _unit_from_lines(lines: Sequence[tuple[str, str, str]]) -> EvalUnit:
    return EvalUnit("\n".join(l[2] for l in lines), [(frozenset([l[0]]), word_count(l[2])) for l in lines])


def turn_units(conv: Conversation) -> list[EvalUnit]:
    return [_unit_from_lines([l]) for l in conv.lines()]


def window_units(conv: Conversation, size: int) -> list[EvalUnit]:
    """Non-overlapping windows of `size` consecutive turns, never crossing a session boundary."""
    out: list[EvalUnit] = []
    for _, group in _by_session(conv.lines()):
        for i in range(0, len(group), size):
            out.append(_unit_from_lines(group[i : i + size]))
    return out


def session_units(conv: Conversation) -> list[EvalUnit]:
    return [_unit_from_lines(g) for _, g in _by_session(conv.lines())]


def _by_session(lines):
    groups: list[tuple[str, list]] = []
    for l in lines:
        if not groups or groups[-1][0] != l[1]:
            groups.append((l[1], []))
        groups[-1][1].append(l)
    return groups


def episode_units(conv: Conversation, episodes: pl.DataFrame | None) -> list[EvalUnit]:
    if episodes is None or episodes.height == 0:
        return []
    lines = conv.lines()
    by_ti = dict(zip(conv.turns["turn_index"].to_list(), lines))
    out = []
    for ids in episodes.sort("episode_index")["turn_ids"].to_list():
        ls = [by_ti[t] for t in ids if t in by_ti]
        if ls:
            out.append(_unit_from_lines(ls))
    return out


def memory_units(conv: Conversation, memories: pl.DataFrame) -> list[EvalUnit]:
    """Memories of the conversation's users; evidence turn ids mapped to dia_ids via each user's turns."""
    out = []
    rows = memories.filter(pl.col("user_id").is_in(conv.user_ids))
    for uid, content, ev in zip(rows["user_id"].to_list(), rows["content"].to_list(), rows["evidence_turn_ids"].to_list()):
        m = conv.dia_by_user_turn.get(uid, {})
        dias = frozenset(m[t] for t in (ev or []) if t in m)
        text = content or ""
        out.append(EvalUnit(text, [(dias, word_count(text))]))
    return out


# ---------------------------------------------------------------------------------------- loading


def load_conversations(path: str, limit: int | None = None) -> tuple[list[Conversation], dict]:
    from qumem_pipeline.importers.locomo import import_locomo
    from qumem_pipeline.validate import validate

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
        dia_maps = {
            u: dict(zip(g["turn_index"].to_list(), g["source_ref"].to_list()))
            for u in users
            for g in [t.filter(pl.col("user_id") == u)]
        }
        convs.append(Conversation(sid, users[0], users, t.filter(pl.col("user_id") == users[0]).sort("turn_index"), dia_maps))
    return convs, info


def _speaker_a_first(convs: list[Conversation], qa: list[dict]) -> None:
    """Use the QA items' user order (speaker_a first) for each conversation's primary user."""
    order = {q["sample_id"]: q["user_ids"] for q in qa}
    for c in convs:
        want = order.get(c.sample_id)
        if want and want[0] in c.dia_by_user_turn and want[0] != c.user_id:
            c.user_id = want[0]
            c.user_ids = [u for u in want if u in c.dia_by_user_turn] + [u for u in c.user_ids if u not in want]


def read_memories(path: str | os.PathLike) -> pl.DataFrame:
    """A memories table: one Parquet file, a table directory (user_id=*/part-0.parquet) or a data root."""
    p = Path(path)
    if p.is_dir() and (p / "memories").is_dir():
        p = p / "memories"
    files = [p] if p.is_file() else sorted(x for x in p.rglob("*.parquet") if not x.name.startswith(".tmp-"))
    if not files:
        raise FileNotFoundError(f"no Parquet files under {path}")
    df = pl.read_parquet(files, hive_partitioning=False)
    missing = {"user_id", "content", "evidence_turn_ids"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: not a memories table (missing {sorted(missing)})")
    return df


def build_episodes(convs: list[Conversation], artifact_dir: str | None = None, device=None) -> tuple[dict[str, pl.DataFrame], str]:
    from qumem_pipeline.continuity import ContinuityClassifier
    from qumem_pipeline.continuity.decoding import rule_of
    from qumem_pipeline.episodes import build_episodes_for_users

    clf = ContinuityClassifier.load(artifact_dir, device=device)
    turns_by_user = {c.user_id: c.turns for c in convs}
    eps, _ = build_episodes_for_users(
        turns_by_user, clf.predict_same_proba, rule=rule_of(clf), classifier_version=clf.version
    )
    return eps, clf.version


# ---------------------------------------------------------------------------------------- evaluation


@dataclass
class QAItem:
    sample_id: str
    category: int | None
    question: str
    gold: frozenset


def _rank_and_score(units: list[EvalUnit], unit_vecs: np.ndarray, q_vecs: np.ndarray, items: list[QAItem],
                    budgets: Sequence[int], min_fraction: float = MIN_COVER_FRACTION) -> list[dict[int, float]]:
    if not units:
        return [{b: 0.0 for b in budgets} for _ in items]
    scores = q_vecs @ unit_vecs.T
    out = []
    for qi, item in enumerate(items):
        order = np.argsort(-scores[qi], kind="stable")
        out.append(budgeted_recall((units[j] for j in order), item.gold, budgets, min_fraction))
    return out


def _aggregate(values: list[tuple[int | None, dict[int, float]]], cats: Iterable[int], budgets) -> dict | None:
    cats = set(cats)
    sel = [r for c, r in values if c in cats]
    if not sel:
        return None
    return {str(b): round(float(np.mean([r[b] for r in sel])), 4) for b in budgets}


def run_eval(
    path: str,
    *,
    memories: str | os.PathLike | pl.DataFrame | None = None,
    limit_conversations: int | None = None,
    units: Sequence[str] = UNIT_KINDS,
    window_sizes: Sequence[int] = WINDOW_SIZES,
    budgets: Sequence[int] = BUDGETS,
    continuity_artifact: str | None = None,
    device=None,
    embedder=None,
    batch_size: int = 64,
    min_cover_fraction: float = MIN_COVER_FRACTION,
    speaker_prefix: bool = True,
    strategies: Sequence[str] = (),
    log=None,
) -> dict:
    """The full report (a JSON-serialisable dict). See the module docstring."""
    from qumem_pipeline.embeddings import Embedder
    from qumem_pipeline.importers.locomo import CATEGORY_NAMES, load_locomo_qa_with_stats

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    budgets = tuple(sorted(budgets))
    unknown = set(units) - set(UNIT_KINDS)
    if unknown:
        raise ValueError(f"unknown unit kinds {sorted(unknown)}; expected {UNIT_KINDS}")
    from qumem_pipeline.adamem.eval_units import EVAL_STRATEGIES, NEEDS_LLM, strategy_rankings

    strategies = list(dict.fromkeys(strategies))
    if set(strategies) - set(EVAL_STRATEGIES):
        raise ValueError(f"unknown strategies {sorted(set(strategies) - set(EVAL_STRATEGIES))}; expected {EVAL_STRATEGIES}")
    convs, load_info = load_conversations(path, limit_conversations)
    qa_all, qa_stats = load_locomo_qa_with_stats(path)
    _speaker_a_first(convs, qa_all)
    for c in convs:
        c.speaker_prefix = speaker_prefix
    conv_by_id = {c.sample_id: c for c in convs}

    skipped: dict = {"items_without_valid_evidence": 0, "evidence_ids_not_in_valid_turns": 0,
                     "items_outside_limited_conversations": 0,
                     "qa_loader": {k: v for k, v in qa_stats.as_dict().items() if k != "skipped"}}
    items_by_conv: dict[str, list[QAItem]] = defaultdict(list)
    for q in qa_all:
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
    n_items = sum(len(v) for v in items_by_conv.values())
    log(f"[locomo] {len(convs)} conversations, {n_items} QA items with evidence")

    # ---- optional unit sources
    episodes_by_user: dict[str, pl.DataFrame] | None = None
    classifier_version = None
    if "episodes" in units:
        try:
            te = time.perf_counter()
            episodes_by_user, classifier_version = build_episodes(convs, continuity_artifact, device)
            log(f"[locomo] episodes built in {time.perf_counter() - te:.1f}s ({classifier_version})")
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:
            skipped["episodes"] = f"continuity classifier unavailable: {e}"
            log(f"[locomo] episodes skipped: {e}")
    mem_df: pl.DataFrame | None = None
    if "memories" in units:
        if memories is None:
            skipped["memories"] = ("no memories table given (--memories PARQUET_DIR); typed memories need the "
                                   "decomposition step's LLM")
        else:
            try:
                mem_df = memories if isinstance(memories, pl.DataFrame) else read_memories(memories)
            except (FileNotFoundError, ValueError, OSError) as e:
                skipped["memories"] = f"memories table unreadable: {e}"
    elif strategies and memories is not None:
        mem_df = memories if isinstance(memories, pl.DataFrame) else read_memories(memories)
    for name, why in NEEDS_LLM.items():
        if name in strategies:
            skipped[f"strategy_{name}"] = why
    run_strategies = [s for s in strategies if s not in NEEDS_LLM]

    emb = embedder or Embedder.load(device=device)
    questions = [it.question for c in convs for it in items_by_conv[c.sample_id]]
    te = time.perf_counter()
    q_all = emb.encode(questions, batch_size=batch_size)
    log(f"[locomo] {len(questions)} questions embedded in {time.perf_counter() - te:.1f}s")

    kinds: list[tuple[str, object]] = []  # (result key, builder)
    if "turns" in units:
        kinds.append(("turns", turn_units))
    if "fixed_chunks" in units:
        for s in window_sizes:
            kinds.append((f"window_{s}", lambda c, s=s: window_units(c, s)))
    if "sessions" in units:
        kinds.append(("sessions", session_units))
    if episodes_by_user is not None:
        kinds.append(("episodes", lambda c: episode_units(c, episodes_by_user.get(c.user_id))))
    if mem_df is not None:
        kinds.append(("memories", lambda c: memory_units(c, mem_df)))

    per_kind: dict[str, list[tuple[int | None, dict[int, float]]]] = defaultdict(list)
    unit_stats: dict[str, dict] = defaultdict(lambda: {"n_units": 0, "words": 0, "seconds_embedding": 0.0})
    mem_conversations: list[str] = []
    offset = 0
    for conv in convs:
        items = items_by_conv[conv.sample_id]
        qv = q_all[offset : offset + len(items)]
        offset += len(items)
        if not items:
            continue
        for key, builder in kinds:
            us = builder(conv)
            if key == "memories":
                if not us:
                    continue  # no memories for this conversation's users: excluded, reported below
                mem_conversations.append(conv.sample_id)
            te = time.perf_counter()
            uv = emb.encode([u.text for u in us], batch_size=batch_size)
            st = unit_stats[key]
            st["seconds_embedding"] += time.perf_counter() - te
            st["n_units"] += len(us)
            st["words"] += sum(u.words for u in us)
            for it, rec in zip(items, _rank_and_score(us, uv, qv, items, budgets, min_cover_fraction)):
                per_kind[key].append((it.category, rec))
        if run_strategies:
            te = time.perf_counter()
            ranked = strategy_rankings(
                conv, [it.question for it in items], qv, run_strategies, emb, mem_df,
                episodes_by_user.get(conv.user_id) if episodes_by_user else None,
                lambda dias, text: EvalUnit(text, [(frozenset(dias), word_count(text))]))
            for name, lists in ranked.items():
                for it, units_ranked in zip(items, lists):
                    per_kind[f"strategy_{name}"].append(
                        (it.category, budgeted_recall(units_ranked, it.gold, budgets, min_cover_fraction)))
            unit_stats["strategies"]["seconds_embedding"] += time.perf_counter() - te
        log(f"[locomo] {conv.sample_id}: {len(items)} items, {len(kinds)} unit kinds done "
            f"({time.perf_counter() - t0:.0f}s)")

    def summary(key: str, cats) -> dict | None:
        return _aggregate(per_kind[key], cats, budgets) if key in per_kind else None

    def mean_recall(d: dict | None) -> float:
        return float(np.mean(list(d.values()))) if d else -1.0

    window_keys = [f"window_{s}" for s in window_sizes if f"window_{s}" in per_kind]
    best_window = max(window_keys, key=lambda k: mean_recall(summary(k, HEADLINE_CATEGORIES)), default=None)

    def block(cats) -> dict:
        fixed = summary(best_window, cats) if best_window else None
        r = {
            "turns": summary("turns", cats),
            "fixed_chunks": ({**fixed, "window_turns": int(best_window.split("_")[1])} if fixed else None),
            "fixed_chunks_by_size": {k.split("_")[1]: summary(k, cats) for k in window_keys} or None,
            "sessions": summary("sessions", cats),
            "episodes": summary("episodes", cats),
            "memories": summary("memories", cats),
        }
        if strategies:
            r["strategies"] = {s: summary(f"strategy_{s}", cats) for s in strategies}
        return r

    if "memories" in units and mem_df is not None and not mem_conversations:
        skipped["memories"] = "the memories table holds no memories of these conversations' users"
    elif mem_conversations and len(mem_conversations) < sum(1 for c in convs if items_by_conv[c.sample_id]):
        skipped["memories_partial"] = (
            f"memories only for conversations {mem_conversations}; memories figures cover those conversations' "
            f"items only (see memories_subset_turns for single turns on the same items)"
        )
    if "fixed_chunks" in units and not window_keys:
        skipped["fixed_chunks"] = "no window sizes given"

    per_category = {}
    cat_counts = defaultdict(int)
    for its in items_by_conv.values():
        for it in its:
            cat_counts[it.category] += 1
    for c in ALL_CATEGORIES:
        if cat_counts.get(c):
            per_category[str(c)] = {"name": CATEGORY_NAMES.get(c), "n": cat_counts[c], **block((c,))}
    if cat_counts.get(None):
        skipped["items_without_category"] = cat_counts[None]

    report = {
        "dataset": str(path),
        "n_conversations": len(convs),
        "n_questions": sum(1 for c in convs for it in items_by_conv[c.sample_id] if it.category in HEADLINE_CATEGORIES),
        "n_questions_with_adversarial": n_items,
        "budgets": list(budgets),
        "retrieval_scope": "categories 1-4 (adversarial excluded); retrieval_with_adversarial adds category 5",
        "retrieval": block(HEADLINE_CATEGORIES),
        "retrieval_with_adversarial": block(ALL_CATEGORIES),
        "per_category": per_category,
        "units": {k: {"n_units": v["n_units"], "mean_words": round(v["words"] / max(v["n_units"], 1), 1),
                      "seconds_embedding": round(v["seconds_embedding"], 1)} for k, v in unit_stats.items()},
        "budget_rule": BUDGET_RULE if min_cover_fraction == MIN_COVER_FRACTION
        else f"{BUDGET_RULE} [min_cover_fraction={min_cover_fraction}]",
        "speaker_prefix": speaker_prefix,
        "embedding_model": emb.version,
        "continuity_classifier": classifier_version,
        "as_of": "end of conversation",
        "primary_user": {c.sample_id: c.user_id for c in convs},
        "load": load_info,
        "skipped": skipped,
    }
    if mem_conversations:
        memset = set(mem_conversations)
        sub = [(cat, r) for (cat, r), conv_id in zip(per_kind["turns"], _item_conv_ids(convs, items_by_conv))
               if conv_id in memset] if "turns" in per_kind else []
        report["memories_subset_turns"] = _aggregate(sub, HEADLINE_CATEGORIES, budgets) if sub else None
        report["memories_n_memories"] = int(mem_df.filter(pl.col("user_id").is_in(
            [u for c in convs if c.sample_id in memset for u in c.user_ids])).height)
        if "model" in mem_df.columns:
            report["memories_model"] = sorted(str(m) for m in mem_df["model"].unique().to_list())
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def _item_conv_ids(convs, items_by_conv) -> list[str]:
    return [c.sample_id for c in convs for _ in items_by_conv[c.sample_id]]


# ---------------------------------------------------------------------------------------- output


def format_table(report: dict) -> str:
    budgets = [str(b) for b in report["budgets"]]
    lines = [f"LoCoMo retrieval: evidence recall at word budgets ({report['dataset']}, "
             f"{report['n_conversations']} conversations, {report['n_questions']} questions cat 1-4, "
             f"{report['n_questions_with_adversarial']} with cat 5; {report['embedding_model']})"]

    def rows(block: dict) -> list[tuple[str, dict | None]]:
        out = [("turns", block["turns"])]
        for s, v in (block.get("fixed_chunks_by_size") or {}).items():
            out.append((f"window {s}", v))
        if block.get("fixed_chunks"):
            out.append((f"fixed (best={block['fixed_chunks']['window_turns']})", block["fixed_chunks"]))
        out += [("sessions", block["sessions"]), ("episodes", block["episodes"]), ("memories", block["memories"])]
        out += [(f"strategy {s}", v) for s, v in (block.get("strategies") or {}).items()]
        return out

    def table(title: str, block: dict) -> None:
        lines.append("")
        lines.append(title)
        lines.append(f"  {'unit':<18}" + "".join(f"{b:>8}" for b in budgets))
        for name, vals in rows(block):
            if vals is None:
                lines.append(f"  {name:<18}" + f"{'n/a':>8}" * len(budgets))
            else:
                lines.append(f"  {name:<18}" + "".join(f"{vals[b]:>8.3f}" for b in budgets))

    table("overall (categories 1-4)", report["retrieval"])
    table("overall with adversarial (categories 1-5)", report["retrieval_with_adversarial"])
    for c, blk in report["per_category"].items():
        table(f"category {c} ({blk['name']}, n={blk['n']})", blk)
    sk = {k: v for k, v in report["skipped"].items() if k != "qa_loader"}
    lines.append("")
    lines.append(f"skipped: {json.dumps(sk)}")
    lines.append(f"budget rule: {report['budget_rule']}")
    lines.append(f"wall time: {report['wall_s']}s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qumem_pipeline.eval_locomo", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a LoCoMo-format JSON file")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--memories", help="memories Parquet table (file, table dir or data root)")
    ap.add_argument("--limit-conversations", type=int, default=None)
    ap.add_argument("--units", default=",".join(UNIT_KINDS), help=f"comma list of {UNIT_KINDS}")
    ap.add_argument("--window-sizes", default=",".join(map(str, WINDOW_SIZES)))
    ap.add_argument("--continuity-artifact", default=None, help="continuity classifier artifact dir")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: CUDA when available)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--min-cover-fraction", type=float, default=MIN_COVER_FRACTION,
                    help="share of a budget-crossing turn/memory that must fit for it to count (>1: never)")
    ap.add_argument("--no-speaker-prefix", action="store_true", help="embed/count turns without '<speaker>: '")
    ap.add_argument("--strategies", default="", help="comma list of query strategies to compare side by side "
                    "(qumem,adamem,topk); qumem needs an LLM and is skipped in retrieval-only runs")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    report = run_eval(
        args.path,
        memories=args.memories,
        limit_conversations=args.limit_conversations,
        units=[u.strip() for u in args.units.split(",") if u.strip()],
        window_sizes=[int(s) for s in args.window_sizes.split(",") if s.strip()],
        continuity_artifact=args.continuity_artifact,
        device=args.device,
        batch_size=args.batch_size,
        min_cover_fraction=args.min_cover_fraction,
        speaker_prefix=not args.no_speaker_prefix,
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
    )
    print(format_table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
