"""A lease on one data root, held across hosts: at most one ingest sync at a time, wherever it runs.

Why: a file lock (`flock`) only excludes processes of one machine; two hosts syncing the same
archive into the same object-store root would both rebuild the same users. Delta gives a
compare-and-swap that works on every backend delta-rs commits to (local disk, S3 conditional
puts, GCS, Azure): a commit that carries an application transaction `(app_id, version)` fails
when another commit with the same app id landed since its snapshot (delta-rs' conflict checker:
"Concurrent transaction failed"). So the lease is a small Delta table beside the data tables
(`<root>/_leases/<name>`, outside the store's table names: nothing else reads or forgets it):
every acquire, renew and release is one appended row whose commit carries `(app_id, seq + 1)`,
where `seq` is the app's last transaction version. Two hosts that see the lease free both try
seq + 1; exactly one commit lands.

A holder renews on a thread every `ttl / 3`; a lease whose holder stopped renewing (a killed
host) is free once `expires_at` has passed, so the next sync takes it over; a holder on this same
host whose process is gone is stale at once (a killed run is rerun without waiting out the ttl). Expiry is judged by
the reader's wall clock: hosts' clocks must agree to well within `ttl` (NTP does). A holder
that could not renew in time loses the lease: `check()` raises, and the sync calls it before
each commit, so a host that lost its lease writes nothing more.
"""

import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import polars as pl
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import Transaction

DEFAULT_TTL_S = float(os.environ.get("QUMEM_LEASE_TTL_S", "600"))
_SCHEMA = {"seq": pl.Int64, "holder": pl.String, "action": pl.String, "expires_at": pl.Datetime("us", "UTC"),
           "written_at": pl.Datetime("us", "UTC")}


class LeaseHeldError(TimeoutError):
    """Another holder kept the lease for longer than this caller would wait."""


class LeaseLostError(RuntimeError):
    """This holder's lease expired or was taken over: it must not write."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _dead_here(holder: str) -> bool:
    """A holder of this host whose process is gone (killed mid-sync): its lease is stale now, not
    after its ttl. Holders on other hosts are judged by expiry only."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Lease:
    """One named lease under `root` (a data root path or URI)."""

    def __init__(self, root: str, name: str, *, ttl_s: float = DEFAULT_TTL_S, storage_options: dict | None = None,
                 holder: str | None = None):
        self.uri = f"{str(root).rstrip('/')}/_leases/{name}"
        self.app_id = f"qumem-lease-{name}"
        self.ttl = timedelta(seconds=ttl_s)
        self.storage_options = storage_options
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.seq: int | None = None  # the version of our last lease commit while we hold it
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
        so a commit that landed since it is a conflict (a commit on a fresh load would not see it)."""
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
                            storage_options=self.storage_options)
        except (CommitFailedError, DeltaError) as exc:  # a rival created it first
            if not isinstance(exc, CommitFailedError) and "exist" not in str(exc).lower():
                raise
        return DeltaTable(self.uri, storage_options=self.storage_options)

    @staticmethod
    def _free(row: dict | None) -> bool:
        return row is None or row["action"] == "release" or row["expires_at"] <= _now() or _dead_here(row["holder"])

    def _commit(self, seq: int, action: str, snapshot: DeltaTable) -> bool:
        """Append the row of lease version `seq` on `snapshot` (the table as `seq - 1` was read
        from it); False when another commit took `seq` first."""
        now, started = _now(), time.monotonic()
        row = pl.DataFrame({"seq": [seq], "holder": [self.holder], "action": [action],
                            "expires_at": [now + self.ttl], "written_at": [now]}, schema=_SCHEMA)
        commit = CommitProperties(app_transactions=[Transaction(self.app_id, seq)],
                                  custom_metadata={"qumem.lease": action, "qumem.holder": self.holder})
        try:
            write_deltalake(snapshot, row.to_arrow(), mode="append", commit_properties=commit)
        except (CommitFailedError, DeltaError) as exc:
            msg = str(exc).lower()
            if isinstance(exc, CommitFailedError) or "concurrent" in msg or "already exists" in msg:
                return False
            raise
        self._valid_until = started + self.ttl.total_seconds()
        return True

    # -------------------------------------------------------------- use
    def acquire(self, wait_s: float = 3600.0, poll_s: float = 1.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            seq, row, snap = self._snapshot()
            if self._free(row) and self._commit(seq + 1, "acquire", snap):
                self.seq = seq + 1
                self._start_renewing()
                return
            if time.monotonic() >= deadline:
                raise LeaseHeldError(f"lease {self.uri} is held by {row['holder'] if row else '?'} "
                                     f"until {row['expires_at'] if row else '?'}; waited {wait_s:.0f}s")
            time.sleep(poll_s)

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


@contextmanager
def held(root: str, name: str, **kw):
    """`with held(root, "ingest") as lease: ... lease.check() before each write ...`"""
    lease = Lease(root, name, **kw)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()
