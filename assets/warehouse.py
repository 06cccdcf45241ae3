import time

import dagster as dg

from assets.check_results import no_users_result
from assets.adamem import persona_profiles
from assets.episodes import episodes
from assets.ingest import turns
from assets.memories import memories
from assets.query_states import query_states
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.query.personalize import evidence_outcome as personalization_evidence, purge_withdrawn
from qumem_pipeline.storage.warehouse import WAREHOUSE_TABLES
from assets.versions import code_version, version_metadata
from resources import PipelineConfig

# Upstream assets whose tables the warehouse mirrors; stages append theirs in definitions.
WAREHOUSE_UPSTREAMS = [turns, episodes, memories, query_states, persona_profiles]


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=WAREHOUSE_UPSTREAMS,
    pool="warehouse",
    code_version=code_version("warehouse"),
    group_name="warehouse",
    kinds={"duckdb"},
    description="DuckDB warehouse: one table per stage, the run's users replaced in one transaction each; "
    "the bulk personalization rows of the run's users that cite withdrawn turns are purged.",
    check_specs=[dg.AssetCheckSpec(
        "personalization_evidence_turns_exist", asset="warehouse",
        description="No personalization row of the run's users cites a turn that no longer exists "
                    "(checked on the Delta table after the purge).")],
)
def warehouse(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> dg.MaterializeResult:
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    t0 = time.perf_counter()
    wh = pipeline.warehouse()
    layout = pipeline.layout()
    with ProgressLogger(context.log, f"warehouse tables loaded ({len(users)} users)") as progress:
        loaded = wh.load_users(layout, users, WAREHOUSE_TABLES, progress=progress)
    # a withdrawn source reaches the bulk outputs too (qumem_pipeline/query/personalize.py), then the
    # evidence check reads the table back
    purged = purge_withdrawn(layout, users, wh)
    evidence = personalization_evidence(layout, users)
    # Unattributed quarantine rows belong to no user partition but must be visible too (reloaded
    # only when their Delta files changed since the last load).
    unattributed = wh.load_unattributed(pipeline.layout(), UNATTRIBUTED)
    return dg.MaterializeResult(
        check_results=[dg.AssetCheckResult(check_name="personalization_evidence_turns_exist", passed=evidence.passed,
                                           description=evidence.description, metadata=evidence.metadata)],
        metadata={
            "users": len(users),
            "personalization_rows_purged": dg.MetadataValue.json(purged),
            "rows_for_run_users": dg.MetadataValue.json(loaded),
            "unattributed_quarantine_rows": "unchanged" if unattributed is None else unattributed,
            "warehouse_path": str(wh.path),
            "seconds": round(time.perf_counter() - t0, 3),
            **version_metadata("warehouse"),
        }
    )
