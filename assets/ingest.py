import time

import dagster as dg
import polars as pl

from assets.check_results import check_result
from assets.partitions import record_materialized, run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from qumem_pipeline.contracts import checks
from qumem_pipeline.ingest.incremental import recorded_form
from qumem_pipeline.ingest.archive import EMPTY_FINGERPRINT
from qumem_pipeline.ingest.sync import sync_archive
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.storage.table_store import STORE_COLUMNS
from qumem_pipeline.runtime.faults import fault_point
from qumem_pipeline.ingest.validate import TURN_POLARS_SCHEMA
from assets.versions import code_version, version_metadata
from resources import PipelineConfig


class BlockedByChecks(Exception):
    """A blocking check failed on rows the archive sync was about to commit."""


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
    """Bring the tables up to date with the archive (only new or changed files are read, once,
    for every user they hold: qumem_pipeline/ingest/sync.py), then publish this run's users:
    their turns and fingerprints as the tables now hold them."""
    users = run_user_ids(context)
    t0 = time.perf_counter()
    layout = pipeline.layout()
    blocked: dict[str, checks.CheckOutcome] = {}

    def before_commit(turns_rows: pl.DataFrame, quarantine_rows: pl.DataFrame) -> None:
        """Blocking checks on the rows about to be written: a failure commits nothing of them."""
        outcomes = {
            "schema_conforms": checks.schema_conforms(turns_rows, dict(TURN_POLARS_SCHEMA), "turns"),
            "quarantine_under_ceiling": checks.quarantine_under_ceiling(
                turns_rows.height, quarantine_rows.height, pipeline.max_quarantine_fraction),
        }
        if not all(o.passed for o in outcomes.values()):
            if quarantine_rows.height and "field" in quarantine_rows.columns:
                # what the operator fixes: the bad rows' fields, and each row's place in the archive (in the log)
                by_field = quarantine_rows.group_by("field").len().sort(["len", "field"], descending=[True, False])
                outcomes["quarantine_under_ceiling"].metadata["quarantined_by_field"] = ", ".join(
                    f"{f} {n}" for f, n in by_field.rows())
                for r in quarantine_rows.head(50).iter_rows(named=True):
                    context.log.debug(f"quarantined: {r.get('source_file')} row {r.get('source_row')}: "
                                      f"{r.get('field')}: {r.get('reason')}")
            blocked.update(outcomes)
            raise BlockedByChecks(", ".join(n for n, o in outcomes.items() if not o.passed))

    progress = ProgressLogger(context.log, "archive sync")

    def sync_progress(stage: str, done: int, total: int) -> None:
        if progress.label != stage:
            progress.stage(stage, total)
        progress(done, total)

    try:
        with progress:
            report = sync_archive(pipeline.archive(), layout, forgotten=pipeline.forgotten(),
                                  before_commit=before_commit, progress=sync_progress)
    except BlockedByChecks as exc:
        context.log.error(f"blocking checks failed ({exc}): nothing of those users written, the previous version "
                          "stays; the files stay pending, so the next run redoes them")
        return dg.MaterializeResult(check_results=[check_result(n, o) for n, o in blocked.items()],
                                    metadata={"users": len(users), "blocked_by": str(exc), **version_metadata("turns")})
    fault_point("turns.synced")  # interleaving tests: the archive sync committed, this step's reads not yet done
    context.log.info(
        f"archive sync: {len(report.new)} new, {len(report.changed)} changed, {len(report.gone)} gone, "
        f"{report.unchanged} unchanged files; {report.files_read} read, {report.users_rebuilt} users rebuilt"
    )
    fps = layout.read_table("fingerprints", users)
    _record_absent_users(layout, pipeline, users, fps)
    stats = {u: {"turns": 0, "quarantined": 0, "fingerprint": EMPTY_FINGERPRINT} for u in users}
    for row in (fps.iter_rows(named=True) if fps is not None else []):
        stats[row["user_id"]] = {"turns": row["n_turns"], "quarantined": row["n_quarantined"], "fingerprint": row["fingerprint"]}
    unattributed = layout.count_user_rows("quarantine", UNATTRIBUTED)  # a count: no bad row's text is read
    run_turns = sum(s["turns"] for s in stats.values())
    run_q = sum(s["quarantined"] for s in stats.values())
    by_field = _quarantined_by_field(layout, users) if run_q else {}
    context.log.info(
        f"{len(users)} users: {run_turns} turns, {run_q} quarantined for these users (by field: {by_field}), "
        f"{unattributed} unattributed bad rows; {report.quarantined_read} rows quarantined in the files this sync read"
    )
    schema_ok = checks.schema_conforms(_turns_schema(layout), dict(TURN_POLARS_SCHEMA), "turns")
    ceiling = checks.quarantine_under_ceiling(run_turns, run_q, pipeline.max_quarantine_fraction)
    if not ceiling.passed:  # what the operator looks at: the run users' bad rows by field, and where they are
        ceiling.metadata.update(quarantined_by_field=", ".join(
            f"{f} {n}" for f, n in sorted(by_field.items(), key=lambda kv: (-kv[1], kv[0]))),
            quarantine_table=layout.table_dir("quarantine"))
    # bucket scheme: what the planner compares with the archive (assets/partitions.py)
    record_materialized(context, pipeline, {u: recorded_form(s["fingerprint"]) for u, s in stats.items()})
    return dg.MaterializeResult(
        check_results=[
            check_result("schema_conforms", schema_ok),
            check_result("quarantine_under_ceiling", ceiling),
        ],
        metadata={
            "users": len(users),
            "dagster/row_count": run_turns,
            "quarantined": run_q,
            "quarantined_unattributed": unattributed,
            "quarantined_by_field": dg.MetadataValue.json(by_field),
            "archive_rows_quarantined_this_sync": report.quarantined_read,
            "archive_files_read": report.files_read,
            "archive_files_new_changed_gone": dg.MetadataValue.json(
                {"new": len(report.new), "changed": len(report.changed), "gone": len(report.gone)}),
            # every user of the run: the nightly schedule compares these with the archive (assets/schedules.py)
            "fingerprints": dg.MetadataValue.json({u: recorded_form(s["fingerprint"]) for u, s in stats.items()}),
            "seconds": round(time.perf_counter() - t0, 3),
            **version_metadata("turns"),
        }
    )


def _quarantined_by_field(layout, users: list[str]) -> dict[str, int]:
    """The run's users' quarantined rows by field: their buckets' files only, nothing in proportion
    to the archive (this used to read the whole quarantine table on every run)."""
    bad = layout.read_table("quarantine", users)
    return dict(sorted(bad.group_by("field").len().rows())) if bad is not None else {}


def _turns_schema(layout) -> pl.DataFrame:
    """The turns table's columns as stored, with no rows: the schema check needs no data (it
    used to read every turn of the run's users). The contract's own schema before any turn exists."""
    schema = layout.store.schema("turns")
    if schema is None:
        return pl.DataFrame(schema=TURN_POLARS_SCHEMA)
    return pl.DataFrame(schema={c: t for c, t in schema.items() if c not in STORE_COLUMNS})


def _record_absent_users(layout, pipeline: PipelineConfig, users: list[str], fps: pl.DataFrame | None) -> None:
    """A run user of whom the archive holds no rows and never did (the sync writes every user it
    touched, one whose files were all withdrawn included, as present and empty) is written present
    and empty too, so downstream assets write it empty instead of failing: in `turns`, "present,
    empty" means "nothing here", absent means "not materialized yet". Forgotten users stay absent."""
    have = set(fps["user_id"].to_list()) if fps is not None else set()
    absent = [u for u in users if u not in have]
    if not absent:
        return
    forgotten = pipeline.forgotten()
    absent = [u for u in absent if not forgotten.contains(u)]
    present = set(layout.users_present("turns", absent)) if absent else set()
    stray = [u for u in absent if u not in present]
    if stray:
        layout.replace_users("turns", stray, pl.DataFrame(schema=TURN_POLARS_SCHEMA))
