import time

import dagster as dg
import polars as pl

from assets.check_results import gate
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from qumem_pipeline.contracts import checks
from qumem_pipeline.ingest.incremental import recorded_form
from qumem_pipeline.ingest.archive import load_archive, write_unattributed_quarantine, write_users
from qumem_pipeline.ingest.validate import TURN_POLARS_SCHEMA
from assets.versions import code_version, version_metadata
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
    users = run_user_ids(context)
    t0 = time.perf_counter()
    result = load_archive(pipeline.archive(), forgotten=pipeline.forgotten())
    layout = pipeline.layout()
    # Blocking checks on the rows before anything is committed: a failing check publishes nothing.
    run_turns = result.turns.filter(pl.col("user_id").is_in(users)).height
    run_q = result.quarantine.filter(pl.col("user_id").is_in(users)).height
    schema_ok = checks.schema_conforms(result.turns, dict(TURN_POLARS_SCHEMA), "turns")
    ceiling = checks.quarantine_under_ceiling(run_turns, run_q, pipeline.max_quarantine_fraction)
    written: dict = {}

    def publish():
        written["stats"] = write_users(layout, result, users, progress=ProgressLogger(context.log, "turns written"))
        written["unattributed"] = write_unattributed_quarantine(layout, result)

    check_results, _ = gate(context, {"schema_conforms": schema_ok, "quarantine_under_ceiling": ceiling}, publish)
    stats, unattributed = written.get("stats", {}), written.get("unattributed", 0)
    counts = result.counts()
    context.log.info(
        f"{len(users)} users: {run_turns} turns, {run_q} quarantined for these users, "
        f"{unattributed} unattributed bad rows; archive-wide quarantine by field: {counts['quarantined_by_field']}"
    )
    return dg.MaterializeResult(
        check_results=check_results,
        metadata={
            "users": len(users),
            "dagster/row_count": run_turns,
            "quarantined": run_q,
            "quarantined_unattributed": unattributed,
            "archive_quarantined_by_field": dg.MetadataValue.json(counts["quarantined_by_field"]),
            # every user of the run: the nightly schedule compares these with the archive (assets/schedules.py)
            "fingerprints": dg.MetadataValue.json({u: recorded_form(s["fingerprint"]) for u, s in stats.items()}),
            "seconds": round(time.perf_counter() - t0, 3),
            **version_metadata("turns"),
        }
    )
