"""Recovery on a shared instance: two "hosts" (launcher processes with different QUMEM_HOST_ID)
run real Dagster runs against one instance; neither host's recovery fails the other's live run,
and a host fails its own run only once that run's process is provably gone.

The instance is the repository's SQLite dagster.yaml (always) and deploy/postgres/dagster.yaml
against a real PostgreSQL (skips without DAGSTER_PG_HOST; `eval "$(bash scripts/install_system_deps.sh)"`).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from assets.recovery import BOOT_TAG, HOST_TAG, PID_TAG, START_TAG, fail_dead_runs, gone_reason, launch_tags
from qumem_pipeline.runtime.instance_config import install_instance_config
from tests.conftest import REPO_ROOT
from tests.test_postgres_instance import scratch_database  # noqa: F401  (fixture)

# One process = one run of a job whose op holds pool `pool` until `release` exists.
LAUNCHER = r"""
import sys, time
from pathlib import Path
import dagster as dg
from assets.recovery import launch_tags

release, pool = Path(sys.argv[1]), sys.argv[2] or None

@dg.op(pool=pool)
def hold(context):
    Path(str(release) + ".started").write_text(context.run_id)
    while not release.exists():
        time.sleep(0.05)

@dg.job
def hold_job():
    hold()

with dg.DagsterInstance.get() as instance:
    assert hold_job.execute_in_process(instance=instance, tags=launch_tags()).success
"""


def _home(tmp_path: Path, backend: str, request) -> Path:
    home = tmp_path / f"home-{backend}"
    home.mkdir()
    if backend == "postgres":
        if not os.environ.get("DAGSTER_PG_HOST"):
            pytest.skip("DAGSTER_PG_HOST is not set (eval \"$(bash scripts/install_system_deps.sh)\")")
        request.getfixturevalue("scratch_database")
        install_instance_config(home / "dagster.yaml", source=REPO_ROOT / "deploy" / "postgres" / "dagster.yaml")
    else:
        install_instance_config(home / "dagster.yaml")
    return home


class Launcher:
    """A run on `host`: a real process executing a real Dagster run, blocked until released."""

    def __init__(self, home: Path, host: str, name: str, pool: str = ""):
        self.release = home.parent / f"release-{name}"
        env = dict(os.environ, DAGSTER_HOME=str(home), QUMEM_HOST_ID=host, PYTHONPATH=str(REPO_ROOT))
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(self.release), pool], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started = Path(f"{self.release}.started")
        deadline = time.monotonic() + 120
        while not started.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"launcher on {host} never started its run:\n{self.proc.communicate()[0][-3000:]}")
            time.sleep(0.1)
        self.run_id = started.read_text()

    def finish(self) -> None:
        self.release.write_text("go")
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, out[-3000:]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _recover_as(host: str, home: Path, monkeypatch) -> list[str]:
    monkeypatch.setenv("QUMEM_HOST_ID", host)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return fail_dead_runs(instance)


def _status(home: Path, run_id: str) -> dg.DagsterRunStatus:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return instance.get_run_by_id(run_id).status


def _slot_holders(home: Path) -> set[str]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return set(instance.event_log_storage.get_concurrency_run_ids())


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_hosts_never_fail_each_others_live_runs(tmp_path, backend, request, monkeypatch):
    home = _home(tmp_path, backend, request)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    a = Launcher(home, "host-a", "a", pool="warehouse")  # holds the warehouse writer's slot
    b = Launcher(home, "host-b", "b")
    try:
        assert _status(home, a.run_id) == _status(home, b.run_id) == dg.DagsterRunStatus.STARTED
        assert a.run_id in _slot_holders(home)
        # Both hosts recover while both runs live: nothing is failed, no slot is freed.
        assert _recover_as("host-b", home, monkeypatch) == []
        assert _recover_as("host-a", home, monkeypatch) == []
        assert _status(home, a.run_id) == _status(home, b.run_id) == dg.DagsterRunStatus.STARTED
        assert a.run_id in _slot_holders(home)

        a.kill()  # host a's run process dies without a trace in the instance
        # Host b cannot prove anything about host a's process: the run and its slot are left alone.
        assert _recover_as("host-b", home, monkeypatch) == []
        assert _status(home, a.run_id) == dg.DagsterRunStatus.STARTED and a.run_id in _slot_holders(home)
        # Host a can: its pid is gone. Its run is failed, its slot freed; host b's run is untouched.
        assert _recover_as("host-a", home, monkeypatch) == [a.run_id]
        assert _status(home, a.run_id) == dg.DagsterRunStatus.FAILURE
        assert a.run_id not in _slot_holders(home)
        assert _status(home, b.run_id) == dg.DagsterRunStatus.STARTED
    finally:
        for launcher in (a, b):
            if launcher.proc.poll() is None:
                launcher.finish()
    assert _status(home, b.run_id) == dg.DagsterRunStatus.SUCCESS


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_pid_reuse_and_reboot_are_provably_gone_untagged_runs_are_left(tmp_path, backend, request, monkeypatch):
    home = _home(tmp_path, backend, request)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("QUMEM_HOST_ID", "host-a")
    mine = launch_tags()
    live_other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            def started(tags):
                return create_run_for_test(instance, job_name="some_job", status=dg.DagsterRunStatus.STARTED, tags=tags).run_id
            reused = started({**launch_tags(live_other.pid), START_TAG: "12345.00"})  # pid alive, other start time
            rebooted = started({**mine, BOOT_TAG: "another-boot"})
            alive = started(launch_tags(live_other.pid))  # the same process, still running
            other_host = started({**mine, HOST_TAG: "host-b", PID_TAG: "999999999"})
            untagged = started({})  # daemon-launched: run monitoring's business
            assert gone_reason(instance.get_run_by_id(reused).tags).startswith(f"pid {live_other.pid} now belongs")
            assert sorted(fail_dead_runs(instance)) == sorted([reused, rebooted])
            status = {r: instance.get_run_by_id(r).status for r in (reused, rebooted, alive, other_host, untagged)}
        assert status == {reused: dg.DagsterRunStatus.FAILURE, rebooted: dg.DagsterRunStatus.FAILURE,
                          alive: dg.DagsterRunStatus.STARTED, other_host: dg.DagsterRunStatus.STARTED,
                          untagged: dg.DagsterRunStatus.STARTED}
    finally:
        live_other.kill()
        live_other.wait()


def test_launch_tags_name_this_process():
    import psutil

    tags = launch_tags()
    assert tags[PID_TAG] == str(os.getpid())
    assert abs(float(tags[START_TAG]) - psutil.Process().create_time()) < 0.01
    assert tags[HOST_TAG] and tags[BOOT_TAG]
    assert gone_reason(tags) is None  # this very process is alive
