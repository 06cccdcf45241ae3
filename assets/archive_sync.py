"""The archive sync as a Dagster run of its own (`archive_sync` job), never inside a tick.

`sync_archive` (qumem_pipeline/ingest/sync.py) reads every new or changed archive file into the
tables: minutes at millions of turns. A schedule or sensor tick must return within Dagster's
evaluation timeout (DAGSTER_SCHEDULE_GRPC_TIMEOUT_SECONDS / DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS,
60 s by default), and a tick that times out requests nothing, so the ticks only *plan*: they read
the fingerprints table as the last sync left it (`discover(..., sync=False)`). The sync runs here,
as a run: its progress (files read, users rebuilt: done/total, rate, ETA) in the run's log every
few seconds, its figures in the op's metadata, behind the same blocking checks as `turns`
(`qumem_pipeline/ingest/stage.checked_sync`: a failed check commits nothing of that group and the
run fails in one line).

Who requests it:
* the discovery sensor (assets/sensors.py), at any tick where the archive's listing is ahead of
  the ingest manifest (`look_at_archive`: a stat per file and the manifest, no file opened) and no
  sync run is in flight; its next ticks see the fingerprints table change and plan the rebuilds;
* `archive_sync_schedule`, the nightly schedule's companion (QUMEM_ARCHIVE_SYNC_CRON, 01:00 UTC by
  default, an hour before the nightly 02:00). A schedule targets one job and its tick cannot wait
  for a run, so the sync is its own schedule ahead of the nightly one rather than a request the
  nightly tick makes (the nightly would then plan from the table before the sync it requested ran,
  a day late every day). What the sync has not committed by the nightly tick (a sync still
  running, or a file that arrived after it) is planned the next night, or by the sensor's next
  tick when the sensor is on; the nightly tick logs the last sync run's status so a failed or late
  sync is visible where the nightly is.

Run keys name the archive's listing state and how many sync runs already finished on it, so one
state gets one run, a failed run is retried at the next tick (at most `SYNC_ATTEMPTS` failures per
state, then the sensor says so and waits for the archive to change or an operator's re-execution),
and a state still behind after a successful sync gets a new run.
"""

import os
import time

import dagster as dg

from assets.progress import ProgressLogger
from qumem_pipeline.ingest.stage import checked_sync
from resources import PipelineConfig

ARCHIVE_SYNC_JOB = "archive_sync"
SYNC_CRON = os.environ.get("QUMEM_ARCHIVE_SYNC_CRON") or "0 1 * * *"
LISTING_TAG = "qumem/archive_listing"  # the listing state a requested sync was planned on
SYNC_ATTEMPTS = 3  # failed sync runs on one listing state before the sensor stops requesting it
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
_FAILED = [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]


@dg.op(description="Read the archive's new and changed files into the tables (sync_archive), with progress.")
def archive_sync_op(context: dg.OpExecutionContext, pipeline: PipelineConfig) -> dg.Output:
    t0 = time.perf_counter()
    report, blocked = checked_sync(pipeline.layout(), pipeline.archive(), forgotten=pipeline.forgotten,
                                   max_quarantine_fraction=pipeline.max_quarantine_fraction,
                                   log=context.log.info, debug=context.log.debug,
                                   progress=ProgressLogger(context.log, "archive sync"))
    if blocked:
        failed = {n: o for n, o in blocked.items() if not o.passed}
        raise dg.Failure(
            description=f"archive sync stopped by blocking checks ({report}): nothing of those users was "
                        "written, the files stay pending and the next sync redoes them",
            metadata={n: dg.MetadataValue.text(str(dict(o.metadata))) for n, o in failed.items()})
    seconds = time.perf_counter() - t0
    to_read = len(report.new) + len(report.changed)
    metadata = {
        "files_read": f"{report.files_read}/{to_read}",
        "files_new": len(report.new), "files_changed": len(report.changed), "files_gone": len(report.gone),
        "files_unchanged": report.unchanged,
        "users_rebuilt": report.users_rebuilt,
        "rows_read": report.rows_read,
        "rows_per_s": round(report.rows_read / seconds, 1) if seconds > 0 else None,
        "rows_quarantined": report.quarantined_read,
        "spilled_bytes": report.spilled_bytes,
        "seconds": round(seconds, 3),
        "stages_s": dg.MetadataValue.json(dict(report.stages_s)),
    }
    context.log.info(f"archive sync done in {seconds:.1f}s: {report.files_read}/{to_read} files read, "
                     f"{report.users_rebuilt} users rebuilt, {report.rows_read} rows")
    return dg.Output(None, metadata=metadata)


@dg.job(name=ARCHIVE_SYNC_JOB,
        description="Bring the tables up to date with the archive (new and changed files only); the ticks only plan.")
def archive_sync_job():
    archive_sync_op()


def sync_request(instance: dg.DagsterInstance, pipeline: PipelineConfig,
                 key_prefix: str = "archive_sync") -> tuple[dg.RunRequest | None, str]:
    """(a request for an `archive_sync` run, or None; why) for a tick: None while a sync run is in
    flight, when the archive's listing is in step with the manifest, or after `SYNC_ATTEMPTS` failed
    syncs on this listing. Opens no archive file (`look_at_archive`)."""
    from qumem_pipeline.ingest.sync import look_at_archive

    running = instance.get_runs(filters=dg.RunsFilter(job_name=ARCHIVE_SYNC_JOB, statuses=IN_FLIGHT), limit=1)
    if running:
        return None, f"archive sync run {running[0].run_id} in flight"
    look = look_at_archive(pipeline.archive(), pipeline.layout(), pipeline.forgotten())
    if not look.behind:
        return None, f"archive in step with the tables ({look.files} files)"
    state = look.state[:32]
    done = instance.get_runs(filters=dg.RunsFilter(job_name=ARCHIVE_SYNC_JOB, tags={LISTING_TAG: state}))
    failed = [r for r in done if r.status in _FAILED]
    if len(failed) >= SYNC_ATTEMPTS:
        return None, (f"archive sync failed {len(failed)} times on this archive state (last run "
                      f"{failed[0].run_id}): fix what it names and re-execute it, or change the archive")
    behind = f"{look.new} new, {look.changed} changed, {look.gone} gone of {look.files} files"
    return dg.RunRequest(run_key=f"{key_prefix}:{state}:{len(done)}", job_name=ARCHIVE_SYNC_JOB,
                         tags={LISTING_TAG: state, "qumem/archive_behind": behind}), behind


def last_sync(instance: dg.DagsterInstance) -> str:
    """One line on the latest `archive_sync` run, for the nightly tick's log."""
    runs = instance.get_run_records(filters=dg.RunsFilter(job_name=ARCHIVE_SYNC_JOB), limit=1)
    if not runs:
        return "no archive_sync run yet: the plan is the fingerprints table as `qumem ingest`/`turns` runs left it"
    rec = runs[0]
    when = rec.end_time or rec.start_time or rec.create_timestamp.timestamp()
    age = f"{(time.time() - when) / 3600:.1f} h ago" if when else "at an unknown time"
    return f"last archive_sync run {rec.dagster_run.run_id}: {rec.dagster_run.status.value}, {age}"


def build_archive_sync_schedule(cron: str = SYNC_CRON, name: str = "archive_sync_schedule") -> dg.ScheduleDefinition:
    """The nightly schedule's companion (module doc): requests an `archive_sync` run when the archive's
    listing is ahead of the tables and no sync is in flight; off by default, like the nightly."""

    @dg.schedule(name=name, cron_schedule=cron, execution_timezone="UTC", job=archive_sync_job,
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="Sync the archive into the tables ahead of the nightly rebuild (the ticks only plan).")
    def _sync(context: dg.ScheduleEvaluationContext, pipeline: PipelineConfig):
        tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "manual"
        request, why = sync_request(context.instance, pipeline, key_prefix=f"archive_sync_schedule:{tick}")
        context.log.info(f"archive sync check: {why}")
        return request if request is not None else dg.SkipReason(why)

    return _sync


archive_sync_schedule = build_archive_sync_schedule()
