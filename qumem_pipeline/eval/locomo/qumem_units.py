"""The ``qumem`` strategy of the LoCoMo harness: the product's planned retrieval over one conversation.

The conversation's memories (both speakers', re-indexed onto the primary user's turns) are embedded
and put in an in-memory per-type FAISS store exactly as the pipeline builds a user's indexes
(``embed_memories`` -> ``build_user_indexes`` -> ``VectorStore.in_memory``). A1/A2 run for ALL the
conversation's questions in one batch each (``plan_retrieval``), then ``TypedMemoryRetriever``
runs the strategy's own retrieval step (``user_state.retrieve_planned``: every plan, k per planned
sub-query and store, plus the query itself over every store ``ANCHOR_DEPTH`` times deeper) with
as_of = the end of the conversation; its merged, de-duplicated candidates (best score first) are
the strategy's ranking. A3 is not run: the harness measures retrieval only. What the plan's
rewrites alone found (no anchor) is kept too: ``qumem_hybrid`` adds it to AdaMem's hybrid top-k.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import polars as pl

from qumem_pipeline.index.embeddings import embed_memories
from qumem_pipeline.query.strategies.base import Query
from qumem_pipeline.query.strategies.planning import anchored, plan_retrieval
from qumem_pipeline.query.strategies.user_state import is_query_anchor, retrieve_planned
from qumem_pipeline.query.retrieval import DEFAULT_K, TypedMemoryRetriever
from qumem_pipeline.index.vector_store import VectorStore, build_user_indexes, normalize_type


@dataclass
class QumemPlanning:
    """Per-question planned retrieval and what planning cost."""

    memory_ids: list[list[str]]  # per question: retrieved memory ids, best first
    plans: list[list[tuple[str, list[str]]]]
    rewrite_ids: list[list[str]]  # per question: what the plan's rewrites alone found (qumem_hybrid), best first
    repaired: list[str | None]
    prompt_tokens: int = 0
    completion_tokens: int = 0


def qumem_planned_retrieval(conv_id: str, user_id: str, questions: Sequence[str], memories: pl.DataFrame,
                            embedder, llm, as_of: int, k: int = DEFAULT_K, *,
                            sources: Mapping[str, Sequence[str]] | None = None,
                            source_weight: float | None = None) -> QumemPlanning:
    """Plan (A1/A2, one batch each) and retrieve for every question of one conversation.

    ``sources`` (memory_id -> source turn texts): memories keyed as the product keys them."""
    mems = memories.unique("memory_id", keep="first", maintain_order=True)
    mems = mems.with_columns(pl.Series("type", [normalize_type(t) for t in mems["type"].to_list()], dtype=pl.String),
                             pl.lit(user_id).alias("user_id"))  # all re-indexed onto the primary user's turns
    store = VectorStore.in_memory([build_user_indexes(
        embed_memories(mems, embedder, sources=sources, source_weight=source_weight), user_id)])
    retriever = TypedMemoryRetriever(store, embedder, mems)
    queries = [Query(f"{conv_id}/q{i}", user_id, q, as_of) for i, q in enumerate(questions)]
    _, plans, repaired, tokens = plan_retrieval(queries, llm)
    rewrites = [[e for e in p if not is_query_anchor(e, q.query)] for p, q in zip(plans, queries)]
    plans, anchor_k = anchored(plans, queries, k)
    cands = retrieve_planned(queries, plans, retriever, k=k, anchor_k=anchor_k)
    return QumemPlanning(_best_first(cands), plans, _best_first(retrieve_planned(queries, rewrites, retriever, k=k)),
                         repaired, sum(t[0] for t in tokens), sum(t[1] for t in tokens))


def _best_first(candidates: list[list]) -> list[list[str]]:
    return [[c.memory_id for c in sorted(row, key=lambda c: (-c.score, c.memory_id))] for row in candidates]
