"""The ``qumem_hybrid`` strategy: QUMem's typed planning with AdaMem's hybrid retrieval for the query
itself, then QUMem's A3 on everything both found (issue 29, item 4).

Why: ``qumem`` searches only the typed memory stores, its plans' rewrites ``k`` deep each and the
query itself ``ANCHOR_DEPTH`` times deeper, by dense similarity. On LoCoMo conv-30 it is not ahead
of a plain top-k over raw turns (docs/evaluation.md), and AdaMem's retrieval reaches what memories
alone miss: raw turns, persona profile entries, BM25 on the question's rare words, the memory graph.
Here the plans *add* to the query's own hybrid top-k instead of standing in for it:

1. A1 information needs -> A2 plan (``planning.plan_retrieval``: qumem's prompts, so a record or
   ledger holding qumem's plans answers these calls);
2. the plan's rewrites over the typed stores, ``k`` deep each (``TypedMemoryRetriever``);
3. the query itself through AdaMem's route-planned hybrid retrieval, ``ANCHOR_DEPTH * k`` deep;
4. both merged by unit id, then A3 and the optional response as in ``qumem``
   (``user_state.infer_from_plans``).

The two retrievals score on different scales (cosine; AdaMem's fused rank score); A3 sees the
candidates in conversation order, so only the order of a renderer's leftovers depends on it.
Nothing past the query's as_of enters by either route. The plan column records the query's own
search as ``{"query": ..., "stores": ["hybrid"]}``.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from qumem_pipeline.llm.base import LLMBackend
from qumem_pipeline.query.strategies.adamem.participants import resolve
from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever
from qumem_pipeline.query.strategies.adamem.route import plan_route
from qumem_pipeline.query.strategies.agents import QUERY_PROMPT_VERSION
from qumem_pipeline.query.strategies.base import Progress, Query, QueryStrategy, Retriever, StateOutput, TokenCounts
from qumem_pipeline.query.strategies.planning import ANCHOR_DEPTH, plan_retrieval
from qumem_pipeline.query.strategies.user_state import (
    Plans, infer_from_plans, is_query_anchor, merge_candidates, retrieve_planned,
)

__all__ = ["HYBRID_STORE", "HybridRetriever", "QumemHybridStrategy", "hybrid_candidates"]

HYBRID_STORE = "hybrid"


@dataclass
class HybridRetriever:
    """Both retrievers over the same users: typed memory stores, and AdaMem's user bundles."""

    typed: Retriever
    adamem: AdaMemRetriever


def hybrid_candidates(queries: Sequence[Query], plans: Sequence[Sequence[tuple[str, list[str]]]],
                      retriever: HybridRetriever, *, k: int, anchor_k: int) -> list[list]:
    """Per query: its plan's rewrites over the typed stores (k each; an entry that is the query itself
    is left to the hybrid search) merged with the query's own hybrid top-``anchor_k``."""
    rewrites = [[e for e in p if not is_query_anchor(e, q.query)] for p, q in zip(plans, queries)]
    typed = retrieve_planned(queries, rewrites, retriever.typed, k=k)
    bundles = retriever.adamem.bundles
    hits = retriever.adamem.retrieve_routed(
        [(q.user_id, q.query, q.as_of_position, plan_route(q.query),
          resolve(q.query, bundles[q.user_id].participants) if q.user_id in bundles else None) for q in queries],
        anchor_k)
    return [merge_candidates(t, [h.as_retrieved() for h in hs]) for t, hs in zip(typed, hits)]


class QumemHybridStrategy(QueryStrategy):
    """QUMem's plans added to AdaMem's hybrid retrieval of the query; QUMem's A3 on the union."""

    name = "qumem_hybrid"
    version = QUERY_PROMPT_VERSION
    retriever_kind = "hybrid"

    def infer(self, queries: Sequence[Query], llm: LLMBackend, retriever: HybridRetriever, *, k: int | None = None,
              respond: bool = False, created_at: datetime | None = None, progress: Progress | None = None) -> StateOutput:
        if not isinstance(retriever, HybridRetriever):
            raise TypeError(f"strategy 'qumem_hybrid' needs a HybridRetriever, got {type(retriever).__name__}")
        tokens = TokenCounts(len(queries))
        needs, plans, repaired, plan_tokens = plan_retrieval(queries, llm, progress=progress)
        for i, (p_tok, c_tok) in enumerate(plan_tokens):
            tokens.add(i, p_tok, c_tok)
        k = 5 if k is None else k
        candidates = hybrid_candidates(queries, plans, retriever, k=k, anchor_k=ANCHOR_DEPTH * k)
        shown = [[*(e for e in p if not is_query_anchor(e, q.query)), (q.query.strip(), [HYBRID_STORE])]
                 for p, q in zip(plans, queries)]
        return infer_from_plans(self.name, queries, Plans(needs, shown, repaired), llm, retriever.typed, tokens,
                                k=k, respond=respond, created_at=created_at, progress=progress, candidates=candidates)
