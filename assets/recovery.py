"""Recover from runs whose process died (kill -9, OOM kill, power loss) before a new run starts.

Such a run stays STARTED in the instance and keeps the pool slots its steps claimed (`gpu`,
`warehouse`, limit 1), so the next run's steps wait for those slots forever. Under `dagster dev`
the daemon's run monitoring fails the run and frees its slots (`dagster.yaml`); `qumem run` has no
daemon, so it calls `fail_dead_runs` first: a STARTED run whose process (the pid in its RUN_START
event) no longer exists on this machine is reported failed and its slots are freed, and slots still
held by runs that already ended are freed too. A live run is never touched.
"""

import os

import dagster as dg
from dagster._core.events import DagsterEventType

ACTIVE = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _run_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.RUN_START):
        if entry.dagster_event is not None and entry.dagster_event.pid is not None:
            return int(entry.dagster_event.pid)
    return None


def fail_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Fail active runs whose process is gone and free every slot no live run holds; returns their ids."""
    failed = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE)):
        pid = _run_pid(instance, run.run_id)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        instance.report_run_failed(run, message=f"run process {pid} no longer exists (killed); marked failed so "
                                   "its pool slots are released")
        failed.append(run.run_id)
    storage = instance.event_log_storage
    if storage.supports_global_concurrency_limits:
        live = {r.run_id for r in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE))}
        for run_id in storage.get_concurrency_run_ids() - live:
            storage.free_concurrency_slots_for_run(run_id)
    return failed
