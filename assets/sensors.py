"""Discovery sensor: registers users found in the archive (the daemon adds them as dynamic partitions
in the `users` scheme; the tick appends them to the data root's `user_registry` in `user_buckets`)
and requests range runs for new or changed ones, and for registered users that left it (emptied downstream), at most
QUMEM_USERS_PER_RUN users per run, packed as the nightly schedule packs them.

What was built lives in the instance (the fingerprints `turns` records), not in the cursor: the
cursor is one digest of the archive's fingerprints at the last tick, so an unchanged archive
costs the discovery only, and the cursor stays 64 characters at any user count. Run keys name the
users and their fingerprints, so a run still in flight is never requested twice, and a user whose
content changes again gets a new run.
"""

import hashlib

import dagster as dg

from assets.partitions import SCHEME, USER_REGISTRY, USERS_PER_RUN, register_users
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


def build_discovery_sensor(job_name: str = MAIN_JOB_NAME, users_per_run: int = USERS_PER_RUN,
                           name: str = "user_discovery_sensor") -> dg.SensorDefinition:
    @dg.sensor(
        name=name,
        job_name=job_name,
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description=f"Registers users found in the archive and requests range runs (<= {users_per_run} users) "
                    "for new or changed ones.",
    )
    def _sensor(context: dg.SensorEvaluationContext, pipeline: PipelineConfig):
        found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout())
        digest = archive_digest(found.fingerprints)
        if context.cursor == digest:
            return dg.SkipReason(f"archive unchanged since the last tick ({len(found.fingerprints)} users)")
        # New or changed content only: finishing interrupted runs is the nightly schedule's job.
        planned = plan_users(context.instance, pipeline, found.fingerprints, None)
        plan, recorded = planned.plan, planned.recorded
        if SCHEME == "user_buckets":  # the registry is the data root's table: registered here, not by the daemon
            register_users(context.instance, plan.new, pipeline, found.fingerprints, known=())
        runs = pack_runs(context.instance, planned.order, plan.to_rebuild, users_per_run, pipeline=pipeline)
        requests = []
        for run in runs:
            # a user that left the archive has no fingerprint: "gone" + the content it left with
            content = hashlib.sha256("".join(f"{u}:{found.fingerprints.get(u) or 'gone:' + recorded.get(u, '')}"
                                             for u in run.users).encode()).hexdigest()
            requests.append(run.run_request(f"{run.first_key}..{run.last_key}:{content[:24]}",
                                            {"qumem/discovered_users": str(len(run.users))}))
        context.log.info(f"{len(found.fingerprints)} users: {len(plan.new)} new, {len(plan.changed)} changed, "
                         f"{len(plan.removed)} left the archive, {len(requests)} runs requested")
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[registry.build_add_request(plan.new)] if plan.new and SCHEME == "users" else [],
            cursor=digest,
        )

    return _sensor


user_discovery_sensor = build_discovery_sensor()
