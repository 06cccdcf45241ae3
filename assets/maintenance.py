"""Table maintenance as a Dagster job: prune old run user lists, compact small files, then vacuum files
outside the retention.

Every run's replace adds about one file per touched bucket and table; compaction bin-packs them into
large files (QUMEM_TARGET_FILE_BYTES, 256 MB by default) and vacuum deletes the replaced ones once
they are older than the retention (7 days by default: readers of older versions, time travel).
Every plan of the bucket scheme appends its runs' user lists to `run_users`; lists older than
`run_users_retention_days` (30 by default) are deleted first, except those of runs not finished yet.
"""

from datetime import datetime, timedelta, timezone

import dagster as dg

from resources import PipelineConfig


class MaintenanceConfig(dg.Config):
    retention_hours: int = 168  # Delta's default; below it needs allow_short_retention
    allow_short_retention: bool = False
    tables: list[str] = []  # [] = every table of the store
    run_users_retention_days: int = 30  # 0 keeps every run user list


@dg.op(pool="warehouse", description="Compact and vacuum every Delta table of the data root.")
def maintain_tables_op(context: dg.OpExecutionContext, config: MaintenanceConfig, pipeline: PipelineConfig) -> dg.Output:
    if config.retention_hours < 168 and not config.allow_short_retention:
        raise dg.Failure(f"retention_hours={config.retention_hours} is under 7 days: readers of older versions would "
                         "lose their files; set allow_short_retention to do it anyway")
    store = pipeline.layout().store
    pruned = _prune_run_users(context, pipeline, config.run_users_retention_days)
    tables = config.tables or store.tables()
    report = {}
    for t in tables:
        before = len(store.files(t))
        compacted = store.compact(t)
        removed = store.vacuum(t, retention_hours=config.retention_hours)
        report[t] = {"files_before": before, "files_after": len(store.files(t)),
                     "files_compacted": compacted.get("numFilesRemoved", 0), "files_vacuumed": len(removed)}
        context.log.info(f"{t}: {report[t]}")
    return dg.Output(None, metadata={"tables": dg.MetadataValue.json(report), "run_users_pruned": pruned})


def _prune_run_users(context: dg.OpExecutionContext, pipeline: PipelineConfig, days: int) -> int:
    """Old run user lists out of `run_users`, keeping the lists of every run not finished yet."""
    from assets.partitions import RUN_USERS_TAG, user_registry

    if days <= 0:
        return 0
    unfinished = context.instance.get_runs(filters=dg.RunsFilter(statuses=[
        dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]))
    keep = {r.tags[RUN_USERS_TAG] for r in unfinished if RUN_USERS_TAG in r.tags}
    n = user_registry(pipeline).prune_run_users(datetime.now(timezone.utc) - timedelta(days=days), keep)
    context.log.info(f"run_users: {n} rows of lists planned over {days} days ago deleted ({len(keep)} lists of unfinished runs kept)")
    return n


@dg.job(description="Compact small files and vacuum old ones in every Delta table (run e.g. weekly).")
def table_maintenance_job():
    maintain_tables_op()
