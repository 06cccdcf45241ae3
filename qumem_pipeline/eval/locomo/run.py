"""The LoCoMo harness's run: load -> build units -> rank -> score -> report, one named step each.

``run_eval`` strings the steps together; ``evaluate_conversation`` does build units, rank and score
for one conversation's unit kinds, ``evaluate_strategies`` the same for the query strategies.
See ``qumem_pipeline.eval.locomo.harness`` for what the figures mean.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

import numpy as np
import polars as pl

from qumem_pipeline.eval.locomo.data import load_dataset, qa_items
from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend
from qumem_pipeline.eval.locomo.rank import DEFAULT_SCORING, SCORINGS, embed_units, scorings_for, \
    strategy_ranked_units, unit_scores
from qumem_pipeline.eval.locomo.report import RunSettings, build_report
from qumem_pipeline.eval.locomo.score import BUDGETS, MIN_COVER_FRACTION, QAItem, Tally
from qumem_pipeline.eval.locomo.sources import UnitSources, gather_sources
from qumem_pipeline.eval.locomo.units import UNIT_KINDS, WINDOW_SIZES, Conversation, EvalUnit, UnitBuilder, \
    memory_stats, unit_builders
from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT


def check_options(units: Sequence[str], strategies: Sequence[str], unit_scoring: str, decompose: bool,
                  memories) -> None:
    """Refuse unknown unit kinds, strategies and scorings, and a memories table given with --decompose."""
    from qumem_pipeline.eval.locomo.adamem_units import EVAL_STRATEGIES

    unknown = set(units) - set(UNIT_KINDS)
    if unknown:
        raise ValueError(f"unknown unit kinds {sorted(unknown)}; expected {UNIT_KINDS}")
    if set(strategies) - set(EVAL_STRATEGIES):
        raise ValueError(f"unknown strategies {sorted(set(strategies) - set(EVAL_STRATEGIES))}; expected {EVAL_STRATEGIES}")
    if unit_scoring not in SCORINGS:
        raise ValueError(f"unknown unit scoring {unit_scoring!r}; expected one of {SCORINGS}")
    if decompose and memories is not None:
        raise ValueError("give either a memories table or --decompose, not both")


def count_units(stats: dict, units: list[EvalUnit], conv: Conversation, embedder) -> None:
    """Add one conversation's units to a unit kind's size figures (``report['units']``)."""
    stats["n_units"] += len(units)
    stats["words"] += sum(u.words for u in units)
    stats["turns"] += sum(len(u.turn_rows) for u in units)
    sess = [l[1] for l in conv.lines()]
    stats["cross_session"] += sum(1 for u in units if len({sess[r] for r in u.turn_rows}) > 1)
    max_seq = getattr(embedder, "max_seq_length", None)
    if max_seq and hasattr(embedder, "tokenizer") and units:
        lens = [len(x) for x in embedder.tokenizer([u.text for u in units], truncation=False)["input_ids"]]
        stats["over_max_seq"] += sum(1 for n in lens if n > max_seq)


def evaluate_conversation(conv: Conversation, items: list[QAItem], q_vecs: np.ndarray,
                          kinds: list[tuple[str, UnitBuilder]], embedder, tally: Tally, *,
                          budgets: Sequence[int] = BUDGETS, min_cover_fraction: float = MIN_COVER_FRACTION,
                          batch_size: int = 64, memory_source_weight: float = SOURCE_WEIGHT) -> None:
    """Build every unit kind of one conversation, rank it for each question under each scoring, score it."""
    need_turn_vecs = any(k != "turns" and (k != "memories" or memory_source_weight) for k, _ in kinds)
    turn_vecs = embedder.encode([l[2] for l in conv.lines()], batch_size=batch_size) if need_turn_vecs else None
    for key, build in kinds:
        us = build(conv)
        if key == "memories":
            if not us:
                continue  # no memories for this conversation's users: excluded, reported as partial
            tally.mem_conversations.append(conv.sample_id)
            tally.mem_stats[conv.sample_id] = memory_stats(us, conv.lines(), budgets)
        st = tally.unit_stats[key]
        te = time.perf_counter()
        uv = embed_units(us, embedder, batch_size, turn_vecs, single_turns=key == "turns",
                         source_weight=memory_source_weight if key == "memories" else 0.0)
        st["seconds_embedding"] += time.perf_counter() - te
        count_units(st, us, conv, embedder)
        for sc in scorings_for(key):
            scores = unit_scores(us, q_vecs, sc, unit_vecs=uv, turn_vecs=turn_vecs)
            tally.add_scored(key, sc, us, scores, items, budgets, min_cover_fraction)


def evaluate_strategies(conv: Conversation, items: list[QAItem], q_vecs: np.ndarray, sources: UnitSources,
                        embedder, tally: Tally, *, budgets: Sequence[int] = BUDGETS,
                        min_cover_fraction: float = MIN_COVER_FRACTION,
                        memory_source_weight: float = SOURCE_WEIGHT) -> None:
    """Each runnable query strategy's ranking of one conversation for its questions, scored at the budgets."""
    te = time.perf_counter()
    eps = sources.episodes_by_user.get(conv.user_id) if sources.episodes_by_user else None
    ranked = strategy_ranked_units(conv, [it.question for it in items], q_vecs, sources.run_strategies, embedder,
                                   sources.memories, eps, llm=sources.strategy_llm, qumem_stats=tally.qumem_stats,
                                   source_weight=memory_source_weight)
    for name, lists in ranked.items():
        tally.add_ranked(f"strategy_{name}", lists, items, budgets, min_cover_fraction)
    tally.unit_stats["strategies"]["seconds_embedding"] += time.perf_counter() - te


def _evaluate_one(conv, items, qv, kinds, sources: UnitSources, emb, tally: Tally, budgets, min_cover_fraction,
                  batch_size, memory_source_weight: float = SOURCE_WEIGHT) -> None:
    """Units, then strategies, of one conversation with QA items."""
    evaluate_conversation(conv, items, qv, kinds, emb, tally, budgets=budgets,
                          min_cover_fraction=min_cover_fraction, batch_size=batch_size,
                          memory_source_weight=memory_source_weight)
    if sources.run_strategies:
        evaluate_strategies(conv, items, qv, sources, emb, tally, budgets=budgets, min_cover_fraction=min_cover_fraction,
                            memory_source_weight=memory_source_weight)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _evaluate_all(convs, items_by_conv, kinds, sources, emb, budgets, min_cover_fraction, batch_size,
                  memory_source_weight, log, t0: float) -> Tally:
    """Every conversation's units and strategies scored; all questions embedded in one call first."""
    questions = [it.question for c in convs for it in items_by_conv[c.sample_id]]
    te = time.perf_counter()
    q_all = emb.encode(questions, batch_size=batch_size)
    log(f"[locomo] {len(questions)} questions embedded in {time.perf_counter() - te:.1f}s")
    tally = Tally()
    offset = 0
    for conv in convs:
        items = items_by_conv[conv.sample_id]
        qv, offset = q_all[offset : offset + len(items)], offset + len(items)
        if items:
            _evaluate_one(conv, items, qv, kinds, sources, emb, tally, budgets, min_cover_fraction, batch_size,
                          memory_source_weight)
            log(f"[locomo] {conv.sample_id}: {len(items)} items, {len(kinds)} unit kinds ({time.perf_counter() - t0:.0f}s)")
    return tally


_KEY_RULE = "memories ranked by normalize(text + w * normalize(mean of source turns))"


def _replay_workspace(record, path: str, replay_model: str | None):
    """A replay's model identity (from the record's runs) and a scratch folder for what the run writes."""
    import tempfile

    from qumem_pipeline.eval.record import identity_from_runs

    if record is None:
        raise ValueError("--replay-only needs a record")
    return identity_from_runs(record, path, replay_model), tempfile.TemporaryDirectory(prefix="qumem-replay-")


def _report_calls(report: dict, sources, record, replay_only: bool, path: str, argv, log) -> None:
    """Where the run's model calls came from: the record (replayed, missing, or appended with the run's
    manifest) and the ledger (sent, replayed)."""
    from qumem_pipeline.eval.record import RecordBackend

    used = sources.backend.built() if sources.backend else None
    if isinstance(used, RecordBackend):
        if replay_only:
            report["replay"] = {"record": str(record.root), "calls_replayed": used.hits,
                                "missing": used.missing_summary(),
                                "missing_calls": [{"key": k, **m} for k, m in sorted(used.missing.items())]}
        else:
            from qumem_pipeline.eval.record import file_sha256

            ident = used.identity
            manifest = record.add_run({"kind": "locomo_recall", "dataset": os.path.basename(str(path)),
                                       "dataset_sha256": file_sha256(path), "model_name": ident["model_name"],
                                       "model": ident["model"], "decoding": ident["decoding"],
                                       "argv": list(argv or [])})
            report["record"] = {"root": str(record.root), "hits": used.hits, "appended": used.appended,
                                "manifest": manifest.name}
        used = used.inner
    if isinstance(used, LedgerBackend):
        report["llm_ledger"] = {"path": str(used.log.path), "sent": used.sent, "replayed": used.replayed}
        log(f"[locomo] LLM calls: {used.sent} sent, {used.replayed} replayed from {used.log.path}")


def run_eval(
    path: str,
    *,
    memories: str | os.PathLike | pl.DataFrame | None = None,
    limit_conversations: int | None = None,
    conversations: Sequence[str] | None = None,
    max_sessions: int | None = None,
    units: Sequence[str] = UNIT_KINDS,
    window_sizes: Sequence[int] = WINDOW_SIZES,
    budgets: Sequence[int] = BUDGETS,
    unit_scoring: str = DEFAULT_SCORING,
    continuity_artifact: str | None = None,
    device=None,
    embedder=None,
    decompose: bool = False,
    llm_backend=None,
    llm_kind: str | None = None,
    memories_out: str | os.PathLike | None = None,
    llm_max_tokens: int = 384,
    batch_size: int = 64,
    min_cover_fraction: float = MIN_COVER_FRACTION,
    speaker_prefix: bool = True,
    strategies: Sequence[str] = (),
    memory_source_weight: float = SOURCE_WEIGHT,
    ledger: str | os.PathLike | None = None,
    log=None,
    record=None,
    replay_only: bool = False,
    replay_model: str | None = None,
    argv: Sequence[str] | None = None,
) -> dict:
    """The full report (a JSON-serialisable dict). See ``qumem_pipeline.eval.locomo.harness``.

    ``record`` (``eval.record.EvalRecord``): model calls are answered from it first, the others sent and
    added, and the run's ``argv`` is kept as a manifest; ``replay_only``: no model, no ledger, no
    checkpoint of an earlier run - the calls the record lacks are in ``report['replay']['missing']``."""
    from qumem_pipeline.embedding.minilm import Embedder

    replay_identity, work = _replay_workspace(record, path, replay_model) if replay_only else (None, None)
    if work is not None:
        memories_out, ledger = work.name, None  # the decomposition's checkpoints too: nothing earlier is read
    log = log or _stderr
    t0 = time.perf_counter()
    budgets = tuple(sorted(budgets))
    strategies = list(dict.fromkeys(strategies))
    check_options(units, strategies, unit_scoring, decompose, memories)
    data = load_dataset(path, conversations=conversations, max_sessions=max_sessions,
                        limit_conversations=limit_conversations, speaker_prefix=speaker_prefix)
    convs = data.conversations
    items_by_conv, skipped = qa_items(convs, data.qa, data.qa_stats)
    log(f"[locomo] {len(convs)} conversations, {sum(len(v) for v in items_by_conv.values())} QA items with evidence")
    sources = gather_sources(convs, units, strategies, skipped, memories=memories, decompose=decompose,
                             llm_backend=llm_backend, llm_kind=llm_kind, continuity_artifact=continuity_artifact,
                             device=device, memories_out=memories_out, llm_max_tokens=llm_max_tokens, ledger=ledger,
                             log=log, record=record, replay_identity=replay_identity)
    emb = embedder or Embedder.load(device=device)
    kinds = unit_builders(units, window_sizes, sources.episodes_by_user, sources.memories)
    tally = _evaluate_all(convs, items_by_conv, kinds, sources, emb, budgets, min_cover_fraction, batch_size,
                          memory_source_weight, log, t0)
    settings = RunSettings(str(path), budgets, units, window_sizes, unit_scoring, strategies,
                           min_cover_fraction, speaker_prefix)
    report = build_report(tally, settings, convs, items_by_conv, sources, skipped, slice_info=data.slice_info,
                          load_info=data.load_info, embedding_model=emb.version,
                          max_seq=getattr(emb, "max_seq_length", None))
    report["memory_keys"] = {"source_weight": memory_source_weight, "rule": _KEY_RULE if memory_source_weight
                             else "memories ranked by their text alone"}
    _report_calls(report, sources, record, replay_only, path, argv, log)
    if work is not None:
        work.cleanup()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report
