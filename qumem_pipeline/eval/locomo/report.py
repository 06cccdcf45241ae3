"""Step 4 of the LoCoMo harness, report: the recall tallies as one JSON-serialisable dict and a table.

Enters: a ``Tally`` (score step), the run's conversations, QA items, unit sources and options.
Leaves: the report (``build_report``; key for key what ``qumem eval locomo --json`` prints) and its
plain-text rendering (``format_table``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from qumem_pipeline.eval.locomo.rank import SCORINGS
from qumem_pipeline.eval.locomo.score import BUDGET_RULE, MIN_COVER_FRACTION, TOP_UNITS, QAItem, Scored, Tally
from qumem_pipeline.eval.locomo.units import UNIT_KINDS, Conversation

HEADLINE_CATEGORIES = (1, 2, 3, 4)
ALL_CATEGORIES = (1, 2, 3, 4, 5)


def _aggregate(values: Scored, cats: Iterable[int], budgets) -> dict | None:
    cats = set(cats)
    sel = [r for c, r in values if c in cats]
    if not sel:
        return None
    return {str(b): round(float(np.mean([r[b] for r in sel])), 4) for b in budgets}


@dataclass
class RunSettings:
    """The options a report states (besides the tallies)."""

    path: str
    budgets: tuple[int, ...]
    units: Sequence[str]
    window_sizes: Sequence[int]
    unit_scoring: str
    strategies: Sequence[str]
    min_cover_fraction: float = MIN_COVER_FRACTION
    speaker_prefix: bool = True


class Blocks:
    """Recall tables (one row per unit kind / strategy) over a set of categories and a scoring."""

    def __init__(self, tally: Tally, settings: RunSettings):
        self.tally, self.s = tally, settings
        self.window_keys = [f"window_{n}" for n in settings.window_sizes if (f"window_{n}", "text") in tally.per_kind]

    def summary(self, key: str, cats, scoring: str) -> dict | None:
        # single-piece rows (turns, memories, anything ranked another way) exist under "text" only
        per_kind = self.tally.per_kind
        sc = scoring if (key, scoring) in per_kind else "text"
        return _aggregate(per_kind[(key, sc)], cats, self.s.budgets) if (key, sc) in per_kind else None

    def best_window(self, scoring: str) -> str | None:
        """The window size with the best mean recall over the budgets (categories 1-4)."""
        def mean_recall(d: dict | None) -> float:
            return float(np.mean(list(d.values()))) if d else -1.0

        return max(self.window_keys, key=lambda k: mean_recall(self.summary(k, HEADLINE_CATEGORIES, scoring)),
                   default=None)

    def block(self, cats, scoring: str | None = None) -> dict:
        scoring = scoring or self.s.unit_scoring
        best = self.best_window(scoring)
        fixed = self.summary(best, cats, scoring) if best else None
        r = {
            "turns": self.summary("turns", cats, scoring),
            "fixed_chunks": ({**fixed, "window_turns": int(best.split("_")[1])} if fixed else None),
            "fixed_chunks_by_size": {k.split("_")[1]: self.summary(k, cats, scoring) for k in self.window_keys} or None,
            "sessions": self.summary("sessions", cats, scoring),
            "episodes": self.summary("episodes", cats, scoring),
            "episodes_matched_windows": self.summary("matched_windows", cats, scoring),
            "memories": self.summary("memories", cats, scoring),
        }
        if self.s.strategies:
            r["strategies"] = {n: self.summary(f"strategy_{n}", cats, scoring) for n in self.s.strategies}
        return r


def note_partial_rows(skipped: dict, tally: Tally, convs: list[Conversation], items_by_conv: dict[str, list[QAItem]],
                      settings: RunSettings, have_memories: bool, run_strategies: Sequence[str]) -> None:
    """Say in ``skipped`` which rows cover fewer conversations than the others, and why."""
    with_items = [c.sample_id for c in convs if items_by_conv[c.sample_id]]
    mem_convs = tally.mem_conversations
    if "memories" in settings.units and have_memories and not mem_convs:
        skipped["memories"] = "the memories table holds no memories of these conversations' users"
    elif mem_convs and len(mem_convs) < len(with_items):
        skipped["memories_partial"] = (
            f"memories only for conversations {mem_convs}; memories figures cover those conversations' "
            f"items only (see memories_subset_turns for single turns on the same items)"
        )
    if "qumem" in run_strategies:
        missing = [c for c in with_items if c not in tally.qumem_stats]
        if missing:
            skipped["strategy_qumem_partial"] = (f"no memories for conversations {missing}: qumem's figures cover "
                                                 f"the other conversations' items only")
    if "fixed_chunks" in settings.units and not Blocks(tally, settings).window_keys:
        skipped["fixed_chunks"] = "no window sizes given"


def per_category_blocks(blocks: Blocks, items_by_conv: dict[str, list[QAItem]], skipped: dict) -> dict:
    from qumem_pipeline.ingest.importers.locomo import CATEGORY_NAMES

    cat_counts: dict = defaultdict(int)
    for its in items_by_conv.values():
        for it in its:
            cat_counts[it.category] += 1
    out = {}
    for c in ALL_CATEGORIES:
        if cat_counts.get(c):
            out[str(c)] = {"name": CATEGORY_NAMES.get(c), "n": cat_counts[c], **blocks.block((c,))}
    if cat_counts.get(None):
        skipped["items_without_category"] = cat_counts[None]
    return out


def unit_summaries(unit_stats: dict[str, dict]) -> dict:
    def share(v, k):
        return v[k] / max(v["n_units"], 1)

    return {k: {"n_units": v["n_units"], "mean_words": round(share(v, "words"), 1),
                "mean_turns": round(share(v, "turns"), 2),
                "share_over_embedder_max_seq": round(share(v, "over_max_seq"), 3),
                "share_crossing_sessions": round(share(v, "cross_session"), 3),
                "seconds_embedding": round(v["seconds_embedding"], 1)} for k, v in unit_stats.items()}


def qumem_planning(qumem_stats: dict, strategy_llm) -> dict | None:
    from qumem_pipeline.query.retrieval import DEFAULT_K as QUMEM_K

    if not qumem_stats:
        return None
    return {"model": strategy_llm.model_name, "k_per_sub_query": QUMEM_K,
            "backfill": "remaining memories in topk (raw-question dense) order",
            "prompt_tokens": sum(v["a1_a2_prompt_tokens"] for v in qumem_stats.values()),
            "completion_tokens": sum(v["a1_a2_completion_tokens"] for v in qumem_stats.values()),
            "plans_repaired": sum(v["plans_repaired"] for v in qumem_stats.values()),
            "by_conversation": qumem_stats}


def memories_extras(tally: Tally, convs: list[Conversation], items_by_conv: dict[str, list[QAItem]],
                    mem_df: pl.DataFrame, budgets) -> dict:
    """Single turns scored on the memories row's items only, and what the memories row rests on."""
    memset = set(tally.mem_conversations)
    conv_of_item = [c.sample_id for c in convs for _ in items_by_conv[c.sample_id]]
    turns = tally.per_kind[("turns", "text")] if ("turns", "text") in tally.per_kind else None
    sub = [(cat, r) for (cat, r), conv_id in zip(turns, conv_of_item) if conv_id in memset] if turns else []
    out = {
        "memories_subset_turns": _aggregate(sub, HEADLINE_CATEGORIES, budgets) if sub else None,
        "memories_stats": tally.mem_stats,
        "memories_n_memories": int(mem_df.filter(pl.col("user_id").is_in(
            [u for c in convs if c.sample_id in memset for u in c.user_ids])).height),
    }
    if "model" in mem_df.columns:
        out["memories_model"] = sorted(str(m) for m in mem_df["model"].unique().to_list())
    return out


def build_report(tally: Tally, settings: RunSettings, convs: list[Conversation],
                 items_by_conv: dict[str, list[QAItem]], sources, skipped: dict, *, slice_info, load_info,
                 embedding_model: str, max_seq) -> dict:
    """The full report, minus ``wall_s`` (the caller's clock). ``sources`` is the run's ``UnitSources``."""
    budgets = settings.budgets
    note_partial_rows(skipped, tally, convs, items_by_conv, settings, sources.memories is not None,
                      sources.run_strategies)
    blocks = Blocks(tally, settings)
    per_category = per_category_blocks(blocks, items_by_conv, skipped)
    all_items = [it for c in convs for it in items_by_conv[c.sample_id]]
    mcf = settings.min_cover_fraction
    report = {
        "dataset": str(settings.path),
        "slice": slice_info,
        "n_conversations": len(convs),
        "n_questions": sum(1 for it in all_items if it.category in HEADLINE_CATEGORIES),
        "n_questions_with_adversarial": len(all_items),
        "budgets": list(budgets),
        "units_requested": [u for u in UNIT_KINDS if u in settings.units],
        "unit_scoring": settings.unit_scoring,
        "retrieval_scope": "categories 1-4 (adversarial excluded); retrieval_with_adversarial adds category 5",
        "retrieval": blocks.block(HEADLINE_CATEGORIES),
        "retrieval_with_adversarial": blocks.block(ALL_CATEGORIES),
        "retrieval_by_scoring": {sc: blocks.block(HEADLINE_CATEGORIES, sc) for sc in SCORINGS},
        "per_category": per_category,
        "recall_at_top_units": {f"{k}|{sc}": _aggregate(v, HEADLINE_CATEGORIES, TOP_UNITS)
                                for (k, sc), v in tally.per_rank.items()},
        "units": unit_summaries(tally.unit_stats),
        "budget_rule": BUDGET_RULE if mcf == MIN_COVER_FRACTION else f"{BUDGET_RULE} [min_cover_fraction={mcf}]",
        "speaker_prefix": settings.speaker_prefix,
        "embedding_model": embedding_model,
        "embedder_max_seq_length": max_seq,
        "continuity_classifier": sources.classifier_version,
        "decomposition": sources.decomposition,
        "qumem_planning": qumem_planning(tally.qumem_stats, sources.strategy_llm),
        "as_of": "end of conversation",
        "primary_user": {c.sample_id: c.user_id for c in convs},
        "load": load_info,
        "skipped": skipped,
    }
    if tally.mem_conversations:
        report.update(memories_extras(tally, convs, items_by_conv, sources.memories, budgets))
    return report


# ---------------------------------------------------------------------------------------- text


def _rows(block: dict) -> list[tuple[str, dict | None]]:
    out = [("turns", block["turns"])]
    for s, v in (block.get("fixed_chunks_by_size") or {}).items():
        out.append((f"window {s}", v))
    if block.get("fixed_chunks"):
        out.append((f"fixed (best={block['fixed_chunks']['window_turns']})", block["fixed_chunks"]))
    out += [("sessions", block["sessions"]), ("episodes", block["episodes"])]
    if "episodes_matched_windows" in block:
        out.append(("windows like eps", block["episodes_matched_windows"]))
    out.append(("memories", block["memories"]))
    out += [(f"strategy {s}", v) for s, v in (block.get("strategies") or {}).items()]
    return out


def _table(lines: list[str], title: str, block: dict, budgets: list[str]) -> None:
    lines.append("")
    lines.append(title)
    lines.append(f"  {'unit':<18}" + "".join(f"{b:>8}" for b in budgets))
    for name, vals in _rows(block):
        if vals is None:
            lines.append(f"  {name:<18}" + f"{'n/a':>8}" * len(budgets))
        else:
            lines.append(f"  {name:<18}" + "".join(f"{vals[b]:>8.3f}" for b in budgets))


def _notes(lines: list[str], report: dict) -> None:
    """Memories' and qumem planning's caveats, what was skipped, the rule, the wall time."""
    for conv_id, ms in (report.get("memories_stats") or {}).items():
        lines.append(f"memories {conv_id}: {json.dumps(ms)}")
        if ms["budgets_holding_every_memory"]:
            lines.append(f"  NOTE: every memory fits in {ms['budgets_holding_every_memory']} words: recall there is the "
                         f"union of cited turns, independent of ranking and of what the memories say")
    qp = report.get("qumem_planning")
    if qp:
        lines.append(f"qumem planning ({qp['model']}): A1+A2 prompt tokens {qp['prompt_tokens']}, completion tokens "
                     f"{qp['completion_tokens']}, plans repaired {qp['plans_repaired']}; backfill: {qp['backfill']}")
    mk = report.get("memory_keys")
    if mk:
        lines.append(f"memory keys: {mk['rule']} (w = {mk['source_weight']:g})")
    sk = {k: v for k, v in report["skipped"].items() if k != "qa_loader"}
    lines.append("")
    lines.append(f"skipped: {json.dumps(sk)}")
    lines.append(f"budget rule: {report['budget_rule']}")
    lines.append(f"wall time: {report['wall_s']}s")


def format_table(report: dict) -> str:
    budgets = [str(b) for b in report["budgets"]]
    lines = [f"LoCoMo retrieval: evidence recall at word budgets ({report['dataset']}, "
             f"{report['n_conversations']} conversations, {report['n_questions']} questions cat 1-4, "
             f"{report['n_questions_with_adversarial']} with cat 5; {report['embedding_model']})"]
    _table(lines, f"overall (categories 1-4) - multi-turn units scored by {report['unit_scoring']}",
           report["retrieval"], budgets)
    for sc, blk in (report.get("retrieval_by_scoring") or {}).items():
        if sc != report["unit_scoring"]:
            _table(lines, f"overall (categories 1-4), multi-turn units scored by {sc}", blk, budgets)
    if report.get("units"):
        lines.append("")
        lines.append("units: " + "; ".join(
            f"{k} n={v['n_units']} words={v['mean_words']} turns={v['mean_turns']} "
            f"over_max_seq={v['share_over_embedder_max_seq']}" for k, v in report["units"].items()))
    _table(lines, "overall with adversarial (categories 1-5)", report["retrieval_with_adversarial"], budgets)
    for c, blk in report["per_category"].items():
        _table(lines, f"category {c} ({blk['name']}, n={blk['n']})", blk, budgets)
    _notes(lines, report)
    return "\n".join(lines)
