"""Nightly incremental rebuild: only users whose archive content changed since their last `turns`.

The tick only plans: it reads no archive file. It takes every user's fingerprint from the
fingerprints table as the last archive sync left it (`discover(..., sync=False)`); the sync itself
(new and changed files read into the tables) is a run of the `archive_sync` job, requested by its
companion `archive_sync_schedule` (QUMEM_ARCHIVE_SYNC_CRON, 01:00 UTC by default) an hour before
this tick (02:00), and by the discovery sensor when it is on (assets/archive_sync.py says why a
companion schedule and not a request from this tick). So the tick stays within Dagster's schedule
evaluation timeout (DAGSTER_SCHEDULE_GRPC_TIMEOUT_SECONDS, 60 s by default) at any archive size,
and its log names the last sync run (content a sync had not committed yet is planned next night).

Each tick compares each user's fingerprint (the same function `turns` records) with the
fingerprint its latest `turns` materialization published (the event log, or the data root's
`user_registry` in the bucket scheme), registers new users and requests `main_job` runs for new/changed users only. Unchanged users
cost the check and nothing else. A registered user that left the archive (its source files were
withdrawn) is rebuilt once as empty: every downstream table and the warehouse lose its rows.

Schedules can request one partition or one contiguous partition range per run (the
`dagster/asset_partition_range_start|end` tags; the subset/backfill form of RunRequest is private
in Dagster 1.13 and honoured by the sensor daemon only), so changed users are packed into runs of
at most QUMEM_USERS_PER_RUN by `assets/planning.py`: maximal ranges of the partition order holding
only changed users (`users` scheme), or bucket ranges that name their users (`user_buckets`).
"""

import os

import dagster as dg

from assets.archive_sync import ARCHIVE_SYNC_JOB, last_sync
from assets.partitions import USERS_PER_RUN, register_unforgotten, register_users  # noqa: F401
from assets.planning import TURNS_KEY, latest_ids, live_users, pack_runs, plan_users, recorded_fingerprints, recorded_state  # noqa: F401
from qumem_pipeline.ingest.discovery import discover
from resources import PipelineConfig

NIGHTLY_CRON = os.environ.get("QUMEM_NIGHTLY_CRON") or "0 2 * * *"


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
        context.log.info(last_sync(context.instance))
        found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout(), sync=False)
        if found.fingerprints_state is None:  # not "every registered user left the archive"
            return dg.SkipReason(f"no archive sync has written this data root's fingerprints table yet "
                                 f"(run the {ARCHIVE_SYNC_JOB} job, or turn on archive_sync_schedule)")
        planned = plan_users(context.instance, pipeline, found.fingerprints, final_key)
        plan, incomplete = planned.plan, planned.incomplete
        context.log.info(
            f"nightly check: {len(found.fingerprints)} users, {len(plan.new)} new, "
            f"{len(plan.changed)} changed or unfinished ({len(incomplete)} unfinished), "
            f"{len(plan.removed)} left the archive (emptied downstream), {len(plan.unchanged)} unchanged"
        )
        if not plan.to_rebuild:
            return dg.SkipReason(f"all {len(plan.unchanged)} users unchanged since their last materialization")
        # Schedules cannot return partition requests; registered here, then checked against the forget
        # registry so no tick re-adds a forgotten id (assets/partitions.register_unforgotten)
        gone = register_unforgotten(context.instance, plan.new, pipeline, found.fingerprints, known=(),
                                    planned=plan.to_rebuild)
        order = [u for u in planned.order if u not in gone]  # dynamic partitions keep insertion order (`users`)
        if not plan.to_rebuild - gone:
            return dg.SkipReason(f"every user to rebuild ({len(gone)}) was forgotten during the tick")
        tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "manual"
        return [run.run_request(f"{tick}:{run.label}",
                                {"qumem/nightly_users": str(len(run.users))})
                for run in pack_runs(context.instance, order, plan.to_rebuild - gone, users_per_run, pipeline=pipeline)]

    return _nightly
