import time

import dagster as dg
import polars as pl

from assets.check_results import no_users_result
from assets.ingest import turns
from assets.memories import memories
from assets.partitions import not_forgotten, run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from qumem_pipeline.index import vector_store as vector_index
from qumem_pipeline.index.embeddings import embed_memories
from qumem_pipeline.index.memory_keys import source_texts
from assets.versions import code_version, version_metadata
from resources import PipelineConfig
from resources.models import EmbedderResource


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[memories, turns],
    pool="gpu",
    code_version=code_version("memory_embeddings"),  # source + embedder + upstream
    group_name="retrieval",
    kinds={"pytorch", "parquet"},
    description="Memory index keys (all-MiniLM-L6-v2, normalised float32): each memory's content plus its "
    "source turns (qumem_pipeline.index.memory_keys). Made from the memories and turns tables alone, so a new "
    "embedding model or key rule re-embeds without re-running the LLM.",
)
def memory_embeddings(context: dg.AssetExecutionContext, pipeline: PipelineConfig, embedder: EmbedderResource) -> dg.MaterializeResult:
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    by_user = layout.read_users("memories", users)  # one read for the run's users
    missing = [u for u in users if u not in by_user]
    missing = not_forgotten(context, missing)  # a forget that landed inside this step: skip its user
    if missing:
        raise dg.Failure(f"no memories for user {missing[0]} ({len(missing)} users): materialize `memories` first")
    users = [u for u in users if u in by_user]
    if not users:
        return no_users_result(context)
    mems = pl.concat([by_user[u] for u in users])
    previous = layout.read_table("memory_embeddings", users)
    turns_by_user = layout.read_users("turns", users)
    sources = source_texts(mems, pl.concat(list(turns_by_user.values()), how="diagonal_relaxed")) if turns_by_user else {}
    with ProgressLogger(context.log, "memories embedded") as progress:
        progress.total = mems.height  # the heartbeat's figure before the first batch is done
        emb = embed_memories(mems, embedder.model, sources=sources, previous=previous, batch_size=embedder.batch_size,
                             progress=progress)
    emb = emb.with_columns(code_version=pl.lit(code_version("memory_embeddings"), pl.String))
    layout.replace_users("memory_embeddings", users, emb)
    return dg.MaterializeResult(metadata={
        "users": len(users), "dagster/row_count": emb.height,
        "embedding_model": emb["embedding_model"][0] if emb.height else embedder.model.version,
        "device": str(embedder.model.device), "seconds": round(time.perf_counter() - t0, 3),
        **version_metadata("memory_embeddings"),
    })


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[memory_embeddings],
    pool="gpu",
    code_version=code_version("memory_indexes"),
    group_name="retrieval",
    kinds={"faiss"},
    description="Per-user, per-type FAISS indexes (IndexIDMap2 over exact inner product) + id map.",
)
def memory_indexes(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> dg.MaterializeResult:
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    sizes, built_on, built = {}, set(), []
    embs = layout.read_users("memory_embeddings", users)
    with ProgressLogger(context.log, "user indexes built") as progress:
        for i, u in enumerate(users, start=1):
            emb = embs.get(u)
            if emb is None:
                raise dg.Failure(f"user {u}: materialize `memory_embeddings` first")
            ux = vector_index.build_user_indexes(emb, u)
            built.append(ux)
            built_on.add(ux.built_on)
            sizes[u] = {t: ti.ntotal for t, ti in ux.by_type.items()}
            progress(i, len(users))
        progress.stage(f"user indexes written ({len(users)} users)")
        vector_index.write_users_indexes(layout, built)  # one transaction per table for the run's users
    return dg.MaterializeResult(metadata={
        "users": len(users), "vectors": sum(sum(v.values()) for v in sizes.values()),
        "built_on": ",".join(sorted(built_on)), "seconds": round(time.perf_counter() - t0, 3),
        **version_metadata("memory_indexes"),
    })
