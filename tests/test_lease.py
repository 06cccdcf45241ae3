"""The data root's cross-host lease (storage/lease.py) on real Delta tables: exactly one of many
racing processes holds it at a time (hosts simulated by distinct holder names, so no file lock
helps), an expired or dead holder is taken over, a holder that lost it is stopped before its next
write, and the ingest sync holds it. Fencing: a holder that lost the lease (stopped renewing, or
paused with SIGSTOP past its ttl) commits nothing after the takeover, on local disk and on S3;
the lease table stays small; a pid is only judged in its own pid namespace."""

import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import polars as pl
import pytest

from qumem_pipeline.storage.lease import Lease, LeaseHeldError, LeaseLostError, held, holder_id
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
    dead = Lease(tmp_path, "ingest", ttl_s=600, holder=holder_id(pid=dead_pid))
    dead.acquire()
    dead._stop.set()
    t = time.monotonic()
    with held(str(tmp_path), "ingest", ttl_s=600) as mine:
        assert mine.state()[1]["holder"] == mine.holder
    assert time.monotonic() - t < 5


def test_renewal_keeps_the_lease_past_its_ttl(tmp_path):
    with held(str(tmp_path), "ingest", ttl_s=1.5) as lease:
        _, first = lease.state()
        time.sleep(2.5)  # longer than one ttl: the renewer extended it
        lease.check()
        seq, row = lease.state()
        assert row["holder"] == lease.holder and row["action"] == "renew" and seq >= 3
        # the first expiry has passed, yet the lease holds: a renewal moved its expiry, by one ttl from the renewal
        assert first["expires_at"] < datetime.now(timezone.utc) and row["expires_at"] > first["expires_at"]
        assert row["expires_at"] - row["written_at"] == timedelta(seconds=1.5)
        other = Lease(tmp_path, "ingest", ttl_s=1.5, holder="host-z:1:x")
        with pytest.raises(LeaseHeldError):
            other.acquire(wait_s=0.5, poll_s=0.1)


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
    layout = DataLayout(tmp_path / "data")
    r = sync_archive(ArchiveConfig(str(archive)), layout)
    assert r.rows_read == 4 and Lease(tmp_path / "data", "ingest").state()[1]["action"] == "release"
    # the sync's commits were fenced by its hold (acquire version 3: other's acquire and release
    # came first), and the fence is off the store after it
    from deltalake import DeltaTable

    assert layout.store.fence is None
    tables = layout.store.tables()
    assert "turns" in tables
    assert {DeltaTable(layout.store.uri(t)).transaction_version("qumem-fence-ingest") for t in tables} == {3}
    # the next sync's takeover puts its own, larger token on every table, whether it writes or not
    sync_archive(ArchiveConfig(str(archive)), layout)
    assert {DeltaTable(layout.store.uri(t)).transaction_version("qumem-fence-ingest") for t in tables} == {5}


def test_the_ingest_fences_only_its_own_tables_and_refuses_a_commit_outside_them(tmp_path):
    """The stages' tables beside the ingest's get no takeover commit from a sync (each costs a table load
    and a commit), and a holder fenced for some tables cannot commit to another one unfenced."""
    from deltalake import DeltaTable

    from qumem_pipeline.ingest.archive import ArchiveConfig
    from qumem_pipeline.ingest.sync import INGEST_TABLES, sync_archive
    from qumem_pipeline.storage.lease import fenced
    from qumem_pipeline.storage.layout import DataLayout
    from qumem_pipeline.storage.table_store import FenceScopeError
    from tests.conftest import conversation, write_jsonl

    archive = tmp_path / "archive"
    archive.mkdir()
    write_jsonl(archive / "a.jsonl", conversation("u1", "c1", ["hi", "hello", "how are you", "fine"]))
    layout = DataLayout(tmp_path / "data")
    layout.store.append("memories", _row("stage", 0))  # a stage's table in the same root
    before = DeltaTable(layout.store.uri("memories")).version()
    sync_archive(ArchiveConfig(str(archive)), layout)
    sync_archive(ArchiveConfig(str(archive)), layout)  # the second takes over from the first: fences again
    assert DeltaTable(layout.store.uri("memories")).version() == before  # no commit from either sync
    assert DeltaTable(layout.store.uri("memories")).transaction_version(FENCE_APP) is None
    written = [t for t in layout.store.tables() if t != "memories"]
    assert written and set(written) <= set(INGEST_TABLES)
    tokens = {DeltaTable(layout.store.uri(t)).transaction_version(FENCE_APP) for t in written}
    assert len(tokens) == 1 and None not in tokens  # every ingest table carries the last sync's token

    lease = Lease(tmp_path / "data", "ingest", ttl_s=600, holder="host-c:1:x")
    lease.acquire()
    try:
        with fenced(lease, layout.store, tables=INGEST_TABLES):
            with pytest.raises(FenceScopeError, match="memories"):
                layout.store.append("memories", _row("stage", 1))
            layout.store.append("turns", _row("ingest", 1))  # inside the scope: commits, with the token
        assert layout.store.fence is None and layout.store.fence_scope is None
        layout.store.append("memories", _row("stage", 2))  # the fence is off: any table again
    finally:
        lease.release()
    assert sorted(layout.store.read("memories")["i"].to_list()) == [0, 2]


def test_a_holder_whose_renewals_stall_stops_writing_at_its_ttl(tmp_path, monkeypatch):
    lease = Lease(tmp_path, "ingest", ttl_s=1.0, holder="host-s:1:x")
    lease.acquire()
    lease._stop.set()  # the renewer is stuck (as on an unreachable store): no renewal lands
    lease.check()  # within the ttl: fine
    time.sleep(1.2)
    with pytest.raises(LeaseLostError, match="not renewed within its ttl"):
        lease.check()


# ------------------------------------------------------------------ fencing
FENCE_APP = "qumem-fence-ingest"


def _row(writer: str, i: int, user: str | None = None):
    return pl.DataFrame({"user_id": [user or f"{writer}{i}"], "writer": [writer], "i": [i]})


def _local_logs(root):
    from pathlib import Path

    def logs(table: str) -> dict[int, str]:
        return {int(p.stem): p.read_text() for p in (Path(root) / table / "_delta_log").glob("*.json")}

    return logs


def _s3_logs(endpoint: str, root: str):
    from tests.conftest import s3_objects

    def logs(table: str) -> dict[int, str]:
        out = {}
        for key, body in s3_objects(endpoint, root).items():
            d, _, name = key.rpartition("/")
            if d.endswith(f"/{table}/_delta_log") and name.endswith(".json"):
                out[int(name[:-5])] = body.decode()
        return out

    return logs


def _fences(logs: dict[int, str]) -> list[tuple[int, int]]:
    """(table version, fencing token) of every commit of `logs` that carries one, in version order."""
    import json

    out = []
    for v, text in sorted(logs.items()):
        for line in text.splitlines():
            action = json.loads(line)
            if "txn" in action and action["txn"]["appId"] == FENCE_APP:
                out.append((v, action["txn"]["version"]))
    return out


def _assert_no_old_commit_after(fences: list[tuple[int, int]], new: int) -> None:
    first_new = min(v for v, f in fences if f == new)
    assert all(f == new for v, f in fences if v >= first_new), fences
    assert all(f <= new for _, f in fences)


def _takeover(root: str, logs) -> None:
    """A holds the lease and commits; A stops renewing (a paused host) and its ttl passes; B takes
    over. From B's takeover on, each of A's commits (append, replace, delete) is refused, on a
    table B has not written yet as well as after B's own commit."""
    from qumem_pipeline.storage.lease import fenced
    from qumem_pipeline.storage.table_store import FencedOut, TableStore

    a_store, b_store = TableStore(root), TableStore(root)
    a = Lease(root, "ingest", ttl_s=1, holder="host-a:1:a")
    a.acquire()
    a._stop.set()  # A's renewer stops: its lease runs out
    with fenced(a, a_store):
        a_store.append("events", _row("A", 0))
        a_store.append("other", _row("A", 0))
        time.sleep(1.05)
        b = Lease(root, "ingest", ttl_s=30, holder="host-b:1:b")
        b.acquire(wait_s=10, poll_s=0.05)
        assert b.fence[1] > a.fence[1]
        with fenced(b, b_store):  # B's token is on both tables before B writes either
            with pytest.raises(FencedOut):
                a_store.append("other", _row("A", 1))  # a table B never writes
            b_store.append("events", _row("B", 0))
            with pytest.raises(FencedOut):
                a_store.append("events", _row("A", 2))
            with pytest.raises(FencedOut):
                a_store.replace_keyed("events", ["A0"], _row("A", 3, user="A0"))
            with pytest.raises(FencedOut):
                a_store.delete("events", ["A0"])
        b.release()
    a._renewer.join()
    rows = TableStore(root).read("events").filter(~pl.col("user_placeholder"))
    assert sorted(zip(rows["writer"], rows["i"])) == [("A", 0), ("B", 0)]
    assert TableStore(root).read("other")["i"].to_list() == [0]
    for table in ("events", "other"):
        fences = _fences(logs(table))
        assert {f for _, f in fences} == {a.fence[1], b.fence[1]}
        _assert_no_old_commit_after(fences, b.fence[1])


def test_a_holder_that_lost_the_lease_commits_nothing(tmp_path):
    _takeover(str(tmp_path / "data"), _local_logs(tmp_path / "data"))


def test_a_holder_that_lost_the_lease_commits_nothing_on_s3(s3_root, moto_server):
    t = time.monotonic()
    _takeover(s3_root, _s3_logs(moto_server, s3_root))
    assert time.monotonic() - t < 30


@pytest.mark.parametrize("op", ["append", "replace"])
def test_a_commit_racing_the_takeover_fails_on_the_fence(tmp_path, op):
    """A's commit is prepared on a snapshot from before B's takeover (the local checks pass) and
    B's token lands before A's commit: delta-rs' concurrent-transaction check fails A's commit,
    and its retry, on a fresh snapshot, refuses."""
    from qumem_pipeline.storage.lease import fenced
    from qumem_pipeline.storage.table_store import FencedOut, TableStore

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = str(tmp_path / "data")
    a_store, b_store = TableStore(root), TableStore(root)
    a = Lease(root, "ingest", ttl_s=600, holder=holder_id(pid=int(p.stdout)))  # a dead holder: taken over at once
    a.acquire()
    a._stop.set()
    b = Lease(root, "ingest", ttl_s=600, holder="host-b:1:b")
    with fenced(a, a_store):
        a_store.append("events", _row("A", 0, user="A0"))
        prepare = a_store._commit_properties
        raced = []

        def racing(dt, custom):
            raced.append(dt.version())
            commit = prepare(dt, custom)  # A's snapshot has no newer token: A's commit is built
            if len(raced) == 1:
                b.acquire(wait_s=5, poll_s=0.05)
                b_store.fence = b.fence
                assert b.fence_tables(b_store) == ["events"]
            return commit

        a_store._commit_properties = racing
        with pytest.raises(FencedOut):
            if op == "append":
                a_store.append("events", _row("A", 1))
            else:  # A0 is in the table: a delta-rs overwrite, not the add-only commit
                a_store.replace_keyed("events", ["A0"], _row("A", 1, user="A0"))
    b.release()
    # built once on the old snapshot, failed by delta-rs' check, refused on the retry's fresh snapshot
    assert len(raced) == 2 and raced[1] > raced[0]
    rows = TableStore(root).read("events")
    assert rows["i"].to_list() == [0]
    _assert_no_old_commit_after(_fences(_local_logs(root)("events")), b.fence[1])


def test_the_fences_handles_become_the_stores_and_a_takeover_still_refuses_through_them(tmp_path, monkeypatch):
    """The handles the fence loaded become the store's (bench/store_reopen.py: no second whole load of
    each fenced table): A's first write after its fence loads nothing whole and carries A's token; once
    B took over, A's write through that same handle, brought forward, sees B's token and is refused."""
    import deltalake

    from qumem_pipeline.storage.lease import fenced
    from qumem_pipeline.storage.table_store import FencedOut, TableStore

    root = str(tmp_path / "data")
    TableStore(root).append("events", _row("setup", 0))
    loads = []
    init = deltalake.DeltaTable.__init__

    def counted(self, uri, *a, **k):
        loads.append(str(uri))
        return init(self, uri, *a, **k)

    monkeypatch.setattr(deltalake.DeltaTable, "__init__", counted)
    a_store = TableStore(root)
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    a = Lease(root, "ingest", ttl_s=600, holder=holder_id(pid=int(p.stdout)))  # a dead holder: taken over at once
    a.acquire()
    a._stop.set()
    with fenced(a, a_store):
        assert "events" in a_store._tables  # the fence's handle, taken by the store
        before = len([u for u in loads if u.endswith("/events")])
        a_store.append("events", _row("A", 1))
        assert len([u for u in loads if u.endswith("/events")]) == before  # brought forward, not loaded again
        b = Lease(root, "ingest", ttl_s=600, holder="host-b:1:b")
        b.acquire(wait_s=5, poll_s=0.05)
        b_store = TableStore(root)
        with fenced(b, b_store):
            b_store.append("events", _row("B", 0))
        with pytest.raises(FencedOut):
            a_store.append("events", _row("A", 2))
        b.release()
    fences = _fences(_local_logs(root)("events"))
    assert (max(v for v, f in fences if f == a.fence[1]) < min(v for v, f in fences if f == b.fence[1]))
    assert sorted(TableStore(root).read("events")["writer"].to_list()) == ["A", "B", "setup"]


_PAUSED_WORKER = r'''
import os, signal, sys, time
import polars as pl
from qumem_pipeline.storage.lease import Lease, fenced
from qumem_pipeline.storage.table_store import TableStore
root, mode = sys.argv[1], sys.argv[2]
lease = Lease(root, "ingest", ttl_s=2)
store = TableStore(root)
lease.acquire(wait_s=30, poll_s=0.05)
print("fence", lease.fence[1], flush=True)
with fenced(lease, store):
    i = 0
    while True:
        lease.check()
        if mode == "self" and i == 3:  # paused past the ttl between its check and its commit
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        row = pl.DataFrame({"user_id": [f"a{i}" if i % 2 == 0 else "a-shared"], "writer": ["A"], "i": [i]})
        if i % 2 == 0:
            store.append("events", row)  # the add-only commit
        else:
            store.replace_keyed("events", ["a-shared"], row)  # delta-rs' overwrite from i=3 on
        print("committed", i, flush=True)
        i += 1
        time.sleep(0.02)
'''


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
@pytest.mark.parametrize("mode", ["self", "external"])
def test_a_holder_paused_past_its_ttl_commits_nothing_after_the_takeover(tmp_path, mode):
    """The worker holds the lease (ttl 2 s) and commits in a loop. It is SIGSTOPped (by itself right
    after its `check()` passed and before its commit, or by the test at some point of its loop)
    past its ttl; this process takes the lease over and commits; the worker, continued, commits
    nothing more: it stops on FencedOut (or, paused elsewhere, on its own lost lease)."""
    import signal

    from qumem_pipeline.storage.lease import fenced
    from qumem_pipeline.storage.table_store import TableStore

    root = str(tmp_path / "data")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_WORKER, root, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out = []
        want = "stopping" if mode == "self" else "committed 3"
        while not out or out[-1] != want:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            out.append(line.strip())
        if mode == "external":
            os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _stopped(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        old = int(out[0].split()[1])
        store = TableStore(root)
        takeover = Lease(root, "ingest", ttl_s=30, holder="host-b:1:b")
        takeover.acquire(wait_s=15, poll_s=0.1)  # once the worker's lease ran out
        with fenced(takeover, store):
            store.append("events", _row("B", 0))
            os.kill(proc.pid, signal.SIGCONT)
            rest, err = proc.communicate(timeout=60)
        takeover.release()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert "FencedOut" in last if mode == "self" else ("FencedOut" in last or "LeaseLostError" in last), err
    if mode == "self":  # nothing after the stop (stopped by the test, lines printed before it may still be unread)
        assert not [line for line in rest.splitlines() if line.startswith("committed")]
    out += rest.splitlines()
    fences = _fences(_local_logs(root)("events"))
    assert {f for _, f in fences} == {old, takeover.fence[1]}
    _assert_no_old_commit_after(fences, takeover.fence[1])
    rows = store.read("events").filter(~pl.col("user_placeholder"))
    committed = sorted(int(line.split()[1]) for line in out if line.startswith("committed"))
    a_rows = sorted(rows.filter(rows["writer"] == "A")["i"].to_list())
    # every even i appended, the last odd i in a-shared: what landed is what it printed (a commit
    # that landed before the stop is printed after the SIGCONT), nothing of the i it was paused on
    if mode == "self":
        assert max(committed) == 2
    assert a_rows == sorted([i for i in committed if i % 2 == 0] + [max(i for i in committed if i % 2)])
    assert rows.filter(rows["writer"] == "B")["i"].to_list() == [0]


# ------------------------------------------------------------------ the lease table's size, the CAS
def test_renewals_leave_the_lease_table_bounded(tmp_path):
    from pathlib import Path

    from qumem_pipeline.storage.lease import MAINTAIN_EVERY

    lease = Lease(tmp_path, "ingest", ttl_s=600, holder="host-r:1:r")
    lease.acquire()
    lease._stop.set()
    lease._renewer.join()
    for _ in range(200):
        lease.renew()
    lease.release()
    table = Path(tmp_path) / "_leases" / "ingest"
    logs = list((table / "_delta_log").glob("*.json"))
    data = [p for p in table.rglob("*.parquet") if "_delta_log" not in p.parts]
    assert len(logs) <= MAINTAIN_EVERY // 10 and len(data) <= MAINTAIN_EVERY // 10, (len(logs), len(data))
    seq, row = lease.state()
    assert seq == 202 and row["action"] == "release" and row["holder"] == "host-r:1:r"
    # the next holder reads it as before
    with held(str(tmp_path), "ingest", ttl_s=600) as nxt:
        assert nxt.fence[1] == 203


def test_a_lease_table_of_appended_rows_is_taken_over_and_bounded(tmp_path):
    """A lease table an older version wrote (one appended row per commit, 30-day log retention):
    read as before, overwritten by the next commit, given the short retention at the next clean-up."""
    from pathlib import Path

    from deltalake import CommitProperties, DeltaTable, write_deltalake
    from deltalake.transaction import Transaction

    from qumem_pipeline.storage.lease import _SCHEMA, _now

    uri = str(tmp_path / "_leases" / "ingest")
    write_deltalake(uri, pl.DataFrame(schema=_SCHEMA).to_arrow(), mode="append")
    for seq in range(1, 50):  # then its 50th commit is this version's clean-up
        row = pl.DataFrame({"seq": [seq], "holder": ["old:1:x"], "action": ["release"], "expires_at": [_now()],
                            "written_at": [_now()]}, schema=_SCHEMA)
        write_deltalake(uri, row.to_arrow(), mode="append",
                        commit_properties=CommitProperties(app_transactions=[Transaction("qumem-lease-ingest", seq)]))
    lease = Lease(tmp_path, "ingest", ttl_s=600, holder="host-n:1:n")
    assert lease.state() == (49, lease.state()[1]) and lease.state()[1]["holder"] == "old:1:x"
    lease.acquire()
    lease._stop.set()
    dt = DeltaTable(uri)
    assert dt.metadata().configuration["delta.logRetentionDuration"] == "interval 0 seconds"
    assert len(dt.to_pyarrow_table()) == 1
    assert len(list((Path(uri) / "_delta_log").glob("*.json"))) <= 5
    assert [p for p in Path(uri).glob("*.parquet")] and len(list(Path(uri).glob("*.parquet"))) == 1
    lease.release()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_acquirers_on_one_snapshot_exactly_one_wins(tmp_path, request, where):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_root")
    a = Lease(root, "ingest", ttl_s=600, holder="host-a:1:a")
    b = Lease(root, "ingest", ttl_s=600, holder="host-b:1:b")
    for _ in range(3):  # on a fresh table, then over a released row
        seq, row, snap_a = a._snapshot()
        _, _, snap_b = b._snapshot()
        assert a._free(row) and b._free(row)
        results = [a._commit(seq + 1, "acquire", snap_a), b._commit(seq + 1, "acquire", snap_b)]
        assert results == [True, False]
        assert a.state()[1]["holder"] == "host-a:1:a" and a.state()[0] == seq + 1
        a.seq = seq + 1
        a.release()


# ------------------------------------------------------------------ liveness across pid namespaces
def test_a_pid_is_judged_only_in_its_own_pid_namespace():
    import socket

    from qumem_pipeline.storage.lease import _dead_here, namespace_id

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive, host = int(p.stdout), os.getpid(), socket.gethostname()
    ns = namespace_id()
    if not ns:
        pytest.skip("no /proc: no pid namespace identity here")
    boot, _, pidns = ns.partition("/")
    assert _dead_here(holder_id(pid=dead)) and not _dead_here(holder_id(pid=alive))
    # another container with this hostname (another pid namespace), another boot, another host
    for other in (f"{boot}/{int(pidns) + 1}", f"00000000-0000-0000-0000-000000000000/{pidns}"):
        assert not _dead_here(f"{host}:{dead}:x:{other}")
    assert not _dead_here(f"other-host:{dead}:x:{ns}")
    # holder ids of older versions (no namespace) and ones without one: expiry only
    assert not _dead_here(f"{host}:{dead}:x") and not _dead_here(f"{host}:{dead}:x:")
    a = Lease("/nonexistent", "ingest")
    assert a.holder.count(":") == 3 and a.holder.endswith(ns)
