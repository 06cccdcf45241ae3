"""The ``qumem`` strategy (QUMem §3.4): A1 information needs -> A2 retrieval plan -> retrieval
(never past the query's as_of) -> A3 user state Z_q (facts, preference trajectory, insights, each
citing memories) -> optional response Psi.

Each stage is one LLM batch over *all* queries of the run, so a server sees full batches. A1+A2
are ``planning.plan_retrieval`` (also run by the LoCoMo harness's ``qumem`` units); retrieval, A3 and Psi
are ``user_state.infer_from_plans``, shared with the ``topk`` baseline. Prompts: ``agents``.
"""

from datetime import datetime
from typing import Sequence

from qumem_pipeline.llm.base import LLMBackend
from qumem_pipeline.query.strategies.agents import QUERY_PROMPT_VERSION
from qumem_pipeline.query.strategies.base import Progress, Query, QueryStrategy, Retriever, StateOutput, TokenCounts
from qumem_pipeline.query.strategies.planning import (
    ANCHOR_DEPTH, anchored, plan_retrieval, validate_plan, with_query_anchor,
)
from qumem_pipeline.query.strategies.user_state import Plans, infer_from_plans

__all__ = ["ANCHOR_DEPTH", "QUERY_PROMPT_VERSION", "QumemStrategy", "anchored", "plan_retrieval", "validate_plan",
           "with_query_anchor"]


class QumemStrategy(QueryStrategy):
    """The paper's three agents: plans first, then retrieval and A3 on what the plans found."""

    name = "qumem"
    version = QUERY_PROMPT_VERSION

    def infer(self, queries: Sequence[Query], llm: LLMBackend, retriever: Retriever, *, k: int | None = None,
              respond: bool = False, created_at: datetime | None = None, progress: Progress | None = None) -> StateOutput:
        tokens = TokenCounts(len(queries))
        needs, plans, repaired, plan_tokens = plan_retrieval(queries, llm, progress=progress)
        for i, (p_tok, c_tok) in enumerate(plan_tokens):
            tokens.add(i, p_tok, c_tok)
        k = 5 if k is None else k
        plans, anchor_k = anchored(plans, queries, k)
        return infer_from_plans(self.name, queries, Plans(needs, plans, repaired), llm, retriever, tokens,
                                k=k, respond=respond, created_at=created_at, progress=progress,
                                anchor_k=anchor_k)
