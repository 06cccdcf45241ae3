"""The turns stage for one run: bring the tables up to date with the archive (only new or changed files
are read, once, for every user they hold: `sync.py`), then report this run's users as the tables now hold
them (turns, quarantined rows, fingerprints) with the blocking checks on what was written.

`run_turns` is what the `turns` asset calls (assets/ingest.py): the archive sync commits its rows itself,
behind its own pre-commit checks, so the `StageRun` it returns has no `publish`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import polars as pl

from qumem_pipeline.contracts import checks
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.contracts.stage_run import StageRun
from qumem_pipeline.ingest.archive import EMPTY_FINGERPRINT
from qumem_pipeline.ingest.incremental import recorded_form
from qumem_pipeline.ingest.sync import sync_archive
from qumem_pipeline.ingest.validate import TURN_POLARS_SCHEMA
from qumem_pipeline.runtime.faults import fault_point
from qumem_pipeline.runtime.progress import ProgressLine
from qumem_pipeline.storage.table_store import STORE_COLUMNS


class BlockedByChecks(Exception):
    """A blocking check failed on rows the archive sync was about to commit."""


@dataclass
class TurnsRun(StageRun):
    """`fingerprints`: each run user's fingerprint in its recorded form (what the planner and the nightly
    schedule compare with the archive); None when blocking checks stopped the sync."""

    fingerprints: dict[str, str] | None = field(default=None)


def run_turns(layout, archive, users: list[str], *, forgotten: Callable, max_quarantine_fraction: float,
              log: Callable[[str], None], debug: Callable[[str], None],
              progress: ProgressLine) -> TurnsRun:
    """Sync the archive into the tables, then the run users' figures and checks (see the module doc).
    `forgotten()` reads the forget registry now (read before the sync and again after it)."""
    report, blocked = checked_sync(layout, archive, forgotten=forgotten, max_quarantine_fraction=max_quarantine_fraction,
                                   log=log, debug=debug, progress=progress)
    if blocked:
        return TurnsRun(blocked, None, {"users": len(users), "blocked_by": report})
    fault_point("turns.synced")  # interleaving tests: the archive sync committed, this step's reads not yet done
    return _report(layout, users, report, forgotten, max_quarantine_fraction, log)


def checked_sync(layout, archive, *, forgotten: Callable, max_quarantine_fraction: float,
                 log: Callable[[str], None], debug: Callable[[str], None], progress: ProgressLine):
    """`sync_archive` behind the turns stage's blocking checks, with progress lines: what the `turns`
    asset and the `archive_sync` job (assets/archive_sync.py) both run. Returns (SyncReport, {}) or,
    when a blocking check stopped a group's commit, (the failed checks' names, their outcomes)."""
    blocked: dict[str, checks.CheckOutcome] = {}

    def before_commit(turns_rows: pl.DataFrame, quarantine_rows: pl.DataFrame) -> None:
        """Blocking checks on the rows about to be written: a failure commits nothing of them."""
        outcomes = _checks(turns_rows, turns_rows.height, quarantine_rows.height, max_quarantine_fraction)
        if not all(o.passed for o in outcomes.values()):
            if quarantine_rows.height and "field" in quarantine_rows.columns:
                # what the operator fixes: the bad rows' fields, and each row's place in the archive (in the log)
                by_field = quarantine_rows.group_by("field").len().sort(["len", "field"], descending=[True, False])
                outcomes["quarantine_under_ceiling"].metadata["quarantined_by_field"] = ", ".join(
                    f"{f} {n}" for f, n in by_field.rows())
                for r in quarantine_rows.head(50).iter_rows(named=True):
                    debug(f"quarantined: {r.get('source_file')} row {r.get('source_row')}: "
                          f"{r.get('field')}: {r.get('reason')}")
            blocked.update(outcomes)
            raise BlockedByChecks(", ".join(n for n, o in outcomes.items() if not o.passed))

    def sync_progress(stage: str, done: int, total: int) -> None:
        if progress.label != stage:
            progress.stage(stage, total)
        progress(done, total)

    try:
        with progress:
            report = sync_archive(archive, layout, forgotten=forgotten(), before_commit=before_commit,
                                  progress=sync_progress)
    except BlockedByChecks as exc:
        log(f"blocking checks failed ({exc}): nothing of those users written, the previous version "
            "stays; the files stay pending, so the next run redoes them")
        return str(exc), blocked
    log(f"archive sync: {len(report.new)} new, {len(report.changed)} changed, {len(report.gone)} gone, "
        f"{report.unchanged} unchanged files; {report.files_read} read, {report.users_rebuilt} users rebuilt")
    return report, {}


def _checks(turns_schema: pl.DataFrame, n_turns: int, n_quarantined: int, ceiling: float) -> dict:
    return {"schema_conforms": checks.schema_conforms(turns_schema, dict(TURN_POLARS_SCHEMA), "turns"),
            "quarantine_under_ceiling": checks.quarantine_under_ceiling(n_turns, n_quarantined, ceiling)}


def _report(layout, users: list[str], report, forgotten, max_quarantine_fraction: float, log) -> TurnsRun:
    """The run users' turns, quarantined rows and fingerprints as the tables hold them after the sync."""
    fps = layout.read_table("fingerprints", users)
    record_absent_users(layout, forgotten(), users, fps)
    stats = {u: {"turns": 0, "quarantined": 0, "fingerprint": EMPTY_FINGERPRINT} for u in users}
    for row in (fps.iter_rows(named=True) if fps is not None else []):
        stats[row["user_id"]] = {"turns": row["n_turns"], "quarantined": row["n_quarantined"], "fingerprint": row["fingerprint"]}
    unattributed = layout.count_user_rows("quarantine", UNATTRIBUTED)  # a count: no bad row's text is read
    run_turns_n = sum(s["turns"] for s in stats.values())
    run_q = sum(s["quarantined"] for s in stats.values())
    by_field = quarantined_by_field(layout, users) if run_q else {}
    log(f"{len(users)} users: {run_turns_n} turns, {run_q} quarantined for these users (by field: {by_field}), "
        f"{unattributed} unattributed bad rows; {report.quarantined_read} rows quarantined in the files this sync read")
    outcomes = _checks(turns_schema(layout), run_turns_n, run_q, max_quarantine_fraction)
    if not outcomes["quarantine_under_ceiling"].passed:  # what the operator looks at: bad rows by field, and where
        outcomes["quarantine_under_ceiling"].metadata.update(quarantined_by_field=", ".join(
            f"{f} {n}" for f, n in sorted(by_field.items(), key=lambda kv: (-kv[1], kv[0]))),
            quarantine_table=layout.table_dir("quarantine"))
    fingerprints = {u: recorded_form(s["fingerprint"]) for u, s in stats.items()}
    return TurnsRun(outcomes, None, {
        "users": len(users),
        "dagster/row_count": run_turns_n,
        "quarantined": run_q,
        "quarantined_unattributed": unattributed,
        "quarantined_by_field": by_field,
        "archive_rows_quarantined_this_sync": report.quarantined_read,
        "archive_files_read": report.files_read,
        "archive_files_new_changed_gone": {"new": len(report.new), "changed": len(report.changed), "gone": len(report.gone)},
        # every user of the run: the nightly schedule compares these with the archive (assets/schedules.py)
        "fingerprints": fingerprints,
    }, fingerprints)


def quarantined_by_field(layout, users: list[str]) -> dict[str, int]:
    """The run's users' quarantined rows by field: their buckets' files only, nothing in proportion
    to the archive (this used to read the whole quarantine table on every run)."""
    bad = layout.read_table("quarantine", users)
    return dict(sorted(bad.group_by("field").len().rows())) if bad is not None else {}


def turns_schema(layout) -> pl.DataFrame:
    """The turns table's columns as stored, with no rows: the schema check needs no data (it
    used to read every turn of the run's users). The contract's own schema before any turn exists."""
    schema = layout.store.schema("turns")
    if schema is None:
        return pl.DataFrame(schema=TURN_POLARS_SCHEMA)
    return pl.DataFrame(schema={c: t for c, t in schema.items() if c not in STORE_COLUMNS})


def record_absent_users(layout, forgotten, users: list[str], fps: pl.DataFrame | None) -> None:
    """A run user of whom the archive holds no rows and never did (the sync writes every user it
    touched, one whose files were all withdrawn included, as present and empty) is written present
    and empty too, so downstream assets write it empty instead of failing: in `turns`, "present,
    empty" means "nothing here", absent means "not materialized yet". Forgotten users stay absent."""
    have = set(fps["user_id"].to_list()) if fps is not None else set()
    absent = [u for u in users if u not in have and not forgotten.contains(u)]
    present = set(layout.users_present("turns", absent)) if absent else set()
    stray = [u for u in absent if u not in present]
    if stray:
        layout.replace_users("turns", stray, pl.DataFrame(schema=TURN_POLARS_SCHEMA))

