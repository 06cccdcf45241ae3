import time
from datetime import datetime, timezone

import dagster as dg
import polars as pl

from assets.ingest import turns
from assets.check_results import gate
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from assets.adamem import GRAPH_EDGES, GRAPH_NODES, memory_graph
from assets.retrieval import memory_indexes
from qumem_pipeline.contracts import checks
from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever, UserBundle
from qumem_pipeline.query.queries import read_queries, to_queries
from qumem_pipeline.query.strategies.registry import get_strategy
from qumem_pipeline.query.retrieval import TypedMemoryRetriever
from assets.versions import code_version, version_metadata
from qumem_pipeline.index.vector_store import VectorStore
from resources import PipelineConfig
from resources.models import EmbedderResource, LLMResource


def adamem_retriever(layout, users, turns_by_user, mems, embedder):
    """AdaMem bundles from the existing tables: turns, memories (+ their embeddings), graph, profiles."""
    emb = layout.read_table("memory_embeddings", users)
    if emb is not None and set(emb["embedding_model"].unique().to_list()) == {embedder.version}:
        vectors = dict(zip(emb["memory_id"].to_list(), emb["embedding"].to_numpy()))
    else:  # none yet, or from another model: embed the memories with the query embedder
        vectors = None
    bundles = {}
    for u in users:
        nodes, edges = layout.read_user_table(GRAPH_NODES, u), layout.read_user_table(GRAPH_EDGES, u)
        if turns_by_user.get(u) is None or nodes is None or edges is None:
            raise dg.Failure(f"user {u}: materialize `turns` and `memory_graph` first (strategy adamem)")
        bundles[u] = UserBundle.build(u, turns_by_user[u], mems.filter(pl.col("user_id") == u), embedder,
                                      nodes=nodes, edges=edges, profiles=layout.read_user_table("persona_profiles", u),
                                      memory_vectors=vectors)
    return AdaMemRetriever(bundles, embedder)


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[memory_indexes, turns, memory_graph],
    pool="gpu",
    code_version=code_version("query_states"),  # source + prompts + LLM + embedder + upstream
    group_name="personalization",
    kinds={"parquet"},
    description="Query-conditioned user states Z_q for the run's personalization queries "
    "(A1 needs -> A2 plan -> retrieval <= as_of -> A3 state), each stage batched over all queries.",
    check_specs=[dg.AssetCheckSpec("no_citation_after_as_of", asset="query_states", blocking=True)],
)
def query_states(
    context: dg.AssetExecutionContext, pipeline: PipelineConfig, llm: LLMResource, embedder: EmbedderResource
) -> dg.MaterializeResult:
    users = run_user_ids(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    if not pipeline.queries_path:
        layout.replace_or_remove_users("query_states", users, pl.DataFrame(schema={"user_id": pl.String}))
        return dg.MaterializeResult(
            metadata={"queries": 0, "note": "no queries_path configured"},
            check_results=[dg.AssetCheckResult(check_name="no_citation_after_as_of", passed=True, description="no queries")],
        )
    valid, bad = read_queries(pipeline.queries_path)
    valid = valid.filter(pl.col("user_id").is_in(users))
    turns_by_user = {u: layout.read_user_table("turns", u) for u in users}
    queries = to_queries(valid, {u: t for u, t in turns_by_user.items() if t is not None})
    mems = layout.read_table("memories", users)
    if mems is None:
        raise dg.Failure("materialize `memories` first")
    strategy = get_strategy(pipeline.query_strategy)
    if strategy.retriever_kind == "adamem":
        retriever = adamem_retriever(layout, users, turns_by_user, mems, embedder.model)
    else:
        retriever = TypedMemoryRetriever(VectorStore(layout), embedder.model, mems)
    k = strategy.default_k if strategy.default_k is not None else pipeline.retrieval_k
    progress = ProgressLogger(context.log, "query-state stages")
    out = strategy.infer(
        queries, llm.backend, retriever, k=k,
        respond=pipeline.respond, created_at=datetime.now(timezone.utc),
        progress=lambda stage, done, total: progress(done, total) or context.log.info(f"stage done: {stage}"),
    )
    future = checks.no_future_citations(out.states, mems)

    def publish():
        layout.replace_or_remove_users("query_states", users, out.states)
        layout.replace_or_remove_users("query_quarantine", users, out.quarantine)

    check_results, _ = gate(context, {"no_citation_after_as_of": future}, publish)
    return dg.MaterializeResult(
        check_results=check_results,
        metadata={
            "queries": len(queries), "dagster/row_count": out.states.height, "strategy": pipeline.query_strategy,
            "input_rows_quarantined": bad.height, **{k: v for k, v in out.stats.items() if isinstance(v, (int, float))},
            "model": llm.backend.model_name, "prompt_version": strategy.version,
            "seconds": round(time.perf_counter() - t0, 3), **version_metadata("query_states"),
        },
    )
