"""The retriever a query strategy answers from, built from the tables: the one place the query-states
asset and the personalization job (`query.personalize`) take it from.

`typed` strategies search the per-user, per-type FAISS indexes (`retrieval.TypedMemoryRetriever`);
`adamem` walks the user bundles (turns, memories with their embeddings, memory graph, persona profiles);
`hybrid` (`qumem_hybrid`) gets both.
"""

import polars as pl

from qumem_pipeline.index.vector_store import VectorStore
from qumem_pipeline.query.retrieval import TypedMemoryRetriever
from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever, UserBundle
from qumem_pipeline.query.strategies.base import QueryStrategy
from qumem_pipeline.query.strategies.hybrid import HybridRetriever
from qumem_pipeline.storage.layout import DataLayout

GRAPH_NODES, GRAPH_EDGES = "memory_graph_nodes", "memory_graph_edges"


class MissingUpstream(RuntimeError):
    """A table the strategy answers from has not been built for a user."""


def adamem_retriever(layout: DataLayout, users: list[str], turns_by_user: dict, mems: pl.DataFrame, embedder) -> AdaMemRetriever:
    """AdaMem bundles from the existing tables: turns, memories (+ their embeddings), graph, profiles."""
    emb = layout.read_table("memory_embeddings", users)
    if emb is not None and set(emb["embedding_model"].unique().to_list()) == {embedder.version}:
        vectors = dict(zip(emb["memory_id"].to_list(), emb["embedding"].to_numpy()))
    else:  # none yet, or from another model: embed the memories with the query embedder
        vectors = None
    bundles = {}
    # one read per table for all the users (a read per user lists the table's files each time)
    nodes_of, edges_of = layout.read_users(GRAPH_NODES, users), layout.read_users(GRAPH_EDGES, users)
    profiles_of = layout.read_users("persona_profiles", users)
    for u in users:
        nodes, edges = nodes_of.get(u), edges_of.get(u)
        if turns_by_user.get(u) is None or nodes is None or edges is None:
            raise MissingUpstream(f"user {u}: materialize `turns` and `memory_graph` first (strategies adamem, qumem_hybrid)")
        bundles[u] = UserBundle.build(u, turns_by_user[u], mems.filter(pl.col("user_id") == u), embedder,
                                      nodes=nodes, edges=edges, profiles=profiles_of.get(u),
                                      memory_vectors=vectors)
    return AdaMemRetriever(bundles, embedder)


def retriever_for(strategy: QueryStrategy, layout: DataLayout, users: list[str], turns_by_user: dict,
                  mems: pl.DataFrame, embedder):
    """The retriever `strategy.infer` expects (`strategy.retriever_kind`) over these users' tables."""
    if strategy.retriever_kind == "adamem":
        return adamem_retriever(layout, users, turns_by_user, mems, embedder)
    vectors = VectorStore(layout)
    vectors.preload(users)  # every user's indexes in two reads, not two per user
    typed = TypedMemoryRetriever(vectors, embedder, mems)
    if strategy.retriever_kind == "hybrid":
        return HybridRetriever(typed, adamem_retriever(layout, users, turns_by_user, mems, embedder))
    return typed
