"""Recover from runs whose process died (kill -9, OOM kill, power loss) before a new run starts,
without touching any other host's runs on a shared instance.

Such a run stays STARTED in the instance and keeps the pool slots its steps claimed (`gpu`,
`warehouse`, limit 1), so the next run's steps wait for those slots forever. Under `dagster dev`
or a deployed daemon, run monitoring fails such runs and frees their slots (`dagster.yaml`);
`qumem run` may have no daemon, so it calls `fail_dead_runs` first.

On a shared (PostgreSQL) instance, "pid not alive here" proves nothing about a run launched by
another host. So every run `qumem` launches carries its launcher's identity as run tags
(`launch_tags`): host (hostname + machine id), boot id, pid and the process start time. A run is
failed only when this host launched it and its process is provably gone: the host has rebooted
since (boot id differs), the pid no longer exists, or the pid exists but belongs to a process that
started at another time (pid reuse). Runs without these tags (launched by a daemon, another tool,
an older qumem) and runs of other hosts are left to Dagster's run monitoring.
"""

import os
import socket
from pathlib import Path

import dagster as dg
import psutil

ACTIVE = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]

HOST_TAG = "qumem/launcher_host"
BOOT_TAG = "qumem/launcher_boot_id"
PID_TAG = "qumem/launcher_pid"
START_TAG = "qumem/launcher_start_time"
HOST_ID_ENV = "QUMEM_HOST_ID"  # overrides the host identity (tests; hosts sharing one machine id)
# psutil's create_time is a float of seconds; round so the tag compares equal across reads.
_START_DIGITS = 2


def _read_id(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def host_identity() -> str:
    """Who launched a run: hostname + machine id (stable across reboots and container restarts
    that keep /etc/machine-id); `QUMEM_HOST_ID` overrides it."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    machine = _read_id("/etc/machine-id") or _read_id("/var/lib/dbus/machine-id")
    return f"{socket.gethostname()}/{machine}" if machine else socket.gethostname()


def boot_id() -> str:
    return _read_id("/proc/sys/kernel/random/boot_id") or f"boot@{round(psutil.boot_time())}"


def _start_time(pid: int) -> str | None:
    try:
        return f"{psutil.Process(pid).create_time():.{_START_DIGITS}f}"
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # exists, owned by someone else: start time unknown
        return ""


def launch_tags(pid: int | None = None) -> dict[str, str]:
    """Run tags naming the process that executes the run (in-process runs: this process)."""
    pid = os.getpid() if pid is None else pid
    return {HOST_TAG: host_identity(), BOOT_TAG: boot_id(), PID_TAG: str(pid), START_TAG: _start_time(pid) or ""}


def gone_reason(tags: dict[str, str]) -> str | None:
    """Why the run's process is provably gone, or None (alive, another host's, or not ours to judge)."""
    if tags.get(HOST_TAG) != host_identity() or not tags.get(PID_TAG, "").isdigit():
        return None
    pid = int(tags[PID_TAG])
    if tags.get(BOOT_TAG) and tags[BOOT_TAG] != boot_id():
        return f"host rebooted since process {pid} launched it"
    if pid == os.getpid():
        return None
    start = _start_time(pid)
    if start is None:
        return f"run process {pid} no longer exists (killed)"
    if start and tags.get(START_TAG) and start != tags[START_TAG]:
        return f"pid {pid} now belongs to another process (started {start}, run's started {tags[START_TAG]})"
    return None


def fail_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Fail this host's active runs whose process is provably gone and free the slots of runs that
    are no longer active; returns the failed run ids. Never touches another host's run."""
    failed = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE, tags={HOST_TAG: host_identity()})):
        reason = gone_reason(run.tags)
        if reason is None:
            continue
        instance.report_run_failed(run, message=f"{reason}; marked failed so its pool slots are released")
        failed.append(run.run_id)
    storage = instance.event_log_storage
    if storage.supports_global_concurrency_limits:
        # Slots of runs that have ended (any host): an ended run never needs them again.
        # Holders are read before the active runs, so a run that claims a slot in between is not freed.
        holders = storage.get_concurrency_run_ids()
        live = {r.run_id for r in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE))}
        for run_id in holders - live:
            storage.free_concurrency_slots_for_run(run_id)
    return failed
