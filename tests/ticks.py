"""The archive sync as the real Dagster run the ticks request (assets/archive_sync.py), for the tests
that drive the nightly schedule and the discovery sensor: ticks only plan from the fingerprints
table, so a test runs the sync first, as the daemon would launch it."""

import dagster as dg

SYNC_JOB = "archive_sync"


def sync_requests(result) -> list[dg.RunRequest]:
    return [r for r in (getattr(result, "run_requests", None) or []) if r.job_name == SYNC_JOB]


def rebuild_requests(result) -> list[dg.RunRequest]:
    """A tick's requests other than the archive sync: the rebuild runs."""
    return [r for r in (getattr(result, "run_requests", None) or []) if r.job_name != SYNC_JOB]


def run_archive_sync(instance: dg.DagsterInstance, pipeline, request: dg.RunRequest | None = None):
    """Execute the `archive_sync` job in process on `instance` (with a tick's request's tags, when
    given); returns the successful result."""
    from assets.archive_sync import archive_sync_job

    defs = dg.Definitions(jobs=[archive_sync_job], resources={"pipeline": pipeline})
    result = defs.resolve_job_def(SYNC_JOB).execute_in_process(
        instance=instance, tags=dict(request.tags) if request is not None else None)
    assert result.success
    return result
