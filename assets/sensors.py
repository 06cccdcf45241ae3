import json

import dagster as dg

from assets.partitions import users_partitions
from qumem_pipeline.ingest.discovery import discover
from resources import PipelineConfig

MAIN_JOB_NAME = "main_job"


@dg.sensor(
    job_name=MAIN_JOB_NAME,
    minimum_interval_seconds=300,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Registers users found in the archive as partitions and requests runs for new or changed ones.",
)
def user_discovery_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineConfig) -> dg.SensorResult:
    known: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    found = discover(pipeline.archive(), known, forgotten=pipeline.forgotten(), layout=pipeline.layout())
    registered = set(context.instance.get_dynamic_partitions(users_partitions.name))
    to_add = [u for u in found.new if u not in registered]
    run_requests = [
        dg.RunRequest(run_key=f"{u}:{found.fingerprints[u]}", partition_key=u)
        for u in found.new + found.changed
    ]
    cursor = {u: fp for u, fp in found.fingerprints.items()}
    return dg.SensorResult(
        run_requests=run_requests,
        dynamic_partitions_requests=[users_partitions.build_add_request(to_add)] if to_add else [],
        cursor=json.dumps(cursor, sort_keys=True),
    )
