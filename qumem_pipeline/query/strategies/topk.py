"""The ``topk`` strategy: the QUMem paper's "previous methods" baseline.

No planning: one similarity search with the raw query over every typed store (fact, preference,
insight), then A3 on what it returned (``user_state.infer_from_plans``, the same A3 and Psi as the
``qumem`` strategy, so the two differ only in planning).
"""

from datetime import datetime
from typing import Sequence

from qumem_pipeline.llm.base import LLMBackend
from qumem_pipeline.memories.decompose import MEMORY_TYPES
from qumem_pipeline.query.strategies.agents import QUERY_PROMPT_VERSION
from qumem_pipeline.query.strategies.base import Progress, Query, QueryStrategy, Retriever, StateOutput, TokenCounts
from qumem_pipeline.query.strategies.user_state import Plans, infer_from_plans


class TopKStrategy(QueryStrategy):
    name = "topk"
    version = QUERY_PROMPT_VERSION

    def infer(self, queries: Sequence[Query], llm: LLMBackend, retriever: Retriever, *, k: int | None = None,
              respond: bool = False, created_at: datetime | None = None, progress: Progress | None = None) -> StateOutput:
        n = len(queries)
        plans = Plans([[] for _ in range(n)], [[(q.query, list(MEMORY_TYPES))] for q in queries], [None] * n)
        return infer_from_plans(self.name, queries, plans, llm, retriever, TokenCounts(n),
                                k=5 if k is None else k, respond=respond, created_at=created_at, progress=progress)
