"""Side-by-side retrieval strategies for the LoCoMo harness (``qumem eval locomo --strategies``).

Each strategy turns a question into a ranked list of evaluation units; the harness spends the same
word budgets on every list, so recall is compared at equal budget.

- ``topk``: the single top-k baseline - dense similarity of the raw question over the memories
  when a memories table is given, else over the turns;
- ``adamem``: the route-planned hybrid retrieval (participant resolution, profile/memory/turn/topic
  channels, score-drop reactivation, BM25 backoff, graph expansion, fusion) with top-k 10, then
  backfilled with the remaining turns by dense similarity so it spends the same budget as the
  others (its own top-10 rarely fills 1024 words); the route plan is the deterministic one (no LLM);
- ``qumem``: the product's planned retrieval (``qumem_pipeline.eval.locomo.qumem_units``): A1/A2 plans
  for all the conversation's questions in one LLM batch each, ``TypedMemoryRetriever`` with k = 5 per
  planned sub-query and store over an in-memory per-type FAISS store of the conversation's memories,
  merged and de-duplicated best score first; then backfilled with the remaining memories in the
  ``topk`` order (raw-question dense similarity) so it spends the same budget as the others (its own
  candidates rarely fill 1024 words). Needs an LLM and a memories table; reported as skipped without;
- ``qumem_hybrid``: the query's own ``adamem`` top-10 (AdaMem's hybrid retrieval, as the strategy
  runs it ``ANCHOR_DEPTH * k`` deep), then the memories ``qumem``'s plan rewrites found (k = 5 per
  sub-query and store, best score first) that are not placed yet, then the ``adamem`` turn backfill.
  Same planning calls as ``qumem`` (a record holding qumem's plans answers them); same needs.
"""

from collections.abc import Sequence

import numpy as np
import polars as pl

from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT, keys_for
from qumem_pipeline.query.strategies.adamem.retriever import DEFAULT_K, UserBundle
from qumem_pipeline.query.strategies.adamem.route import plan_route
from qumem_pipeline.query.strategies.registry import STRATEGY_NAMES as EVAL_STRATEGIES

NEEDS_LLM = {s: f"{s}'s A1/A2 planning needs an LLM; not run (retrieval-only evaluation: give --llm-kind "
                 "or --decompose to run it)" for s in ("qumem", "qumem_hybrid")}
NEEDS_MEMORIES = {s: f"{s} retrieves typed memories: give a memories table (--memories) or --decompose"
                  for s in ("qumem", "qumem_hybrid")}


def conversation_memories(conv, memories: pl.DataFrame | None) -> pl.DataFrame | None:
    """Both speakers' memories with evidence re-indexed onto the primary user's turn indices (via dia ids)."""
    if memories is None:
        return None
    to_primary = {d: t for t, d in conv.dia_by_user_turn[conv.user_id].items()}
    rows = []
    for r in memories.filter(pl.col("user_id").is_in(conv.user_ids)).iter_rows(named=True):
        dias = conv.dia_by_user_turn.get(r["user_id"], {})
        ev = sorted({to_primary[dias[t]] for t in (r["evidence_turn_ids"] or []) if t in dias and dias[t] in to_primary})
        if ev:
            rows.append({"memory_id": r["memory_id"], "user_id": conv.user_id, "type": r["type"], "content": r["content"],
                         "episode_id": None, "evidence_turn_ids": ev, "position": ev[-1], "valid_from": None})
    if not rows:
        return None
    return pl.DataFrame(rows, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64), "episode_id": pl.String,
                                                "valid_from": pl.Datetime("us", "UTC")})


def session_episodes(turns: pl.DataFrame) -> pl.DataFrame:
    """Sessions as episodes, for the graph when classifier episodes were not built."""
    g = turns.group_by("session_id", maintain_order=True).agg(pl.col("turn_index").alias("turn_ids"))
    return g.with_columns(pl.col("session_id").alias("episode_id"), pl.int_range(pl.len()).alias("episode_index"),
                          pl.col("turn_ids").list.last().alias("last_turn_index"))


def strategy_rankings(conv, questions: Sequence[str], qvecs: np.ndarray, strategies: Sequence[str], embedder,
                      memories: pl.DataFrame | None, episodes: pl.DataFrame | None, make_unit, *, llm=None,
                      qumem_stats: dict | None = None, source_weight: float = SOURCE_WEIGHT) -> dict[str, list[list]]:
    """strategy -> per question, ranked units (``make_unit(dia_ids, text)`` builds one).

    ``qumem`` and ``qumem_hybrid`` run only with an ``llm`` and memories for this conversation (else
    they are absent from the result); the planning's cost and repairs go to ``qumem_stats`` when given. Memories are keyed
    by their text and source turns (``index.memory_keys``, ``source_weight``) for ``topk`` and ``qumem``.
    """
    as_of = int(conv.turns["turn_index"].max())
    lines = conv.lines()
    dia_of = dict(zip(conv.turns["turn_index"].to_list(), conv.turns["source_ref"].to_list()))
    row_of = {t: i for i, t in enumerate(conv.turns["turn_index"].to_list())}
    dia = list(dia_of.values())
    turn_units = [make_unit([d], text) for d, (_, _, text) in zip(dia, lines)]
    tvecs = embedder.encode([l[2] for l in lines])
    dense_turns = np.argsort(-(qvecs @ tvecs.T), axis=1, kind="stable")
    mems = conversation_memories(conv, memories)
    out: dict[str, list[list]] = {}
    planned = [s for s in ("qumem", "qumem_hybrid") if s in strategies] if llm is not None and mems is not None else []
    if mems is not None and ("topk" in strategies or planned):
        sources = {m: [lines[row_of[t]][2] for t in ev if t in row_of]
                   for m, ev in zip(mems["memory_id"].to_list(), mems["evidence_turn_ids"].to_list())}
        mv = keys_for(mems, sources, embedder, source_weight)
        munits = [make_unit([dia_of[t] for t in ev], c) for c, ev in zip(mems["content"].to_list(), mems["evidence_turn_ids"].to_list())]
        order = np.argsort(-(qvecs @ mv.T), axis=1, kind="stable")
    if "topk" in strategies:
        if mems is not None:
            out["topk"] = [[munits[j] for j in row] for row in order]
        else:
            out["topk"] = [[turn_units[j] for j in row] for row in dense_turns]
    res = None
    if planned:
        res = _qumem_planning(conv, questions, mems, embedder, llm, as_of, qumem_stats, sources, source_weight)
    if "qumem" in planned:
        out["qumem"] = _qumem_ranked(res, mems, munits, order)
    if "adamem" in strategies or "qumem_hybrid" in planned:
        hits = _adamem_hits(conv, questions, qvecs, embedder, mems, episodes, as_of)

        def units_of(h):
            if h.unit.kind == "turn":
                return turn_units[row_of[h.unit.position]]
            return make_unit([dia_of[t] for t in h.unit.evidence], h.unit.content)

        def backfill(qi, hs):  # the remaining turns by dense similarity: every list spends the same budget
            seen = {row_of[h.unit.position] for h in hs if h.unit.kind == "turn"}
            return [turn_units[j] for j in dense_turns[qi] if j not in seen]

        if "adamem" in strategies:
            out["adamem"] = [[units_of(h) for h in hs] + backfill(qi, hs) for qi, hs in enumerate(hits)]
        if "qumem_hybrid" in planned:
            first_row = _first_rows(mems)
            ranked = []
            for qi, hs in enumerate(hits):
                placed = {h.unit.unit_id for h in hs}
                extra = [munits[first_row[m]] for m in dict.fromkeys(res.rewrite_ids[qi]) if m not in placed]
                ranked.append([units_of(h) for h in hs] + extra + backfill(qi, hs))
            out["qumem_hybrid"] = ranked
    return out


def _first_rows(mems: pl.DataFrame) -> dict[str, int]:
    first: dict[str, int] = {}
    for j, m in enumerate(mems["memory_id"].to_list()):
        first.setdefault(m, j)
    return first


def _adamem_hits(conv, questions, qvecs, embedder, mems, episodes, as_of) -> list[list]:
    """AdaMem's own top-k (DEFAULT_K) per question, from a bundle of the conversation's turns and memories."""
    empty = pl.DataFrame(schema={"memory_id": pl.String, "user_id": pl.String, "type": pl.String, "content": pl.String,
                                 "episode_id": pl.String, "evidence_turn_ids": pl.List(pl.Int64), "position": pl.Int64,
                                 "valid_from": pl.Datetime("us", "UTC")})
    turns = conv.turns
    eps = episodes if episodes is not None and episodes.height else session_episodes(turns)
    bundle = UserBundle.build(conv.user_id, turns, mems if mems is not None else empty, embedder, episodes=eps)
    return [bundle.retrieve(q, qvecs[qi], as_of, plan_route(q), DEFAULT_K) for qi, q in enumerate(questions)]


def _qumem_planning(conv, questions, mems, embedder, llm, as_of, qumem_stats, sources, source_weight):
    """qumem's planned retrieval for every question (A1/A2 one batch each); its cost to ``qumem_stats``."""
    from qumem_pipeline.eval.locomo.qumem_units import qumem_planned_retrieval

    res = qumem_planned_retrieval(conv.sample_id, conv.user_id, questions, mems, embedder, llm, as_of,
                                  sources=sources, source_weight=source_weight)
    if qumem_stats is not None:
        qumem_stats[conv.sample_id] = {
            "questions": len(questions), "a1_a2_prompt_tokens": res.prompt_tokens,
            "a1_a2_completion_tokens": res.completion_tokens,
            "plans_repaired": sum(1 for r in res.repaired if r),
            "repairs": sorted({r for r in res.repaired if r}),
            "mean_planned_sub_queries": round(sum(len(p) for p in res.plans) / max(len(res.plans), 1), 2),
            "mean_planned_memories": round(sum(len(m) for m in res.memory_ids) / max(len(res.memory_ids), 1), 2),
        }
    return res


def _qumem_ranked(res, mems, munits, topk_order) -> list[list]:
    """Planned retrieval first, then the other memories in topk order (the equal-budget backfill)."""
    mids = mems["memory_id"].to_list()
    first_row = _first_rows(mems)
    ranked = []
    for qi, planned in enumerate(res.memory_ids):
        placed = set(planned)
        units = [munits[first_row[m]] for m in planned]
        for j in topk_order[qi]:
            if mids[j] not in placed:
                placed.add(mids[j])
                units.append(munits[j])
        ranked.append(units)
    return ranked
