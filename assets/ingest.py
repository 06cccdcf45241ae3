import time

import dagster as dg

from assets.check_results import materialize
from assets.partitions import record_materialized, run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from assets.versions import code_version
from qumem_pipeline.ingest.stage import run_turns
from resources import PipelineConfig


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    code_version=code_version("turns"),
    group_name="ingest",
    kinds={"parquet", "polars"},
    description="Canonical, validated turn table per user (+ quarantine and content fingerprint).",
    check_specs=[
        dg.AssetCheckSpec("schema_conforms", asset="turns", blocking=True),
        dg.AssetCheckSpec("quarantine_under_ceiling", asset="turns", blocking=True),
    ],
)
def turns(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> dg.MaterializeResult:
    """Bring the tables up to date with the archive (only new or changed files are read, once,
    for every user they hold: qumem_pipeline/ingest/stage.py), then publish this run's users:
    their turns and fingerprints as the tables now hold them."""
    users, t0 = run_user_ids(context), time.perf_counter()
    run = run_turns(pipeline.layout(), pipeline.archive(), users, forgotten=pipeline.forgotten,
                    max_quarantine_fraction=pipeline.max_quarantine_fraction, log=context.log.info,
                    debug=context.log.debug, progress=ProgressLogger(context.log, "archive sync"))
    if run.fingerprints is not None:  # bucket scheme: what the planner compares with the archive (assets/partitions.py)
        record_materialized(context, pipeline, run.fingerprints)
    return materialize(context, run, "turns", t0)
