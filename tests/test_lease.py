"""The data root's cross-host lease (storage/lease.py) on real Delta tables: exactly one of many
racing processes holds it at a time (hosts simulated by distinct holder names, so no file lock
helps), an expired or dead holder is taken over, a holder that lost it is stopped before its next
write, and the ingest sync holds it."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from qumem_pipeline.storage.lease import Lease, LeaseHeldError, LeaseLostError, held
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

_WORKER = r'''
import sys, time
from qumem_pipeline.storage.lease import Lease
root, name, log = sys.argv[1], sys.argv[2], sys.argv[3]
lease = Lease(root, "ingest", ttl_s=30, holder=f"host-{name}:1:x")
lease.acquire(wait_s=120, poll_s=0.05)
with open(log, "a") as f:
    f.write(f"start {name} {time.time()}\n")
time.sleep(0.3)
with open(log, "a") as f:
    f.write(f"end {name} {time.time()}\n")
lease.release()
'''


def test_racing_hosts_hold_the_lease_one_at_a_time(tmp_path):
    log = tmp_path / "log.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / "data"), f"h{i}", str(log)], env=env)
             for i in range(4)]
    assert [p.wait(timeout=240) for p in procs] == [0] * 4
    events = [line.split() for line in log.read_text().splitlines()]
    assert len(events) == 8
    # the critical sections never overlap: every start is followed by the same holder's end
    for (a, b) in zip(events[::2], events[1::2]):
        assert a[0] == "start" and b[0] == "end" and a[1] == b[1]
    assert sorted(e[1] for e in events[::2]) == ["h0", "h1", "h2", "h3"]


def test_a_held_lease_blocks_then_expires(tmp_path):
    a = Lease(tmp_path, "ingest", ttl_s=2, holder="host-a:1:x")
    a.acquire()
    a._stop.set()  # a host that stops renewing (killed)
    b = Lease(tmp_path, "ingest", ttl_s=2, holder="host-b:1:x")
    with pytest.raises(LeaseHeldError, match="held by host-a"):
        b.acquire(wait_s=0.2, poll_s=0.05)
    t = time.monotonic()
    b.acquire(wait_s=10, poll_s=0.1)  # taken over once a's lease expired
    assert time.monotonic() - t < 5 and b.state()[1]["holder"] == "host-b:1:x"
    # a, back, has lost it: its next write is refused, and its renewal says so
    with pytest.raises(LeaseLostError):
        a.renew()
    with pytest.raises(LeaseLostError):
        a.check()
    b.release()
    assert b.state()[1]["action"] == "release"


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(p.stdout)
    import socket

    dead = Lease(tmp_path, "ingest", ttl_s=600, holder=f"{socket.gethostname()}:{dead_pid}:x")
    dead.acquire()
    dead._stop.set()
    t = time.monotonic()
    with held(str(tmp_path), "ingest", ttl_s=600) as mine:
        assert mine.state()[1]["holder"] == mine.holder
    assert time.monotonic() - t < 5


def test_renewal_keeps_the_lease_past_its_ttl(tmp_path):
    with held(str(tmp_path), "ingest", ttl_s=1.5) as lease:
        time.sleep(2.5)  # longer than one ttl: the renewer extended it
        lease.check()
        seq, row = lease.state()
        assert row["holder"] == lease.holder and row["action"] == "renew" and seq >= 3
        other = Lease(tmp_path, "ingest", ttl_s=1.5, holder="host-z:1:x")
        with pytest.raises(LeaseHeldError):
            other.acquire(wait_s=0.5, poll_s=0.1)
    assert lease.ttl == timedelta(seconds=1.5)


def test_the_ingest_sync_holds_the_roots_lease(tmp_path, monkeypatch):
    from qumem_pipeline.ingest.archive import ArchiveConfig
    from qumem_pipeline.ingest.sync import sync_archive
    from qumem_pipeline.storage.layout import DataLayout
    from tests.conftest import conversation, write_jsonl

    archive = tmp_path / "archive"
    archive.mkdir()
    write_jsonl(archive / "a.jsonl", conversation("u1", "c1", ["hi", "hello", "how are you", "fine"]))
    # another host holds the lease: the sync waits for it, and gives up after its wait
    other = Lease(tmp_path / "data", "ingest", ttl_s=600, holder="host-other:1:x")
    other.acquire()
    other._stop.set()
    import qumem_pipeline.storage.lease as lease_mod

    real = lease_mod.Lease.acquire
    monkeypatch.setattr(lease_mod.Lease, "acquire", lambda self, wait_s=3600.0, poll_s=1.0: real(self, 0.3, 0.05))
    with pytest.raises(LeaseHeldError):
        sync_archive(ArchiveConfig(str(archive)), DataLayout(tmp_path / "data"))
    assert not (tmp_path / "data" / "turns").exists()  # nothing written
    other.release()
    monkeypatch.undo()
    r = sync_archive(ArchiveConfig(str(archive)), DataLayout(tmp_path / "data"))
    assert r.rows_read == 4 and Lease(tmp_path / "data", "ingest").state()[1]["action"] == "release"


def test_a_holder_whose_renewals_stall_stops_writing_at_its_ttl(tmp_path, monkeypatch):
    lease = Lease(tmp_path, "ingest", ttl_s=1.0, holder="host-s:1:x")
    lease.acquire()
    lease._stop.set()  # the renewer is stuck (as on an unreachable store): no renewal lands
    lease.check()  # within the ttl: fine
    time.sleep(1.2)
    with pytest.raises(LeaseLostError, match="not renewed within its ttl"):
        lease.check()
