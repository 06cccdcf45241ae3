"""A lease on one data root, held across hosts: at most one ingest sync at a time, wherever it runs,
and a fence so that a holder that lost it commits nothing to the data tables.

Why: a file lock (`flock`) only excludes processes of one machine; two hosts syncing the same
archive into the same object-store root would both rebuild the same users. Delta gives a
compare-and-swap that works on every backend delta-rs commits to (local disk, S3 conditional
puts, GCS, Azure): a commit that carries an application transaction `(app_id, version)` fails
when another commit with the same app id landed since its snapshot (delta-rs' conflict checker:
"Concurrent transaction failed"). So the lease is a small Delta table beside the data tables
(`<root>/_leases/<name>`, outside the store's table names: nothing else reads or forgets it):
every acquire, renew and release is one commit that overwrites the table's single row and carries
`(app_id, seq + 1)`, where `seq` is the app's last transaction version. Two hosts that see the
lease free both try seq + 1; exactly one commit lands.

Size: the table holds one row, and every `MAINTAIN_EVERY`-th lease commit (its seq a multiple)
vacuums the files older commits removed (and, full, files of losing commits over an hour old),
writes a checkpoint and drops the log before it (the table is created with zero log retention:
nothing reads its history), so its files stay bounded however long the root lives (measured: 200
renewals leave 2 log and 2 data files). A reader that loaded a version whose files were just
removed retries on a fresh load. A table of an older version (a row appended per commit) is
overwritten by its next commit and given the retention at its next clean-up.

Liveness: a holder renews on a thread every `ttl / 3`; a lease whose holder stopped renewing (a
killed host) is free once `expires_at` has passed, so the next sync takes it over. A holder whose
process is gone is stale at once (a killed run is rerun without waiting out the ttl), but only
when the reader is provably in the same pid namespace: the holder id is
`host:pid:tag:boot_id/pidns` (the kernel's boot id and the inode of the process's pid namespace)
and the pid is checked only when host, boot id and namespace all match the reader's: two
containers with the same hostname (or the host and a container) see different pid namespaces, and
a pid of one means nothing in the other. Other holders, and holder ids without the namespace part
(older versions), are judged by expiry only. Expiry is judged by the reader's wall clock: hosts'
clocks must agree to well within `ttl` (NTP does). A holder that could not renew in time loses the
lease: `check()` raises, and the sync calls it before each commit.

Fencing (`fenced(lease, store)`): a local check cannot stop a holder paused (SIGSTOP, a VM freeze,
a long GC) between its `check()` and its commit, so the data commits carry a fencing token that
the store's conflict rules check. The token is `(fence app id, the lease version of our acquire)`
(`Lease.fence`): acquire versions only grow, so a later holder's token is larger than every
earlier holder's. While fenced, every commit of the `TableStore` carries the token as a Delta
application transaction and refuses (`table_store.FencedOut`) on a snapshot whose recorded
version of that app id is larger; a commit racing a newer holder's token on the same table fails
delta-rs' concurrent-transaction check and, retried on a fresh snapshot, refuses. On entry,
`fenced` puts the new token on every data table of the root that exists then, or on the holder's own
tables when it names them (`fenced(tables=...)`: the ingest's six; a commit to another table inside
then raises), one empty commit per table carrying only the transaction, 8 tables at a time (measured
for 12 tables: 35-50 ms on local disk, 0.8-1.2 s on moto's S3 server on loopback, most of it loading
each table).

The guarantee, precisely: on each table, no commit with an older holder's token lands after the
first commit with a newer one (in each table's log, tokens never decrease from there on). The new holder's first commit on every
table it fences (that exists when it enters `fenced`) is that takeover commit, before the body runs; a table
created later is fenced from the new holder's first commit on it (before that, an older holder
paused past its ttl could still create it and commit to it). A takeover waits for the old lease
to expire, and a live old holder stops itself at its own ttl (`check()`), so that gap needs a
holder paused past its ttl exactly between `check()` and a commit to a table that did not exist
at the takeover. Metadata-only commits the store makes outside its fenced ones (creating a table
empty, dtype hints) are not fenced: they carry no rows. The fence is on the `TableStore` object:
every commit made through it while fenced, from any thread, carries the token.
"""

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from functools import cache

import polars as pl
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import Transaction

log = logging.getLogger(__name__)

DEFAULT_TTL_S = float(os.environ.get("QUMEM_LEASE_TTL_S", "600"))
MAINTAIN_EVERY = 50  # lease commits between two clean-ups of the lease table
_READ_RETRIES = 6
_FENCE_RETRIES = 20
_SCHEMA = {"seq": pl.Int64, "holder": pl.String, "action": pl.String, "expires_at": pl.Datetime("us", "UTC"),
           "written_at": pl.Datetime("us", "UTC")}
# Nothing reads the lease table's history: the log before the latest checkpoint goes at the next
# clean-up. Removed files are deleted by the clean-up's vacuum, which finds them by the tombstones
# the log keeps (a checkpoint drops tombstones older than deletedFileRetentionDuration, so it is
# not zero: a file whose tombstone went untracked is left to the hour-old orphan pass).
_TABLE_CONFIG = {"delta.logRetentionDuration": "interval 0 seconds",
                 "delta.deletedFileRetentionDuration": "interval 1 hour"}
# Checkpoints and log clean-up only in maintain() (after the vacuum), not in delta-rs' post-commit hook.
_NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


class LeaseHeldError(TimeoutError):
    """Another holder kept the lease for longer than this caller would wait."""


class LeaseLostError(RuntimeError):
    """This holder's lease expired or was taken over: it must not write."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


@cache
def namespace_id() -> str:
    """This process's pid namespace, unique across hosts and boots: `boot_id/pidns inode`
    ('' where /proc does not say: then no holder is judged by its pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}" if boot and ":" not in boot else ""


def holder_id(pid: int | None = None) -> str:
    """`host:pid:tag:namespace`: who holds a lease, with what another process needs to tell whether
    that pid is one it can see (see the module docstring)."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}:{uuid.uuid4().hex[:8]}:{namespace_id()}"


def _dead_here(holder: str) -> bool:
    """A holder in this very pid namespace (same host, boot and namespace) whose process is gone
    (killed mid-sync): its lease is stale now, not after its ttl. Every other holder, and a holder
    id without a namespace (older versions), is judged by expiry only."""
    parts = holder.split(":")
    if len(parts) != 4:
        return False
    host, pid, _, ns = parts
    if host != socket.gethostname() or not ns or ns != namespace_id() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def _conflict(exc: Exception) -> bool:
    msg = str(exc).lower()
    return isinstance(exc, CommitFailedError) or "concurrent" in msg or "already exists" in msg


class Lease:
    """One named lease under `root` (a data root path or URI)."""

    def __init__(self, root: str, name: str, *, ttl_s: float = DEFAULT_TTL_S, storage_options: dict | None = None,
                 holder: str | None = None):
        self.uri = f"{str(root).rstrip('/')}/_leases/{name}"
        self.app_id = f"qumem-lease-{name}"
        self.fence_app_id = f"qumem-fence-{name}"
        self.ttl = timedelta(seconds=ttl_s)
        self.storage_options = storage_options
        self.holder = holder or holder_id()
        self.seq: int | None = None  # the version of our last lease commit while we hold it
        self.acquired_seq: int | None = None  # the version of our acquire: the fencing token
        self._lost: Exception | None = None
        self._valid_until = 0.0  # monotonic: when our last lease commit runs out, by our own clock
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # -------------------------------------------------------------- state
    def _table(self) -> DeltaTable | None:
        try:
            return DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            return None

    def state(self) -> tuple[int, dict | None]:
        """(the app's last transaction version, the row it wrote) — (0, None) before any."""
        seq, row, _ = self._snapshot()
        return seq, row

    def _snapshot(self) -> tuple[int, dict | None, DeltaTable]:
        """state() and the table snapshot it was read from: a lease commit is made on that snapshot,
        so a commit that landed since it is a conflict (a commit on a fresh load would not see it).
        A load or read that fails (a clean-up removed the log or file it named, a transient store
        error) is retried on a fresh load."""
        for attempt in range(_READ_RETRIES):
            try:
                return self._snapshot_once()
            except (DeltaError, OSError) as exc:
                if attempt == _READ_RETRIES - 1:
                    raise
                log.debug("lease %s: read failed (%s), loading again", self.uri, exc)
                time.sleep(0.02 * (2 ** attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _snapshot_once(self) -> tuple[int, dict | None, DeltaTable]:
        dt = self._table() or self._create()
        seq = dt.transaction_version(self.app_id) or 0
        if seq == 0:
            return 0, None, dt
        rows = pl.from_arrow(dt.to_pyarrow_dataset().to_table()).filter(pl.col("seq") == seq)
        return seq, (rows.row(0, named=True) if rows.height else None), dt

    def _create(self) -> DeltaTable:
        """The empty lease table. Made apart from any lease commit: delta-rs checks a commit's
        application transaction against the commits that landed since its snapshot, and the
        commit that creates a table has none (measured: two racing creators both landed a
        version-1 acquire), so every lease commit is made on a snapshot of an existing table."""
        try:
            write_deltalake(self.uri, pl.DataFrame(schema=_SCHEMA).to_arrow(), mode="append",
                            configuration=_TABLE_CONFIG, storage_options=self.storage_options)
        except (CommitFailedError, DeltaError) as exc:  # a rival created it first
            if not isinstance(exc, CommitFailedError) and "exist" not in str(exc).lower():
                raise
        return DeltaTable(self.uri, storage_options=self.storage_options)

    @staticmethod
    def _free(row: dict | None) -> bool:
        return row is None or row["action"] == "release" or row["expires_at"] <= _now() or _dead_here(row["holder"])

    def _commit(self, seq: int, action: str, snapshot: DeltaTable) -> bool:
        """Overwrite the table's row with that of lease version `seq`, on `snapshot` (the table as
        `seq - 1` was read from it); False when another commit took `seq` first (the overwrite
        conflicts on the application transaction and on the file it removes)."""
        now, started = _now(), time.monotonic()
        row = pl.DataFrame({"seq": [seq], "holder": [self.holder], "action": [action],
                            "expires_at": [now + self.ttl], "written_at": [now]}, schema=_SCHEMA)
        commit = CommitProperties(app_transactions=[Transaction(self.app_id, seq)],
                                  custom_metadata={"qumem.lease": action, "qumem.holder": self.holder})
        try:
            write_deltalake(snapshot, row.to_arrow(), mode="overwrite", commit_properties=commit,
                            post_commithook_properties=_NO_HOOKS)
        except (CommitFailedError, DeltaError) as exc:
            if _conflict(exc):
                return False
            raise
        self._valid_until = started + self.ttl.total_seconds()
        if seq % MAINTAIN_EVERY == 0:
            self.maintain()
        return True

    def maintain(self) -> None:
        """Bound the lease table: delete the files older versions removed, checkpoint, drop the log
        before the checkpoint. Never fails the lease: an error is logged and the next clean-up
        (MAINTAIN_EVERY commits on) does the work."""
        try:
            dt = DeltaTable(self.uri, storage_options=self.storage_options)
            config = dt.metadata().configuration
            if any(config.get(k) != v for k, v in _TABLE_CONFIG.items()):  # a table made by an older version
                dt.alter.set_table_properties(_TABLE_CONFIG)
                dt = DeltaTable(self.uri, storage_options=self.storage_options)
            dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False,
                      post_commithook_properties=_NO_HOOKS)
            # files of commits that never landed (the losers of a race): a writer's own file
            # is committed within seconds of being written, so an hour-old untracked one is an orphan
            dt.vacuum(retention_hours=1, enforce_retention_duration=False, dry_run=False, full=True,
                      post_commithook_properties=_NO_HOOKS)
            dt = DeltaTable(self.uri, storage_options=self.storage_options)
            dt.create_checkpoint()
            dt.cleanup_metadata()
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            log.warning("lease %s: clean-up failed: %s", self.uri, exc)

    # -------------------------------------------------------------- use
    def acquire(self, wait_s: float = 3600.0, poll_s: float = 1.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            seq, row, snap = self._snapshot()
            if self._free(row) and self._commit(seq + 1, "acquire", snap):
                self.seq = self.acquired_seq = seq + 1
                self._lost = None
                self._start_renewing()
                return
            if time.monotonic() >= deadline:
                raise LeaseHeldError(f"lease {self.uri} is held by {row['holder'] if row else '?'} "
                                     f"until {row['expires_at'] if row else '?'}; waited {wait_s:.0f}s")
            time.sleep(poll_s)

    @property
    def fence(self) -> tuple[str, int]:
        """The fencing token of this hold: (app id, lease version of our acquire), larger than that
        of every earlier holder (see the module docstring)."""
        if self.acquired_seq is None:
            raise LeaseLostError(f"lease {self.uri} is not held by {self.holder}")
        return self.fence_app_id, self.acquired_seq

    def renew(self) -> None:
        """Extend our lease by one ttl (a commit of version seq + 1, which fails if anyone else wrote)."""
        self.check()
        seq, row, snap = self._snapshot()
        if seq != self.seq or row is None or row["holder"] != self.holder or row["expires_at"] <= _now():
            self._lost = LeaseLostError(f"lease {self.uri} lost by {self.holder} (now version {seq})")
            raise self._lost
        if not self._commit(seq + 1, "renew", snap):
            self._lost = LeaseLostError(f"lease {self.uri} taken over while {self.holder} renewed")
            raise self._lost
        self.seq = seq + 1

    def check(self) -> None:
        """Raise when this holder has lost the lease (call before each write): a renewal failed, or
        none succeeded within the ttl (a renewer stuck on the store must not let writes go on)."""
        if self._lost is None and self.seq is not None and time.monotonic() > self._valid_until:
            self._lost = LeaseLostError(f"lease {self.uri}: not renewed within its ttl")
        if self._lost is not None:
            raise self._lost

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.seq is not None and self._lost is None:
            seq, row, snap = self._snapshot()
            if seq == self.seq and row is not None and row["holder"] == self.holder:
                self._commit(seq + 1, "release", snap)
        self.seq = None

    def _start_renewing(self) -> None:
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self.ttl.total_seconds() / 3):
                try:
                    self.renew()
                except Exception as exc:  # noqa: BLE001 - recorded; check() raises it in the holder
                    self._lost = self._lost or LeaseLostError(f"lease {self.uri}: renewal failed: {exc}")
                    return

        self._renewer = threading.Thread(target=loop, name="qumem-lease-renew", daemon=True)
        self._renewer.start()

    # -------------------------------------------------------------- fencing
    def fence_tables(self, store, workers: int = 8, tables=None) -> list[str]:
        """Put this hold's fencing token on every data table of `store`'s root, or on those of
        `tables` that exist (one empty commit each that carries only the application transaction),
        so that no older holder commits to any of them from now on. Returns the tables fenced now
        (not those already fenced by us). Raises `FencedOut` when a table already carries a newer
        holder's token."""
        tables = store.tables() if tables is None else sorted(set(tables))
        if not tables:
            return []
        with ThreadPoolExecutor(max_workers=min(workers, len(tables))) as pool:
            done = list(pool.map(lambda t: self._fence_table(store.uri(t), store.storage_options), tables))
        for t, (_, dt) in zip(tables, done):
            # The store's first use of the table then brings this handle forward instead of loading
            # the whole log once more (bench/store_reopen.py)
            if dt is not None:
                store.adopt(t, dt)
        return [t for t, (d, _) in zip(tables, done) if d]

    def _fence_table(self, uri: str, storage_options: dict | None) -> tuple[bool, DeltaTable | None]:
        """(whether this call put the token on, the table's handle as loaded for it: None when the
        table does not exist)."""
        from qumem_pipeline.storage.table_store import FencedOut

        app_id, seq = self.fence
        for attempt in range(_FENCE_RETRIES):
            self.check()
            try:
                dt = DeltaTable(uri, storage_options=storage_options)
            except TableNotFoundError:
                return False, None
            except (DeltaError, OSError):  # a clean-up moved the log under the load: load again
                if attempt == _FENCE_RETRIES - 1:
                    raise
                time.sleep(min(1.0, 0.02 * (2 ** attempt)))
                continue
            seen = dt.transaction_version(app_id) or 0
            if seen > seq:
                raise FencedOut(f"{uri}: a newer holder of {app_id} committed (fence {seen} > ours {seq})")
            if seen == seq:
                return False, dt
            commit = CommitProperties(app_transactions=[Transaction(app_id, seq)],
                                      custom_metadata={"qumem.operation": "fence", "qumem.holder": self.holder})
            try:
                dt.create_write_transaction([], "append", dt.schema(),
                                            partition_by=dt.metadata().partition_columns or None,
                                            commit_properties=commit)
                return True, dt
            except (CommitFailedError, DeltaError, OSError) as exc:
                if attempt == _FENCE_RETRIES - 1 or not _conflict(exc):
                    raise
                time.sleep(min(1.0, 0.02 * (2 ** attempt)))
        raise AssertionError("unreachable")  # pragma: no cover


@contextmanager
def held(root: str, name: str, **kw):
    """`with held(root, "ingest") as lease: ... lease.check() before each write ...`"""
    lease = Lease(root, name, **kw)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()


@contextmanager
def fenced(lease: Lease, store, tables=None):
    """Every commit `store` makes inside carries `lease`'s fencing token, and every data table of
    its root that exists on entry carries it before the body runs (see the module docstring).

    `tables`: the only tables the holder's work may commit to (the ingest's six, not the stages'
    tables beside them): only those are fenced on entry, and a commit to any other table inside
    raises `FenceScopeError`, so the list cannot silently fall behind the code. Why: a takeover
    commit costs a table load and a commit per table (1 s for 12 tables on S3, module docstring),
    and an older holder of the same lease writes none of the others."""
    previous, previous_scope = store.fence, store.fence_scope
    store.fence = lease.fence
    store.fence_scope = None if tables is None else frozenset(tables)
    try:
        lease.fence_tables(store, tables=tables)
        yield store
    finally:
        store.fence, store.fence_scope = previous, previous_scope
