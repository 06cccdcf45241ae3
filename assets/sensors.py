"""Discovery sensor: registers users found in the fingerprints table (the tick adds them as dynamic partitions
in the `users` scheme, then re-reads the forget registry; it appends them to the data root's
`user_registry` in `user_buckets`)
and requests range runs for new or changed ones, and for registered users that left it (emptied downstream), at most
QUMEM_USERS_PER_RUN users per run, packed as the nightly schedule packs them.

What was built lives in the instance (the fingerprints `turns` records), not in the cursor: the
cursor is the fingerprints table's content state (a digest of its data files) and one digest of
the archive's fingerprints at the last tick (`f<state>:<digest>`), so it stays short at any user
count. A tick whose sync leaves the table holding the same files reads no fingerprint at all; one
that finds the same digest requests nothing. Run keys name the
users and their fingerprints, so a run still in flight is never requested twice, and a user whose
content changes again gets a new run.

The tick reads no archive file: it plans from the fingerprints table as the last archive sync left
it (`discover(..., sync=False)`), and requests that sync as a run of the `archive_sync` job
(assets/archive_sync.py) whenever the archive's listing (a stat per file, no read) is ahead of the
ingest manifest and no sync run is in flight. The sync run commits the new content; the next tick
sees the fingerprints table's files change and plans the rebuilds, so new archive content is built
end to end in two ticks plus the sync, each tick well inside Dagster's evaluation timeout
(DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS, 60 s by default) at any archive size.
"""

import hashlib

import dagster as dg

from assets.archive_sync import archive_sync_job, sync_request
from assets.partitions import SCHEME, USER_REGISTRY, USERS_PER_RUN, register_unforgotten, register_users  # noqa: F401
from assets.planning import TURNS_KEY, pack_runs, plan_users  # noqa: F401
from qumem_pipeline.ingest.discovery import discover
from resources import PipelineConfig

MAIN_JOB_NAME = "main_job"
registry = dg.DynamicPartitionsDefinition(name=USER_REGISTRY)


def archive_digest(fingerprints: dict[str, str]) -> str:
    h = hashlib.sha256()
    for u in sorted(fingerprints):
        h.update(f"{u}\t{fingerprints[u]}\n".encode("utf-8"))
    return h.hexdigest()


def parse_cursor(cursor: str | None) -> tuple[str | None, str | None]:
    """(fingerprints table state, archive digest) of a cursor; a bare digest (older cursors) has no state."""
    if not cursor:
        return None, None
    head, sep, digest = cursor.partition(":")
    if sep and head.startswith("f") and len(head) > 1:
        return head[1:], digest
    return None, cursor


def build_discovery_sensor(job, users_per_run: int = USERS_PER_RUN, name: str = "user_discovery_sensor",
                           sync_job=archive_sync_job) -> dg.SensorDefinition:
    """`job`: the users-partitioned job (definition or unresolved asset job) the rebuild runs are of;
    `sync_job`: the `archive_sync` job the tick requests the archive sync as (module doc)."""
    job_name = job.name

    @dg.sensor(
        name=name,
        jobs=[job, sync_job],
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description=f"Requests the archive sync as a run, registers users the fingerprints table holds and requests "
                    f"range runs (<= {users_per_run} users) for new or changed ones.",
    )
    def _sensor(context: dg.SensorEvaluationContext, pipeline: PipelineConfig):
        seen_state, seen_digest = parse_cursor(context.cursor)
        sync, why = sync_request(context.instance, pipeline)
        syncing = [sync] if sync is not None else []
        context.log.info(f"archive sync: {'requested, ' if sync is not None else ''}{why}")
        found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout(),
                         unless_state=seen_state, sync=False)
        if found is None or found.fingerprints_state is None:  # unchanged, or no sync has written it yet
            skip = ("fingerprints table unchanged since the last tick (it holds the same files)" if found is None
                    else "no archive sync has written the fingerprints table yet")
            return dg.SensorResult(run_requests=syncing, cursor=context.cursor) if syncing else dg.SkipReason(skip)
        digest = archive_digest(found.fingerprints)
        cursor = digest if found.fingerprints_state is None else f"f{found.fingerprints_state}:{digest}"
        if seen_digest == digest:  # the table's files changed (rows rewritten as they were), its content did not
            if syncing:
                return dg.SensorResult(run_requests=syncing, cursor=cursor)
            return dg.SensorResult(skip_reason=f"archive unchanged since the last tick ({len(found.fingerprints)} users)",
                                   cursor=cursor)
        # New or changed content only: finishing interrupted runs is the nightly schedule's job.
        planned = plan_users(context.instance, pipeline, found.fingerprints, None)
        plan, recorded = planned.plan, planned.recorded
        # registered by the tick itself in both schemes (not by the daemon after it), then checked against
        # the forget registry: no tick re-adds a forgotten id (assets/partitions.register_unforgotten)
        gone = register_unforgotten(context.instance, plan.new, pipeline, found.fingerprints, known=(),
                                    planned=plan.to_rebuild)
        order = [u for u in planned.order if u not in gone] if gone else planned.order
        runs = pack_runs(context.instance, order, plan.to_rebuild - gone, users_per_run, pipeline=pipeline)
        requests = []
        for run in runs:
            # a user that left the archive has no fingerprint: "gone" + the content it left with
            content = hashlib.sha256("".join(f"{u}:{found.fingerprints.get(u) or 'gone:' + recorded.get(u, '')}"
                                             for u in run.users).encode()).hexdigest()
            requests.append(run.run_request(f"{run.first_key}..{run.last_key}:{content[:24]}",
                                            {"qumem/discovered_users": str(len(run.users))}, job_name=job_name))
        context.log.info(f"{len(found.fingerprints)} users: {len(plan.new)} new, {len(plan.changed)} changed, "
                         f"{len(plan.removed)} left the archive, {len(gone)} forgotten meanwhile, "
                         f"{len(requests)} runs requested")
        return dg.SensorResult(run_requests=syncing + requests, cursor=cursor)

    return _sensor
