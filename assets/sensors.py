"""Discovery sensor: registers users found in the archive and requests range runs for new or
changed ones, and for registered users that left it (emptied downstream), at most
QUMEM_USERS_PER_RUN users per run, packed as the nightly schedule packs them.

What was built lives in the instance (the fingerprints `turns` records), not in the cursor: the
cursor is one digest of the archive's fingerprints at the last tick, so an unchanged archive
costs the discovery only, and the cursor stays 64 characters at any user count. Run keys name the
users and their fingerprints, so a run still in flight is never requested twice, and a user whose
content changes again gets a new run.
"""

import hashlib

import dagster as dg

from assets.partitions import USER_REGISTRY, USERS_PER_RUN, registered_users
from assets.planning import TURNS_KEY, live_users, pack_runs, recorded_state
from qumem_pipeline.ingest.discovery import discover
from qumem_pipeline.ingest.incremental import plan_rebuild
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
        registered = registered_users(context.instance)
        # New or changed content only: finishing interrupted runs is the nightly schedule's job.
        recorded, _ = recorded_state(context.instance, registered, None)
        plan = plan_rebuild(found.fingerprints, live_users(registered, pipeline.forgotten()), recorded)
        runs = pack_runs(context.instance, registered + plan.new, plan.to_rebuild, users_per_run)
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
            dynamic_partitions_requests=[registry.build_add_request(plan.new)] if plan.new else [],
            cursor=digest,
        )

    return _sensor


user_discovery_sensor = build_discovery_sensor()
