"""AdaMem assets on the existing tables: persona profiles, then the per-user memory graph that links them."""

import time
from datetime import datetime, timezone

import dagster as dg
import polars as pl

from assets.check_results import gate, no_users_result
from assets.episodes import episodes
from assets.ingest import turns
from assets.llm_calls import checkpointed_llm, ledger_metadata, llm_failure
from assets.memories import memories
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger, llm_call_progress
from assets.retrieval import memory_embeddings
from qumem_pipeline.query.strategies.adamem.graph import EDGE_TYPES, build_memory_graph, dangling_edges
from qumem_pipeline.contracts.checks import CheckOutcome
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.memories.call_ledger import PERSONA_TABLES
from qumem_pipeline.query.strategies.adamem.profiles import PROFILE_PROMPT_VERSION, build_profiles, uncited_profiles, vectors_for
from assets.versions import code_version, version_metadata
from resources import PipelineConfig
from resources.models import EmbedderResource, LLMResource

GRAPH_NODES, GRAPH_EDGES = "memory_graph_nodes", "memory_graph_edges"


def graph_endpoints_exist(nodes: pl.DataFrame, edges: pl.DataFrame) -> CheckOutcome:
    bad = dangling_edges(nodes, edges)
    return CheckOutcome(bad.height == 0, f"{bad.height} edges with a missing endpoint",
                        {"dangling_edges": bad.height, "edges": edges.height})


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[memories, memory_embeddings],
    pool="gpu",
    code_version=code_version("persona_profiles"),  # source + prompt + LLM + embedder + upstream
    group_name="adamem",
    kinds={"parquet"},
    description="Persona profiles: topic/aspect summaries of each user's preference and insight memories "
    "(near-duplicates grouped by embedding neighbourhood, one LLM merge per group), each citing its memories.",
    check_specs=[dg.AssetCheckSpec("profiles_cite_existing_memories", asset="persona_profiles", blocking=True)],
)
def persona_profiles(context: dg.AssetExecutionContext, pipeline: PipelineConfig, llm: LLMResource,
                     embedder: EmbedderResource) -> dg.MaterializeResult:
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    mems = layout.read_table("memories", users)
    if mems is None or len(layout.users_present("memories", users)) != len(users):
        raise dg.Failure("materialize `memories` for every user of the run first")
    vectors = vectors_for(mems, layout.read_table("memory_embeddings", users), embedder.model)
    created_at = datetime.now(timezone.utc)
    calls = checkpointed_llm(layout, PERSONA_TABLES, llm.backend, "persona_profiles", PROFILE_PROMPT_VERSION, created_at)
    progress = ProgressLogger(context.log, f"persona profiles of {len(users)} users")
    calls.progress = llm_call_progress(progress)
    try:
        with progress:
            profiles = build_profiles(mems, vectors, calls, created_at=created_at,
                                      previous=layout.read_table("persona_profiles", users))
    except LLMError as exc:
        raise llm_failure(exc, calls) from exc
    bad = uncited_profiles(profiles, mems)
    outcome = CheckOutcome(not bad, f"{len(bad)} profile entries cite no or unknown memories", {"violations": len(bad)})

    def publish():
        layout.replace_users("persona_profiles", users, profiles)
        layout.replace_or_remove_users(PERSONA_TABLES[1], users, calls.ledger())
        calls.compact(users)

    check_results, _ = gate(context, {"profiles_cite_existing_memories": outcome}, publish)
    merged = profiles.filter(pl.col("merged_by") == "llm").height
    return dg.MaterializeResult(
        check_results=check_results,
        metadata={"users": len(users), "dagster/row_count": profiles.height, "llm_merges": merged,
                  **ledger_metadata(calls),
                  "fallbacks": profiles.filter(pl.col("merged_by").str.starts_with("fallback")).height,
                  "prompt_version": PROFILE_PROMPT_VERSION, "seconds": round(time.perf_counter() - t0, 3),
                  **version_metadata("persona_profiles")},
    )


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[turns, episodes, memories, persona_profiles],
    code_version=code_version("memory_graph"),
    group_name="adamem",
    kinds={"parquet"},
    description="Per-user memory graph (turns, episodes, memories, topics, entities, profile entries; typed "
    "edges) as Parquet node and edge lists, for AdaMem's route-planned expansion.",
    check_specs=[dg.AssetCheckSpec("edge_endpoints_exist", asset="memory_graph", blocking=True)],
)
def memory_graph(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> dg.MaterializeResult:
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    all_nodes, all_edges = [], []
    # One read per table for the whole run (a read per user lists the table's files each time).
    held = {x: layout.read_users(x, users) for x in ("turns", "episodes", "memories", "persona_profiles")}
    with ProgressLogger(context.log, "memory graphs built") as progress:
        for i, u in enumerate(users, start=1):
            t, e, m = (held[x].get(u) for x in ("turns", "episodes", "memories"))
            if t is None or e is None or m is None:
                raise dg.Failure(f"user {u}: materialize `turns`, `episodes` and `memories` first")
            nodes, edges = build_memory_graph(u, t, e, m, held["persona_profiles"].get(u))
            all_nodes.append(nodes)
            all_edges.append(edges)
            progress(i, len(users))
    nodes, edges = pl.concat(all_nodes), pl.concat(all_edges)

    def publish():
        layout.replace_users(GRAPH_NODES, users, nodes)
        layout.replace_users(GRAPH_EDGES, users, edges)

    check_results, _ = gate(context, {"edge_endpoints_exist": graph_endpoints_exist(nodes, edges)}, publish)
    by_type = {t: int(n) for t, n in edges.group_by("edge_type").len().rows()}
    return dg.MaterializeResult(
        check_results=check_results,
        metadata={"users": len(users), "nodes": nodes.height, "dagster/row_count": edges.height,
                  "edges_by_type": dg.MetadataValue.json({t: by_type.get(t, 0) for t in EDGE_TYPES}),
                  "seconds": round(time.perf_counter() - t0, 3), **version_metadata("memory_graph")},
    )
