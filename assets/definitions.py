"""The one place that builds the Definitions: assets, jobs, sensors, resources, executor."""

import dagster as dg

from assets.forget import forget_user_job
from assets.maintenance import table_maintenance_job
from assets.personalize import personalize_job
from assets.adamem import memory_graph, persona_profiles
from assets.episodes import episodes
from assets.ingest import turns
from assets.memories import memories
from assets.query_states import query_states
from assets.retrieval import memory_embeddings, memory_indexes
from assets.schedules import build_nightly_schedule
from assets.partitions import users_partitions
from assets.archive_sync import archive_sync_job, archive_sync_schedule
from assets.sensors import MAIN_JOB_NAME, build_discovery_sensor
from assets.warehouse import warehouse
from resources import resources_for

ALL_ASSETS = [turns, episodes, memories, memory_embeddings, memory_indexes, persona_profiles, memory_graph, query_states, warehouse]

main_job = dg.define_asset_job(
    MAIN_JOB_NAME,
    selection=dg.AssetSelection.assets(*ALL_ASSETS),
    partitions_def=users_partitions,
    description="Everything for the selected users: ingest -> ... -> warehouse.",
)
ingest_job = dg.define_asset_job(
    "ingest_job",
    selection=dg.AssetSelection.assets(turns, warehouse),
    partitions_def=users_partitions,
    description="Ingest and validate the archive into the turn table and the warehouse.",
)


def build_definitions(env: str | None = None, executor: dg.ExecutorDefinition | None = None) -> dg.Definitions:
    """`executor`: None = in-process (one process per run, models loaded once); deploy/ passes
    multiprocess or Kubernetes executors, so scale-out is configuration, not code."""
    return dg.Definitions(
        assets=ALL_ASSETS,
        jobs=[main_job, ingest_job, forget_user_job, table_maintenance_job, personalize_job, archive_sync_job],
        # the ticks only plan; the archive sync is a run of archive_sync_job (assets/archive_sync.py)
        sensors=[build_discovery_sensor(job=main_job)],
        schedules=[build_nightly_schedule(job=main_job), archive_sync_schedule],
        resources=resources_for(env),
        executor=executor or dg.in_process_executor,
    )


defs = build_definitions()
