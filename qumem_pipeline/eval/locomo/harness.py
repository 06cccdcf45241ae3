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
- ``episodes``: the product's episodes (``build_episodes_for_users``: continuity classifier over
  the primary user's utterances, the other speaker's turns as context, default token budget);
  text and cost exactly like windows (speaker prefix included);
- ``episodes_matched_windows`` (with episodes): the control for episode boundaries - in every
  session as many contiguous equal-length windows as there are episodes there (same unit count and
  words, only the boundaries differ);
- ``memories``: typed memories from a memories Parquet table (``--memories``), or built here
  (``--decompose``: every speaker's episodes through the decomposition step with the configured
  LLM, written per user under ``--memories-out``); a memory costs the words of its content and
  covers its evidence turns. Both speakers' memories are pooled (a question may concern either).

Both users of a conversation hold the whole conversation (LoCoMo importer), so turn-based units are
built once from speaker_a's user history; the evidence is the same turns for both.

Budget rule: units are taken whole while they fit. The unit that crosses the budget is truncated to
the remaining words (rather than dropped, which would penalise large units twice, or counted whole,
which would overspend): its turns are taken in order while they fit, and the turn that crosses
counts as covered only when at least half of its words fit (``MIN_COVER_FRACTION``); a memory is one
piece, so a truncated memory counts only when at least half of its words fit. Then retrieval stops.

Scoring multi-turn units (windows, sessions, episodes; ``SCORINGS``): ``text`` embeds the unit's
text, which MiniLM truncates at 256 word pieces - a 20-turn episode is ranked by its first ~8
turns only; ``best_turn`` ranks a unit by its best-matching turn; ``mean_turn`` by the mean of its
turns' vectors. ``--unit-scoring`` picks the headline; ``retrieval_by_scoring`` has all three.
A unit always costs its whole text, whatever the scoring. ``recall_at_top_units`` (top 1/3/5
units taken whole, cost ignored) separates ranking quality from unit size; ``units`` gives each
kind's mean words, mean turns and the share of units longer than the embedder reads.

Episodes are the product's: the continuity classifier's boundaries, a new episode at every new
session, and the token budget's forced splits.

Slices (``--conversations``, ``--max-sessions N``) keep the QA items whose evidence lies in the
kept sessions, so every unit kind (memories included) is compared on the same data.

Headline figures (``retrieval``) are over categories 1-4; ``retrieval_with_adversarial`` adds
category 5 (adversarial). ``per_category`` has every category.

Strategies side by side (``--strategies qumem,adamem,topk``): each query strategy's ranked retrieval
under the same word budgets, one row per strategy in every table (see ``qumem_pipeline.eval.locomo.adamem_units``).
``qumem`` runs A1/A2 planning with the run's LLM backend (``--llm-kind``, or the one ``--decompose``
builds) over the memories (``--memories`` or ``--decompose``); without either it is skipped with the
reason. Its A1/A2 token totals and plan repairs are in ``qumem_planning``.

Code, one module per step (each testable alone): ``data`` (load conversations, QA items,
memories tables, slices), ``units`` (build units), ``sources`` (the product's episodes and
decomposed memories), ``rank`` (unit scores, strategy rankings), ``score`` (budgeted recall, the
``Tally``), ``report`` (the JSON report and its table), ``run`` (``run_eval``: the steps in order).
This module is the CLI and keeps the names other code imports from here.

CLI: ``python -m qumem_pipeline.eval.locomo.harness PATH [--json] [--memories PARQUET_DIR | --decompose]
[--conversations IDS] [--max-sessions N] [--limit-conversations N] [--unit-scoring text|best_turn|mean_turn]
[--strategies qumem,adamem,topk]``;
with ``--json`` the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from qumem_pipeline.eval.locomo.data import (  # noqa: F401  (re-exported: tests and the qa mode import these)
    LocomoData,
    _speaker_a_first,
    load_conversations,
    load_dataset,
    qa_items,
    read_memories,
    slice_locomo,
)
from qumem_pipeline.eval.locomo.rank import DEFAULT_SCORING, SCORINGS, rank_order, unit_scores  # noqa: F401
from qumem_pipeline.eval.locomo.report import (  # noqa: F401
    ALL_CATEGORIES,
    HEADLINE_CATEGORIES,
    _aggregate,
    build_report,
    format_table,
)
from qumem_pipeline.eval.locomo.run import evaluate_conversation, evaluate_strategies, run_eval  # noqa: F401
from qumem_pipeline.eval.locomo.score import (  # noqa: F401
    BUDGET_RULE,
    BUDGETS,
    MIN_COVER_FRACTION,
    TOP_UNITS,
    QAItem,
    Tally,
    budgeted_coverage,
    budgeted_recall,
    recall_at_units,
    recall_by_scores,
)
from qumem_pipeline.eval.locomo.sources import (  # noqa: F401
    build_episodes,
    decompose_conversation,
    decompose_memories,
    gather_sources,
    make_backend,
)
from qumem_pipeline.eval.locomo.units import (  # noqa: F401
    UNIT_KINDS,
    WINDOW_SIZES,
    Conversation,
    EvalUnit,
    episode_units,
    matched_window_units,
    memory_stats,
    memory_units,
    session_units,
    text_unit,
    turn_units,
    unit_builders,
    window_units,
    word_count,
)
from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT

_rank_and_score = recall_by_scores  # the old private name
_make_backend = make_backend


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m qumem_pipeline.eval.locomo.harness", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a LoCoMo-format JSON file")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--memories", help="memories Parquet table (file, table dir or data root)")
    ap.add_argument("--limit-conversations", type=int, default=None)
    ap.add_argument("--conversations", default=None, help="comma list of sample_ids to keep (e.g. conv-26)")
    ap.add_argument("--max-sessions", type=int, default=None,
                    help="keep each conversation's first N sessions and the QA items whose evidence lies in them")
    ap.add_argument("--decompose", action="store_true",
                    help="build the memories row here: the product's episodes of every speaker through the "
                         "decomposition step with the configured LLM (QUMEM_LLM_KIND, default the embedded local model)")
    ap.add_argument("--llm-kind", default=None, help="local | openai | vllm-managed (default: $QUMEM_LLM_KIND or local)")
    ap.add_argument("--llm-max-tokens", type=int, default=384, help="max completion tokens per decomposition call")
    ap.add_argument("--memories-out", default=None, help="with --decompose: data root to write memories (per user, as done)")
    ap.add_argument("--unit-scoring", default=DEFAULT_SCORING, choices=SCORINGS,
                    help="how multi-turn units are scored for the headline table (all are in retrieval_by_scoring)")
    ap.add_argument("--units", default=",".join(UNIT_KINDS), help=f"comma list of {UNIT_KINDS}")
    ap.add_argument("--window-sizes", default=",".join(map(str, WINDOW_SIZES)))
    ap.add_argument("--continuity-artifact", default=None, help="continuity classifier artifact dir")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: CUDA when available)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--min-cover-fraction", type=float, default=MIN_COVER_FRACTION,
                    help="share of a budget-crossing turn/memory that must fit for it to count (>1: never)")
    ap.add_argument("--no-speaker-prefix", action="store_true", help="embed/count turns without '<speaker>: '")
    ap.add_argument("--memory-source-weight", type=float, default=SOURCE_WEIGHT,
                    help="key memories by their text plus W x their source turns' mean vector, as the product's "
                         f"index does (default {SOURCE_WEIGHT:g}; 0: by their text alone)")
    ap.add_argument("--ledger", default=None, help="JSONL ledger of every LLM call (decomposition, A1/A2); a rerun "
                    "replays finished calls instead of paying twice (default <out>.ledger.jsonl with --out)")
    ap.add_argument("--record", default=None, help="the evaluation record (default eval_record/ or $QUMEM_EVAL_RECORD; "
                    "'off': none): calls it holds are replayed, the others sent and added to it")
    ap.add_argument("--replay-only", action="store_true", help="no model: every LLM call from the record; fails "
                    "listing the calls it lacks")
    ap.add_argument("--replay-model", default=None, help="with --replay-only: the recorded model (name@dtype)")
    ap.add_argument("--strategies", default="", help="comma list of query strategies to compare side by side "
                    "(qumem,adamem,topk); qumem needs an LLM (--llm-kind or --decompose) and memories "
                    "(--memories or --decompose), else it is skipped with the reason")
    return ap


def _csv(value: str | None) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()] if value else []


def run_options(args: argparse.Namespace) -> dict:
    """``run_eval``'s keyword arguments from the parsed command line."""
    return dict(
        memories=args.memories,
        limit_conversations=args.limit_conversations,
        conversations=_csv(args.conversations) or None,
        max_sessions=args.max_sessions,
        decompose=args.decompose,
        llm_kind=args.llm_kind,
        llm_max_tokens=args.llm_max_tokens,
        memories_out=args.memories_out,
        unit_scoring=args.unit_scoring,
        units=_csv(args.units),
        window_sizes=[int(s) for s in _csv(args.window_sizes)],
        continuity_artifact=args.continuity_artifact,
        device=args.device,
        batch_size=args.batch_size,
        min_cover_fraction=args.min_cover_fraction,
        speaker_prefix=not args.no_speaker_prefix,
        memory_source_weight=args.memory_source_weight,
        strategies=_csv(args.strategies),
        ledger=args.ledger or (args.out + ".ledger.jsonl" if args.out else None),
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--qa" in argv:  # answer quality (F1 / BLEU-1) instead of evidence recall
        from qumem_pipeline.eval.locomo.qa import main as qa_main

        return qa_main([a for a in argv if a != "--qa"])
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from qumem_pipeline.eval.record import EvalRecord, default_root, format_missing

    root = default_root() if args.record is None else (None if args.record.lower() == "off" else Path(args.record))
    record = EvalRecord(root) if root is not None else None
    kept = [a for i, a in enumerate(argv) if a not in ("--json", "--replay-only") and not a.startswith(
        ("--record", "--out", "--ledger")) and not (i and argv[i - 1] in ("--record", "--out", "--ledger"))]
    report = run_eval(args.path, **run_options(args), record=record, replay_only=args.replay_only,
                      replay_model=args.replay_model, argv=kept)
    print(format_table(report))
    rc = 0
    if report.get("replay", {}).get("missing", {}).get("calls"):
        from qumem_pipeline.eval.locomo.qa import _MissingView

        print(format_missing(_MissingView(report["replay"], record)), file=sys.stderr)
        rc = 1
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
