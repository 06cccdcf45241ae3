import time

import dagster as dg
import polars as pl

from assets.ingest import turns
from assets.check_results import gate, no_users_result
from assets.partitions import not_forgotten, run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from qumem_pipeline.contracts import checks
from qumem_pipeline.episodes.segmentation import EPISODE_SCHEMA, build_episodes_for_users
from assets.versions import code_version, version_metadata
from resources import PipelineConfig
from resources.models import ContinuityClassifierResource

EPISODES_CODE_VERSION = code_version("episodes")  # source + classifier artifact + upstream


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[turns],
    pool="gpu",
    code_version=EPISODES_CODE_VERSION,
    group_name="episodes",
    kinds={"pytorch", "parquet"},
    description="Variable-length episodes from the continuity classifier over adjacent user utterances.",
    check_specs=[
        dg.AssetCheckSpec("every_turn_in_one_nonempty_episode", asset="episodes", blocking=True),
        dg.AssetCheckSpec("schema_conforms", asset="episodes", blocking=True),
    ],
)
def episodes(
    context: dg.AssetExecutionContext, pipeline: PipelineConfig, continuity: ContinuityClassifierResource
) -> dg.MaterializeResult:
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    # one read for the run's users (a read per user opens the Delta table once per user)
    turns_by_user = layout.read_users("turns", users)
    missing = [u for u in users if u not in turns_by_user]
    missing = not_forgotten(context, missing)  # a forget that landed inside this step: skip its user
    if missing:
        raise dg.Failure(f"no turns for user {missing[0]} ({len(missing)} users): materialize `turns` first")
    users = [u for u in users if u in turns_by_user]
    if not users:
        return no_users_result(context)
    model = continuity.model
    progress = ProgressLogger(context.log, "continuity pairs classified")
    t1 = time.perf_counter()
    with progress:
        by_user, stats = build_episodes_for_users(
            turns_by_user,
            lambda pairs: model.predict_same_proba(pairs, batch_size=continuity.batch_size),
            rule=model.rule,
            similarity=model.pair_cosine,  # used only when the rule reads the cosine
            embed_histories=model.history_embeddings,  # used only when the rule has block features
            classifier_version=model.version,
            token_budget=continuity.token_budget,
            progress=progress,  # pairs done / all, after each user (each user's pairs are calls of their own)
        )
    classify_s = time.perf_counter() - t1
    sizes = [n for df in by_user.values() for n in df["n_turns"].to_list()]
    coverage = checks.episodes_cover_turns(turns_by_user, by_user)
    schema_ok = checks.schema_conforms(
        next(iter(by_user.values())) if by_user else pl.DataFrame(schema=EPISODE_SCHEMA), EPISODE_SCHEMA, "episodes"
    )
    check_results, _ = gate(context, {"every_turn_in_one_nonempty_episode": coverage, "schema_conforms": schema_ok},
                            lambda: layout.replace_parts("episodes", by_user))
    return dg.MaterializeResult(
        check_results=check_results,
        metadata={
            "users": stats.users,
            "dagster/row_count": stats.episodes,
            "user_utterances": stats.user_utterances,
            "classifier_decisions": stats.decisions,
            "forced_splits": stats.forced_splits,
            "session_breaks": stats.session_breaks,
            "oversize_single_units": stats.oversize_single_units,
            "mean_turns_per_episode": round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
            "pairs_per_s": round(stats.decisions / classify_s, 1) if classify_s > 0 else 0.0,
            "classifier_version": model.version,
            **version_metadata("episodes"),
            "device": str(model.device),
            "seconds": round(time.perf_counter() - t0, 3),
        }
    )
