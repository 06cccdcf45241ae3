import time

import dagster as dg

from assets.check_results import materialize, no_users_result
from assets.ingest import turns
from assets.partitions import not_forgotten, run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from assets.versions import code_version
from qumem_pipeline.contracts.stage_run import StageFailed
from qumem_pipeline.episodes.stage import run_episodes
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
    """The run users' turns segmented into episodes (qumem_pipeline/episodes/stage.py)."""
    users, t0 = run_user_ids(context), time.perf_counter()
    if not users:
        return no_users_result(context)
    try:
        run = run_episodes(pipeline.layout(), users, continuity.model, batch_size=continuity.batch_size,
                           token_budget=continuity.token_budget, skip_forgotten=lambda us: not_forgotten(context, us),
                           progress=ProgressLogger(context.log, "continuity pairs classified"))
    except StageFailed as exc:
        raise dg.Failure(str(exc)) from exc
    return no_users_result(context) if run is None else materialize(context, run, "episodes", t0)
