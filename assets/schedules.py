"""Nightly incremental rebuild: only users whose archive content changed since their last `turns`.

Each tick fingerprints the archive per user (the same function `turns` records), reads the
fingerprint recorded in each user's latest `turns` materialization from the event log, registers
new users as partitions and requests `main_job` runs for new/changed users only. Unchanged users
cost the check and nothing else.

Schedules can request one partition or one contiguous partition range per run (the
`dagster/asset_partition_range_start|end` tags; the subset/backfill form of RunRequest is private
in Dagster 1.13 and honoured by the sensor daemon only), so changed users are packed into maximal
ranges of the partition order holding only changed users, each at most QUMEM_USERS_PER_RUN.
"""

import os

import dagster as dg

from assets.partitions import USERS_PER_RUN, users_partitions
from qumem_pipeline.ingest.discovery import discover
from qumem_pipeline.ingest.incremental import contiguous_ranges, plan_rebuild, unfinished
from resources import PipelineConfig

NIGHTLY_CRON = os.environ.get("QUMEM_NIGHTLY_CRON") or "0 2 * * *"
TURNS_KEY = dg.AssetKey("turns")


def latest_ids(instance: dg.DagsterInstance, key: dg.AssetKey, users: list[str]) -> dict[str, int]:
    """user -> storage id of that user's latest materialization of `key` (absent if none)."""
    return dict(instance.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_MATERIALIZATION, set(users)))


def recorded_fingerprints(instance: dg.DagsterInstance, users: list[str], latest: dict[str, int] | None = None) -> dict[str, str]:
    """user -> fingerprint recorded by that user's latest `turns` materialization (absent if none)."""
    latest = latest_ids(instance, TURNS_KEY, users) if latest is None else latest
    if not latest:
        return {}
    out: dict[str, str] = {}
    ids = sorted(latest.values())
    for i in range(0, len(ids), 500):  # bounded queries for archives with many users
        batch = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=TURNS_KEY, storage_ids=ids[i : i + 500]), limit=500
        )
        for record in batch.records:
            mat = record.asset_materialization
            recorded = mat.metadata.get("fingerprints") if mat else None
            value = recorded.value if recorded is not None else None
            if mat and mat.partition and isinstance(value, dict) and mat.partition in value:
                out[mat.partition] = value[mat.partition]
    return out


def build_nightly_schedule(
    job=None,  # a users-partitioned job (defined or unresolved asset job) that includes `turns`
    job_name: str | None = None,
    cron: str = NIGHTLY_CRON,
    users_per_run: int = USERS_PER_RUN,
    name: str = "nightly_incremental_rebuild",
    final_asset: str = "warehouse",
) -> dg.ScheduleDefinition:
    """The schedule for `job` (any users-partitioned job that includes `turns`); off by default.

    `final_asset` is the job's last asset: a user whose `final_asset` is older than its `turns`
    (a run that failed part-way) is rebuilt even though its content did not change.
    """
    final_key = dg.AssetKey(final_asset)

    @dg.schedule(
        name=name,
        cron_schedule=cron,
        execution_timezone="UTC",
        job=job,
        job_name=job_name,
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=f"Rebuild only new or changed users (runs of <= {users_per_run} users).",
    )
    def _nightly(context: dg.ScheduleEvaluationContext, pipeline: PipelineConfig):
        found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout())
        registered = list(context.instance.get_dynamic_partitions(users_partitions.name))
        turns_ids = latest_ids(context.instance, TURNS_KEY, registered)
        incomplete = set() if final_key == TURNS_KEY else unfinished(
            turns_ids, latest_ids(context.instance, final_key, registered))
        plan = plan_rebuild(found.fingerprints, registered,
                            recorded_fingerprints(context.instance, registered, turns_ids), incomplete)
        context.log.info(
            f"nightly check: {len(found.fingerprints)} users, {len(plan.new)} new, "
            f"{len(plan.changed)} changed or unfinished ({len(incomplete)} unfinished), {len(plan.unchanged)} unchanged"
        )
        if not plan.to_rebuild:
            return dg.SkipReason(f"all {len(plan.unchanged)} users unchanged since their last materialization")
        if plan.new:
            # Schedules cannot return partition requests; adding them here is what the daemon would do.
            context.instance.add_dynamic_partitions(users_partitions.name, plan.new)
        order = registered + plan.new  # dynamic partitions keep insertion order
        tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "manual"
        requests = []
        for users in contiguous_ranges(order, plan.to_rebuild, users_per_run):
            tags = {"qumem/nightly_users": str(len(users))}
            if len(users) == 1:
                requests.append(dg.RunRequest(run_key=f"{tick}:{users[0]}", partition_key=users[0], tags=tags))
            else:
                tags.update({
                    "dagster/asset_partition_range_start": users[0],
                    "dagster/asset_partition_range_end": users[-1],
                })
                requests.append(dg.RunRequest(run_key=f"{tick}:{users[0]}..{users[-1]}", tags=tags))
        return requests

    return _nightly
