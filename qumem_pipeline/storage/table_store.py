"""One Delta Lake table per pipeline table under a data root URI (local path, `s3://`, `gs://`, `az://`).

Why Delta and this layout: one Parquet file per user per table does not scale (millions of files,
~1 ms each) and cannot live in object storage transactionally. Here every table is a Delta table
partitioned by `user_bucket = user_bucket(user_key) mod N` (N fixed at creation, recorded in the
table's description, enforced after), with rows sorted by `user_key` inside each file so row-group
statistics prune a user lookup. Statistics are kept for the key columns only, so no user text is
copied into the transaction log.

Store-owned columns (dropped on read by `DataLayout`; external readers filter `NOT user_placeholder`):
- `user_key`: the partition user (the row's `user_id`, or `__unattributed__` for bad rows without one);
- `user_bucket`: the hash bucket of `user_key` (the Delta partition column);
- `user_placeholder`: true on the one all-null row that records "this user was written with no rows",
  so an empty result stays distinguishable from "never written".

`replace` is one Delta commit per call (`write_deltalake(mode="overwrite", predicate=...)`: the
users' old rows out, the new rows in), so a writer killed mid-write leaves the previous version;
concurrent commits on disjoint users both land (delta-rs' conflict checker, plus our retry).

Erasure at commit time (ARCHITECTURE.md, "Erasure and concurrency"): every write opens its snapshot
of the table, THEN reads the forget registry (`storage/tombstones.py`) and drops the rows of users
forgotten as of that read. A forget bumps each table's erase epoch (a metadata commit) before it
deletes the user, and delta-rs fails any commit whose snapshot predates a metadata change, so a
write either saw the tombstone or lands before the forget's delete, never after it with the
user's rows. A new table is first created empty (a commit with no rows) for the same reason.
Fencing: a lease holder sets `fence = (app_id, seq)`; each of its commits carries that Delta
application transaction and refuses to commit on a snapshot where a newer holder's fence landed
(a commit racing one fails on delta-rs' concurrent-transaction check), so a holder that lost its
lease commits nothing.
Credentials for object stores come from the environment as delta-rs reads them (AWS_*, GOOGLE_*,
AZURE_*); on S3, delta-rs >= 1.0 commits with conditional puts, so no locking provider is needed.
"""

import bisect
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterable
from urllib.parse import unquote

import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, WriterProperties, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import Transaction

from qumem_pipeline.contracts.buckets import DEFAULT_BUCKETS, user_bucket
from qumem_pipeline.contracts.buckets import configured_buckets as _configured_buckets
from qumem_pipeline.storage.file_commit import NO_HOOKS as _NO_HOOKS
from qumem_pipeline.storage.file_commit import commit_append, commit_new_table, fast_path_ok, may_hold, write_files

KEY, BUCKET, PLACEHOLDER = "user_key", "user_bucket", "user_placeholder"
STORE_COLUMNS = (KEY, BUCKET, PLACEHOLDER)
DESCRIPTION_TAG = "qumem-table-store"
# How a write landed (``TableStore.write_paths`` counts them): new files plus one add-only commit, or
# through delta-rs because the add-only path did not apply (SKIPPED) or found another writer's copy (RACED).
WRITTEN, SKIPPED, RACED = "add_only", "delta_rs", "add_only_raced"
_LOG = logging.getLogger(__name__)
COMMIT_RETRIES = int(os.environ.get("QUMEM_COMMIT_RETRIES", "20"))
TARGET_FILE_SIZE = int(os.environ.get("QUMEM_TARGET_FILE_BYTES", str(256 * 1024 * 1024)))
_TABLE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_STAGING = re.compile(r"\.parquet#(\d+|q)$")  # a local file being written (delta-rs: #N, file_commit: #q)
# Row groups of a few thousand rows: files are sorted by user_key, so a read of a few users decodes
# about one row group per user (row-group statistics prune the rest) whatever the file size:
# reading 100 users costs the same at 1M and 10M rows (bench/ingest.py read_ratio_10m_vs_1m).
ROW_GROUP_ROWS = int(os.environ.get("QUMEM_ROW_GROUP_ROWS", "4096"))
# After its own commit a handle is brought forward, not loaded again (TableStore._reopen); False
# restores the fresh load (bench A/B).
INCREMENTAL_REOPEN = True
_WRITER = WriterProperties(compression="ZSTD", max_row_group_size=ROW_GROUP_ROWS)
# A user read on a local root goes through polars' Parquet scan (`_scan_users_local`); object stores keep
# the pyarrow path, which reads the store's own filesystem configuration. Tests run both.
POLARS_LOCAL_READS = True
# Checkpoints are this store's, not delta-rs' post-commit hook (`_after_commit`): a checkpoint the hook
# writes late, from a snapshot taken before a forget deleted a user, would land after the forget
# scrubbed the log and carry that user's statistics; the store's own can be checked and cleaned up.
# Every `CHECKPOINT_INTERVAL` versions, as delta-rs' default `delta.checkpointInterval`.
CHECKPOINT_INTERVAL = int(os.environ.get("QUMEM_CHECKPOINT_INTERVAL", "100"))


class SchemaEvolutionError(ValueError):
    """New rows do not fit the table's schema in a way the evolution rule allows."""


class BucketMismatchError(ValueError):
    """The deployment's bucket count differs from the one a table was created with."""


class FenceScopeError(RuntimeError):
    """A fenced holder committed to a table outside the tables it fenced (a programming error: an older
    holder's commits to that table would not be refused)."""


class FencedOut(RuntimeError):
    """A newer lease holder's fence is on the table: this writer lost its lease and must not commit."""


def configured_buckets() -> int | None:
    """The deployment's bucket count for new tables (`contracts.buckets.configured_buckets`: QUMEM_BUCKETS)."""
    return _configured_buckets()


def is_uri(root: str | os.PathLike) -> bool:
    return "://" in str(root) and not str(root).startswith("file://")


def sql_literal(s: str) -> str:
    """A string as a SQL literal of a Delta predicate."""
    return "'" + s.replace("'", "''") + "'"


# Delta has no unsigned ints, small ints round-trip, fixed-size arrays come back as lists: the
# logical polars dtypes of such columns are kept in the table description and restored on read.
def _dtype_to_str(dt: pl.DataType) -> str:
    if isinstance(dt, pl.Array):
        return f"Array({_dtype_to_str(dt.inner)},{dt.size})"
    return str(dt.base_type().__name__)


def _dtype_from_str(s: str) -> pl.DataType:
    m = re.fullmatch(r"Array\((.+),(\d+)\)", s)
    if m:
        return pl.Array(_dtype_from_str(m.group(1)), int(m.group(2)))
    return getattr(pl, s)()


def _lossy(dt: pl.DataType) -> bool:
    return isinstance(dt, pl.Array) or dt in (pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64)


class TableStore:
    """Every table of one data root; a DeltaTable handle per table is cached and refreshed on use."""

    def __init__(self, root: str | os.PathLike, n_buckets: int | None = None,
                 storage_options: dict[str, str] | None = None):
        self.root = str(root).rstrip("/") if is_uri(root) else str(Path(root).absolute())
        self.n_buckets = n_buckets if n_buckets is not None else configured_buckets()
        self.storage_options = storage_options
        self._tables: dict[str, DeltaTable] = {}
        self.write_paths: Counter = Counter()  # WRITTEN / SKIPPED / RACED per write this process made
        self.fence: tuple[str, int] | None = None  # (lease app id, holder's seq): see the module docstring
        self.fence_scope: frozenset[str] | None = None  # the tables a fenced holder may commit to (None: all)
        self.dropped_forgotten: Counter = Counter()  # table -> writes that dropped a forgotten user's rows
        self.files_read: Counter = Counter()  # table -> data files opened by `read_buckets`
        self._tombstones = None
        self._counts_lock = threading.Lock()  # the counters above, bumped by writes on several threads (ingest/sync.py)
        self._registry_lock = threading.Lock()

    def plain_handle(self) -> "TableStore":
        """Another handle on the same root with no bucket count of its own (for root-level registries)."""
        store = TableStore(self.root, storage_options=self.storage_options)
        store.n_buckets = None
        return store

    def tombstones(self):
        """The forget registry of this root (read fresh at each write's commit). Made once under a
        lock: writes of several tables on threads share it (its reads take its own lock)."""
        if self._tombstones is None:
            with self._registry_lock:
                if self._tombstones is None:
                    from qumem_pipeline.storage.tombstones import Tombstones

                    self._tombstones = Tombstones(self)
        return self._tombstones

    # ------------------------------------------------------------------ naming and handles
    def uri(self, table: str) -> str:
        if not _TABLE_NAME.match(table):
            raise ValueError(f"invalid table name {table!r}")
        return f"{self.root}/{table}"

    def _open(self, table: str) -> DeltaTable | None:
        for attempt in range(COMMIT_RETRIES):
            dt = self._tables.get(table)
            try:
                if dt is None:
                    dt = DeltaTable(self.uri(table), storage_options=self.storage_options)
                    self._check_buckets(table, dt)
                    self._tables[table] = dt
                else:
                    dt.update_incremental()
                return dt
            except TableNotFoundError:
                self._tables.pop(table, None)
                return None
            except (DeltaError, OSError) as exc:
                # a forget's checkpoint replaced the one this load started from: load again
                if not _log_moved(exc) or attempt == COMMIT_RETRIES - 1:
                    raise
                self._tables.pop(table, None)
                _backoff(attempt)
        return None  # pragma: no cover

    def adopt(self, table: str, dt: DeltaTable) -> None:
        """Take a handle on `table` that another part of this process has just loaded (the lease's
        fence, storage/lease.py) as this store's, unless it holds one: its next use brings it forward
        (`update_incremental`). A handle this store would refuse (bucket count) is not taken; the
        next `_open` loads and refuses as before."""
        if table in self._tables or not INCREMENTAL_REOPEN:
            return
        try:
            self._check_buckets(table, dt)
        except BucketMismatchError:
            return
        self._tables[table] = dt

    def _reopen(self, table: str) -> DeltaTable | None:
        """The table as of now, after a commit of this handle: its cached snapshot brought forward by
        the log entries since (`update_incremental`), not loaded again from the whole log. The store
        checkpoints every `CHECKPOINT_INTERVAL` (100) versions, so a fresh load replays up to 99 commits'
        JSON files (on S3 a GET each), and a write used to load its table three times
        (bench/store_reopen.py counts and times both ways). A log a forget rewrote meanwhile falls back
        to a fresh load (`_open`)."""
        if not INCREMENTAL_REOPEN:
            self._tables.pop(table, None)
        return self._open(table)

    def exists(self, table: str) -> bool:
        return self._open(table) is not None

    def _meta(self, dt: DeltaTable) -> dict:
        try:
            meta = json.loads(dt.metadata().description or "{}")
        except json.JSONDecodeError:
            meta = {}
        return meta if meta.get("tag") == DESCRIPTION_TAG else {}

    def _check_buckets(self, table: str, dt: DeltaTable) -> None:
        have = self._meta(dt).get("user_buckets")
        if have is None:
            raise BucketMismatchError(f"table {self.uri(table)} was not created by the table store (no bucket count)")
        if self.n_buckets is not None and int(have) != self.n_buckets:
            raise BucketMismatchError(
                f"table {self.uri(table)} has {have} user buckets, this deployment is configured with "
                f"{self.n_buckets} (QUMEM_BUCKETS); the count is fixed for a table's life")

    def buckets_of(self, table: str) -> int:
        dt = self._open(table)
        if dt is None:
            return self.n_buckets or DEFAULT_BUCKETS
        return int(self._meta(dt)["user_buckets"])

    def tables(self) -> list[str]:
        """Names of the Delta tables under the root."""
        fs, base = self.filesystem()
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            if info.type == pafs.FileType.Directory and _TABLE_NAME.match(info.base_name):
                if fs.get_file_info(f"{info.path}/_delta_log").type == pafs.FileType.Directory:
                    out.append(info.base_name)
        return sorted(out)

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """A pyarrow filesystem and base path for the root (object stores configured from the environment)."""
        return filesystem_for(self.root)

    # ------------------------------------------------------------------ reads
    def schema(self, table: str) -> pl.Schema | None:
        dt = self._open(table)
        if dt is None:
            return None
        arrow = dt.schema().to_arrow()
        empty = pl.from_arrow(pads.dataset([], schema=_pa_schema(arrow)).to_table())
        return self._restore(dt, empty).schema

    def read(self, table: str, users: Iterable[str] | None = None, columns: list[str] | None = None) -> pl.DataFrame | None:
        """Rows of `users` (all when None), store columns included; None when the table does not exist.

        Partition pruning on `user_bucket`, then a `user_key` predicate that row-group statistics prune."""
        dt = self._open(table)
        if dt is None:
            return None
        ds = dt.to_pyarrow_dataset()
        cols = None if columns is None else list(dict.fromkeys([*columns, KEY, PLACEHOLDER]))
        if users is None:
            df = _frame(ds.to_table(columns=cols))
        else:
            n = int(self._meta(dt)["user_buckets"])
            df = self._read_users(table, dt, ds, {u: user_bucket(u, n) for u in sorted(set(users))}, cols)
        df = self._restore(dt, df)
        return df if df[KEY].is_sorted() else df.sort(KEY, maintain_order=True)

    def _read_users(self, table: str, dt: DeltaTable, ds, bucket_of: dict[str, int], cols) -> pl.DataFrame:
        """Rows of the users of `bucket_of` (user -> bucket, in user order) from their buckets' files, reading only the row groups whose
        user_key range holds one of them. pyarrow's dataset filter does not prune row groups on
        an `isin` (measured: a 100-user read decoded the whole table), so the row groups are
        chosen here from the footers' statistics; the filter then keeps the exact rows. On a local
        root polars reads the same files instead (`_scan_users_local`)."""
        users, buckets = list(bucket_of), sorted(set(bucket_of.values()))
        fs, base = self.filesystem()
        prefix = f"{base}/{table}"
        acts = pl.DataFrame(dt.get_add_actions(flatten=True)).filter(pl.col(f"partition.{BUCKET}").is_in(buckets))
        if POLARS_LOCAL_READS and not is_uri(self.root) and acts.height:
            files = [(f"{prefix}/{unquote(p)}", b) for p, b in acts.select("path", f"partition.{BUCKET}").iter_rows()]
            return _scan_users_local(files, ds.schema, bucket_of, cols)
        fmt = pads.ParquetFileFormat()
        flt = pads.field(BUCKET).isin(buckets) & pads.field(KEY).isin(users)
        pieces = []
        for frag, rows in _fragments(fmt, fs, prefix, acts, ds.schema.field(BUCKET).type):
            if rows is not None and rows <= ROW_GROUP_ROWS:  # one row group at most: no footer read to prune it
                pieces.append(frag)
                continue
            keep = _row_groups_holding(frag.metadata, users)
            if keep:
                pieces.append(frag.subset(row_group_ids=keep))
        if not pieces:
            return _frame(ds.schema.empty_table().select(cols) if cols else ds.schema.empty_table())
        return _frame(pads.FileSystemDataset(pieces, ds.schema, fmt, fs).to_table(filter=flt, columns=cols))

    def read_buckets(self, table: str, buckets: Iterable[int], columns: list[str] | None = None,
                     where=None) -> pl.DataFrame | None:
        """Rows of the given user buckets only (Delta partition pruning on `user_bucket`: no file of
        another bucket is opened), optionally filtered by a pyarrow expression `where`; store columns
        included; None when the table does not exist. `files_read[table]` counts the files opened."""
        dt = self._open(table)
        if dt is None:
            return None
        buckets = sorted({int(b) for b in buckets})
        ds = dt.to_pyarrow_dataset()
        cols = None if columns is None else list(dict.fromkeys([*columns, KEY, PLACEHOLDER]))
        fs, base = self.filesystem()
        acts = pl.DataFrame(dt.get_add_actions(flatten=True))
        if acts.height:
            acts = acts.filter(pl.col(f"partition.{BUCKET}").is_in(buckets))
        fmt = pads.ParquetFileFormat()
        pieces = [frag for frag, _ in _fragments(fmt, fs, f"{base}/{table}", acts, ds.schema.field(BUCKET).type)]
        with self._counts_lock:
            self.files_read[table] += len(pieces)
        if pieces:
            arrow = pads.FileSystemDataset(pieces, ds.schema, fmt, fs).to_table(filter=where, columns=cols)
        else:
            arrow = ds.schema.empty_table().select(cols) if cols else ds.schema.empty_table()
        df = pl.from_arrow(arrow)
        return self._restore(dt, df)

    def users_in(self, table: str) -> list[str]:
        df = self.read(table, columns=[KEY])
        return [] if df is None else sorted(df[KEY].unique().to_list())

    def files(self, table: str) -> list[str]:
        dt = self._open(table)
        return [] if dt is None else dt.file_uris()

    def version(self, table: str) -> int | None:
        dt = self._open(table)
        return None if dt is None else dt.version()

    def identity(self, table: str) -> tuple[str, int] | None:
        """(the table's id, its version): one state of one table, even across a root deleted and
        created again at the same path (a new table gets a new id); None when it does not exist."""
        dt = self._open(table)
        return None if dt is None else (dt.metadata().id, dt.version())

    def content_state(self, table: str) -> str | None:
        """A digest of the table's data files: the same digest, the same rows. Unlike the version it
        stays put across commits that change no rows (a lease's fence, an empty replace)."""
        dt = self._open(table)
        if dt is None:
            return None
        return hashlib.sha256("\n".join(sorted(dt.file_uris())).encode()).hexdigest()[:16]

    def user_state(self, table: str, user: str) -> str | None:
        """A digest of the data files that may hold `user`'s rows (its bucket's files whose key range
        covers it): the same digest, the same rows of that user, found from the log alone. None when
        the table does not exist."""
        dt = self._open(table)
        if dt is None:
            return None
        acts = pl.DataFrame(dt.get_add_actions(flatten=True))
        part, lo, hi = f"partition.{BUCKET}", f"min.{KEY}", f"max.{KEY}"
        if acts.height:
            acts = acts.filter(pl.col(part).cast(pl.Int64) == user_bucket(user, int(self._meta(dt)["user_buckets"])))
            if lo in acts.columns and hi in acts.columns:
                acts = acts.filter(pl.col(lo).is_null() | pl.col(hi).is_null()
                                   | ((pl.col(lo) <= user) & (pl.col(hi) >= user)))
        paths = sorted(acts["path"].to_list()) if acts.height else []
        return hashlib.sha256("\n".join([dt.metadata().id, *paths]).encode()).hexdigest()[:16]

    def _restore(self, dt: DeltaTable, df: pl.DataFrame) -> pl.DataFrame:
        hints = {c: _dtype_from_str(s) for c, s in self._meta(dt).get("dtypes", {}).items() if c in df.columns}
        return df.cast(hints) if hints else df

    # ------------------------------------------------------------------ writes
    def replace(self, table: str, parts: dict[str, pl.DataFrame], *, operation: str = "replace") -> int:
        """Replace the rows of each user in `parts` (user -> rows; an empty frame records "no rows")
        with one Delta commit. Returns the table version written (-1 when `parts` is empty)."""
        if not parts:
            return -1
        frames = [f.with_columns(pl.lit(u, pl.String).alias(KEY)) for u, f in parts.items() if f.height]
        empty = [u for u, f in parts.items() if not f.height]
        nonempty = [f for f in parts.values() if f.height]
        template = pl.concat([f.clear() for f in nonempty or parts.values()], how="diagonal_relaxed")
        return self._write(table, list(parts), frames, empty, template, operation)

    def replace_keyed(self, table: str, users: list[str], rows: pl.DataFrame, key_column: str = "user_id",
                      placeholders: bool = True) -> int:
        """Like `replace`, with every row's user taken from `key_column` (one frame, no per-user split).
        Users without rows are recorded empty (`placeholders`) or simply left with no rows."""
        users = list(dict.fromkeys(users))
        if not users:
            return -1
        keys = rows.get_column(key_column).cast(pl.String)
        present = set(keys.unique().to_list()) if rows.height else set()  # once: it hashes every row's key
        if rows.height:
            extra = present - {None} - set(users)
            if keys.null_count() or extra:
                raise ValueError(f"table {table}: rows for users outside this replace ({sorted(extra)[:5]}, "
                                 f"{keys.null_count()} without {key_column})")
        frames = [rows.with_columns(keys.alias(KEY))] if rows.height else []
        empty = [u for u in users if u not in present] if placeholders else []
        if not frames and not empty and self._open(table) is None:
            return -1  # nothing to remove from a table that does not exist
        return self._write(table, users, frames, empty, rows, "replace")

    def append(self, table: str, rows: pl.DataFrame, key_column: str = "user_id", guarded: bool = True) -> int:
        """Add rows (keyed by `key_column`) without touching existing ones: one commit (checkpoints).
        `guarded=False` only for the forget registry itself (its rows are tombstones, not users)."""
        if not rows.height:
            return -1
        keys = rows.get_column(key_column).cast(pl.String)
        if keys.null_count():
            raise ValueError(f"table {table}: {keys.null_count()} rows without {key_column}")
        users = sorted(keys.unique().to_list())
        return self._write(table, users, [rows.with_columns(keys.alias(KEY))], [], rows, "append", guarded=guarded)

    def delete(self, table: str, users: Iterable[str]) -> int:
        """Delete every row of `users` (one commit); returns rows deleted."""
        users = sorted(set(users))
        dt = self._open(table)
        if dt is None or not users:
            return 0
        n = int(self._meta(dt)["user_buckets"])
        # a failed delete's rewritten files hold the bucket's other users, a forgotten one among them maybe
        return self._delete_rows(table, self._predicate(users, n), {"qumem.operation": "delete", "qumem.users": str(len(users))},
                                 dead_in={user_bucket(u, n) for u in users})

    def delete_where(self, table: str, predicate: str, *, operation: str) -> int:
        """Delete the rows matching a SQL `predicate` over data columns, in one commit (retried on
        conflicts): housekeeping that is not about users (run_users' retention). Returns rows deleted.
        A failed attempt's rewritten files may hold a user erased meanwhile: removed as in `delete`."""
        dt = self._open(table)
        if dt is None:
            return 0
        return self._delete_rows(table, predicate, {"qumem.operation": operation},
                                 dead_in=range(int(self._meta(dt)["user_buckets"])))

    def _delete_rows(self, table: str, predicate: str, custom: dict[str, str], dead_in: Iterable[int]) -> int:
        """One delete commit, retried on conflicts; after a failed attempt, the dead files of erased
        users in the buckets `dead_in` are removed (its rewrites may hold them)."""
        dead_in = sorted(set(dead_in))
        for attempt in range(COMMIT_RETRIES):
            dt = self._open(table)
            if dt is None:
                return 0
            try:
                res = dt.delete(predicate, writer_properties=_WRITER, commit_properties=self._commit_properties(dt, custom),
                                post_commithook_properties=_NO_HOOKS)
            except (CommitFailedError, DeltaError, OSError) as exc:
                self._remove_dead_in_buckets(table, dead_in)
                if not _is_conflict(exc) or attempt == COMMIT_RETRIES - 1:
                    raise
                _backoff(attempt)
                self._tables.pop(table, None)
                continue
            self._after_commit(table, dt.version())
            return int(res.get("num_deleted_rows", 0) or 0)
        return 0  # pragma: no cover

    def remove_dead_files(self, table: str, users: Iterable[str]) -> list[str]:
        """In the buckets of `users`: files the latest version does not reference that hold a row of
        any erased user (forgotten, and their forget's delete committed in every table).

        Safe beside live writers: once a user is erased no commit can add a file with their rows (a
        snapshot before the forget's epoch bump fails on the epoch; one after it dropped them from new
        rows; one before the delete rewrote a file that delete removed, and fails delta-rs' conflict
        check), so such a file is dead whoever wrote it: a killed writer, a commit that failed, or a
        concurrent forget's delete that rewrote a file on a stale snapshot. A user merely forgotten is
        not enough: a delete of another user, on a snapshot between the epoch bump and the forget's
        own delete, rewrites the bucket with their rows and may commit before it (CI hit this: the
        table then named a removed file). Waits for the buckets' staging files to settle first.
        Files without erased users are left to maintenance's vacuum."""
        dt = self._open(table)
        if dt is None:
            return []
        n = int(self._meta(dt)["user_buckets"])
        return self._remove_dead_in_buckets(table, {user_bucket(u, n) for u in users})

    def _remove_dead_in_buckets(self, table: str, buckets: Iterable[int]) -> list[str]:
        fs, base = self.filesystem()
        gone = []
        for b in sorted(set(buckets)):
            gone += self._remove_dead_in(table, fs, base, f"{base}/{table}/{BUCKET}={b}")
        return gone

    def _remove_dead_in(self, table: str, fs, base: str, bucket_dir: str) -> list[str]:
        deadline = time.monotonic() + STAGING_WAIT_S
        while True:
            infos = fs.get_file_info(pafs.FileSelector(bucket_dir, allow_not_found=True))
            live = [i for i in infos if "#" in i.base_name and i.mtime is not None
                    and time.time() - i.mtime.timestamp() < STAGING_STALL_S]
            if not live:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{bucket_dir}: a writer kept staging files for {STAGING_WAIT_S:.0f}s")
            time.sleep(0.5)
        dt = self._open(table)
        referenced = {unquote(f"{base}/{table}/{p}") for p in dt.get_add_actions(flatten=True).column("path").to_pylist()}
        gone = []
        for info in infos:
            if info.type != pafs.FileType.File or info.path in referenced:
                continue
            keys = None if "#" in info.base_name else _file_keys(fs, info.path)
            if keys is not None and not self.tombstones().erased_among(keys):
                continue
            try:
                fs.delete_file(info.path)
            except FileNotFoundError:
                continue
            gone.append(info.path[len(base) + 1:])
        return gone

    def _commit_properties(self, dt: DeltaTable, custom: dict[str, str]) -> CommitProperties:
        """Commit metadata, plus the lease fence when this store writes as a lease holder: refuse on
        a snapshot where a newer holder's fence landed (see the module docstring)."""
        if self.fence is None:
            return CommitProperties(custom_metadata=custom)
        if self.fence_scope is not None:
            table = dt.table_uri.rstrip("/").rsplit("/", 1)[-1]
            if table not in self.fence_scope:
                raise FenceScopeError(f"{self.root}: a commit to {table!r}, outside the tables fenced for this lease "
                                      f"({sorted(self.fence_scope)}): add it to the holder's table list")
        app_id, seq = self.fence
        seen = dt.transaction_version(app_id) or 0
        if seen > seq:
            raise FencedOut(f"{self.root}: a newer holder of {app_id} committed (fence {seen} > ours {seq}); "
                            "this writer lost its lease and commits nothing")
        return CommitProperties(custom_metadata=custom, app_transactions=[Transaction(app_id, seq)])

    def bump_erase_epoch(self, table: str) -> int | None:
        """A metadata commit (the erase epoch in the table description): every commit whose snapshot
        predates it fails delta-rs' conflict check and is retried on a fresh snapshot, where it reads
        the forget registry again. Returns the new epoch (None: no such table)."""
        for attempt in range(COMMIT_RETRIES):
            dt = self._open(table)
            if dt is None:
                return None
            meta = self._meta(dt)
            meta["erase_epoch"] = int(meta.get("erase_epoch", 0)) + 1
            try:
                dt.alter.set_table_description(json.dumps(meta), post_commithook_properties=_NO_HOOKS)
            except (CommitFailedError, DeltaError, OSError) as exc:
                if not _is_conflict(exc) or attempt == COMMIT_RETRIES - 1:
                    raise
                self._tables.pop(table, None)
                _backoff(attempt)
                continue
            self._after_commit(table, dt.version())
            return meta["erase_epoch"]
        return None  # pragma: no cover

    def _predicate(self, users: list[str], n: int) -> str:
        buckets = sorted({user_bucket(u, n) for u in users})
        return (f"{BUCKET} IN ({', '.join(map(str, buckets))}) AND "
                f"{KEY} IN ({', '.join(sql_literal(u) for u in sorted(users))})")

    def _write(self, table: str, users: list[str], frames: list[pl.DataFrame], empty: list[str],
               template: pl.DataFrame, operation: str, guarded: bool = True) -> int:
        for attempt in range(COMMIT_RETRIES):
            seen = self.tombstones().refresh() if guarded else None
            try:
                version = self._write_once(table, users, frames, empty, template, operation, guarded)
            except (CommitFailedError, DeltaError, OSError) as exc:
                # This attempt's files may hold a user forgotten meanwhile: one of its own, or another
                # user of a file its predicate overwrite rewrote. Cleaned up when anyone was forgotten
                # or erased during the attempt (the registry moved): the forget's own clean-up may have
                # listed the bucket before these files landed.
                if guarded and (self.tombstones().refresh() != seen or self.tombstones().forgotten_among(users, refresh=False)):
                    self.remove_dead_files(table, users)
                if not _is_conflict(exc) or attempt == COMMIT_RETRIES - 1:
                    raise
                _backoff(attempt)
                self._tables.pop(table, None)
                continue
            self._after_commit(table, version, guarded)
            return version
        raise AssertionError("unreachable")  # pragma: no cover

    def _write_once(self, table, users, frames, empty, template, operation, guarded=True) -> int:
        data_cols = [c for c in template.columns if c not in STORE_COLUMNS]
        incoming = _normalise(template.select(data_cols).schema)
        dt = self._open(table)
        if dt is None:  # created empty first: the rows go in a commit on a snapshot of the table
            self._create(table, *_evolve(table, None, incoming))
            dt = self._open(table)
        if guarded:  # the registry is read after the snapshot: see the module docstring
            users, frames, empty = self._drop_forgotten(table, users, frames, empty)
            if not users:
                return dt.version()
        table_schema = self._data_schema(dt)
        target, new_cols = _evolve(table, table_schema, incoming)
        n = int(self._meta(dt)["user_buckets"])
        df = self._layout_rows(frames, empty, data_cols, target, users, n)
        buckets = {u: user_bucket(u, n) for u in users}
        commit = self._commit_properties(dt, {"qumem.operation": operation, "qumem.users": str(len(users))})
        path = self._fast_write(table, dt, df, target, new_cols, buckets, operation, commit, n)
        with self._counts_lock:
            self.write_paths[path] += 1
        if path == WRITTEN:
            dt2 = self._reopen(table)
            return dt2.version() if dt2 is not None else -1
        if path == RACED:  # the add-only commit landed beside another writer's: replace on the latest version
            dt = self._open(table)
            if guarded:  # a newer snapshot: read the registry again after it
                users, frames, empty = self._drop_forgotten(table, users, frames, empty)
                df = self._layout_rows(frames, empty, data_cols, target, users, n)
            commit = self._commit_properties(dt, {"qumem.operation": operation, "qumem.users": str(len(users))})
        arrow = df.to_arrow()
        if new_cols:
            self._record_hints(dt, {c: t for c, t in new_cols.items() if _lossy(t)})
        append = operation == "append"
        write_deltalake(dt, arrow, mode="append" if append else "overwrite",
                        predicate=None if append else self._predicate(users, n),
                        partition_by=[BUCKET], schema_mode="merge" if new_cols else None,
                        storage_options=self.storage_options, writer_properties=_WRITER,
                        target_file_size=TARGET_FILE_SIZE, commit_properties=commit,
                        post_commithook_properties=_NO_HOOKS)
        dt2 = self._reopen(table)
        return dt2.version() if dt2 is not None else -1

    def _drop_forgotten(self, table: str, users: list[str], frames: list[pl.DataFrame], empty: list[str]):
        """Users forgotten as of now leave the write: their rows, placeholders and their place in the
        commit's predicate (which the log keeps); their stored rows are the forget's to delete."""
        gone = self.tombstones().forgotten_among(users)
        if not gone:
            return users, frames, empty
        with self._counts_lock:
            self.dropped_forgotten[table] += 1
        frames = [f.filter(~pl.col(KEY).is_in(sorted(gone))) for f in frames]
        return ([u for u in users if u not in gone], [f for f in frames if f.height],
                [u for u in empty if u not in gone])

    def _layout_rows(self, frames, empty, data_cols, target, users, n) -> pl.DataFrame:
        """The rows as stored: store columns first, each user's bucket, sorted by user_key."""
        parts = [f.select([*(c for c in data_cols if c in f.columns), KEY]) for f in frames]
        if empty:
            parts.append(pl.DataFrame({KEY: empty}, schema={KEY: pl.String}))
        df = pl.concat(parts, how="diagonal_relaxed") if parts else pl.DataFrame(schema={KEY: pl.String})
        df = _conform(df, target).with_columns(
            pl.col(KEY).is_in(empty).alias(PLACEHOLDER) if empty else pl.lit(False).alias(PLACEHOLDER))
        buckets = {u: user_bucket(u, n) for u in users}
        df = df.with_columns(pl.col(KEY).replace_strict(buckets, return_dtype=pl.Int32, default=None).alias(BUCKET))
        df = df.select([KEY, BUCKET, PLACEHOLDER, *target.keys()])
        if not df[KEY].is_sorted():  # rows usually come in user order already: skip a copy of every column
            df = df.sort(KEY, maintain_order=True)
        return df

    def _create(self, table: str, target: pl.Schema, _new: dict) -> None:
        """The table with no rows (its schema, bucket count and dtype hints); a rival creator's win is fine."""
        n = self.n_buckets or DEFAULT_BUCKETS
        empty = _conform(pl.DataFrame(schema={KEY: pl.String}), target).with_columns(
            pl.lit(False).alias(PLACEHOLDER), pl.lit(None, pl.Int32).alias(BUCKET))
        empty = empty.select([KEY, BUCKET, PLACEHOLDER, *target.keys()])
        hints = {c: _dtype_to_str(t) for c, t in target.items() if _lossy(t)}
        meta = {"tag": DESCRIPTION_TAG, "user_buckets": n, "dtypes": hints}
        try:
            commit_new_table(self.uri(table), empty.to_arrow().schema, [], partition_by=[BUCKET],
                             description=json.dumps(meta), configuration=_TABLE_CONFIG,
                             storage_options=self.storage_options,
                             commit=CommitProperties(custom_metadata={"qumem.operation": "create"}))
        except (CommitFailedError, DeltaError) as exc:
            if "exist" not in str(exc).lower() and not isinstance(exc, CommitFailedError):
                raise
        self._tables.pop(table, None)

    def _fast_write(self, table: str, dt: DeltaTable | None, df: pl.DataFrame, target: pl.Schema, new_cols: dict,
                    buckets: dict[str, int], operation: str, commit: CommitProperties, n: int) -> str:
        """Write `df` as new files plus one add-only commit (storage/file_commit.py) when the write
        removes nothing: an append, or a replace none of whose users a stored file may hold.

        Returns WRITTEN; SKIPPED (nothing written, ``dt`` is still the latest the caller knows: it writes
        through delta-rs on it); or RACED (committed, but another writer's copy of these users landed
        too: the caller replaces them through delta-rs on a freshly opened table)."""
        if new_cols or not fast_path_ok(target) or self._meta(dt).get("dtypes"):
            return SKIPPED
        if operation != "append":
            by_bucket: dict[int, list[str]] = {}
            for u, b in buckets.items():
                by_bucket.setdefault(b, []).append(u)
            if may_hold(dt, by_bucket, KEY, BUCKET):
                return SKIPPED
        fs, base = self.filesystem()
        adds = write_files(df, fs, f"{base}/{table}", key=KEY, bucket=BUCKET, row_group_rows=ROW_GROUP_ROWS,
                           target_file_bytes=TARGET_FILE_SIZE)
        commit_append(dt, adds, partition_by=[BUCKET], commit=commit)
        if operation != "append":
            # A blind append never conflicts: another writer of the same users between our check and
            # our commit would leave both copies. Then the rows are replaced through delta-rs.
            if may_hold(self._reopen(table), by_bucket, KEY, BUCKET, exclude={a.path for a in adds}):
                return RACED
        return WRITTEN

    def _data_schema(self, dt: DeltaTable) -> pl.Schema:
        arrow = _pa_schema(dt.schema().to_arrow())
        empty = self._restore(dt, pl.from_arrow(arrow.empty_table()))
        return pl.Schema({c: t for c, t in empty.schema.items() if c not in STORE_COLUMNS})

    def _record_hints(self, dt: DeltaTable, hints: dict[str, pl.DataType]) -> None:
        if not hints:
            return
        meta = self._meta(dt)
        meta.setdefault("dtypes", {}).update({c: _dtype_to_str(t) for c, t in hints.items()})
        dt.alter.set_table_description(json.dumps(meta), post_commithook_properties=_NO_HOOKS)

    # ------------------------------------------------------------------ maintenance
    def compact(self, table: str, target_size: int | None = None) -> dict:
        """Bin-pack small files (each replace adds one per touched bucket) into large ones."""
        dt = self._open(table)
        if dt is None:
            return {}
        before = dt.version()
        out = dt.optimize.compact(target_size=target_size or TARGET_FILE_SIZE, writer_properties=_WRITER,
                                  post_commithook_properties=_NO_HOOKS)
        if dt.version() != before:
            self._after_commit(table, dt.version())
        return out

    def vacuum(self, table: str, retention_hours: int | None = None, orphans_grace_hours: int | None = None) -> list[str]:
        """Delete files the table no longer references: removed ones older than `retention_hours`
        (None = the table's 7-day default), then untracked ones (orphans of killed writers) older than
        `orphans_grace_hours` (None = same as retention). retention 0 is what forgetting needs."""
        dt = self._open(table)
        if dt is None:
            return []
        grace = retention_hours if orphans_grace_hours is None else orphans_grace_hours
        before = dt.version()
        removed = dt.vacuum(retention_hours=retention_hours, dry_run=False,
                            enforce_retention_duration=retention_hours is None, post_commithook_properties=_NO_HOOKS)
        if grace is not None or retention_hours is None:
            removed += dt.vacuum(retention_hours=grace, dry_run=False, enforce_retention_duration=grace is None,
                                 full=True, post_commithook_properties=_NO_HOOKS)
        if dt.version() != before:
            self._after_commit(table, dt.version())
        base = self.uri(table).rstrip("/") + "/"
        out = {r[len(base):] if r.startswith(base) else r.lstrip("/") for r in removed}
        return sorted(out | set(self._remove_staging(table, grace)))

    def _remove_staging(self, table: str, grace_hours: int | None) -> list[str]:
        """Staging files of killed writers: delta-rs writes a local data file as `<name>#<n>` and
        renames it when complete, so a writer killed mid-file leaves one that is no Delta file and
        that vacuum never lists (found by tests/test_table_store.py's kill test: a 1.3 MB
        `….parquet#1` survived a zero-retention vacuum, user rows inside). Removed when older than
        the grace (None: the 7-day default). Object stores have no such file (an interrupted
        multipart upload is invisible; a bucket lifecycle rule aborts it)."""
        fs, base = self.filesystem()
        if not isinstance(fs, pafs.LocalFileSystem):
            return []
        hours = 7 * 24 if grace_hours is None else grace_hours
        cutoff = time.time() - hours * 3600
        prefix = f"{base}/{table}"
        gone = []
        for info in fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True)):
            rel = info.path[len(prefix) + 1:]
            if (info.type == pafs.FileType.File and _STAGING.search(info.base_name) and "_delta_log" not in rel
                    and info.mtime is not None and info.mtime.timestamp() <= cutoff):
                fs.delete_file(info.path)
                gone.append(rel)
        return gone

    # ------------------------------------------------------------------ checkpoints
    def _after_commit(self, table: str, version: int | None, guarded: bool = True) -> None:
        """Checkpoint every `CHECKPOINT_INTERVAL` versions, as delta-rs' post-commit hook did, then
        drop expired commit files (the hook's `cleanup_expired_logs`). When an erasure was under way
        or landed while the checkpoint was written, the checkpoint may come from a snapshot that still
        held the erased user's files (their statistics name them) and may have landed after the
        forget scrubbed the log: the latest version is checkpointed again and every older checkpoint
        removed (`fresh_checkpoint`, the forget's own first step). Never raises: the commit landed,
        and a checkpoint that failed is taken by a later commit (`qumem forget --verify` would find a
        user left in one)."""
        if version is None or version <= 0 or CHECKPOINT_INTERVAL <= 0 or version % CHECKPOINT_INTERVAL:
            return
        try:
            tombs = self.tombstones() if guarded else None
            seen = tombs.refresh() if tombs is not None else None
            erasing = tombs is not None and tombs.erasure_pending()
            dt = self._open(table)
            if dt is None:
                return
            self._checkpoint(dt)
            dt.cleanup_metadata()
            if tombs is not None and (erasing or tombs.refresh() != seen or tombs.erasure_pending()):
                self.fresh_checkpoint(table)
        except (CommitFailedError, DeltaError, OSError) as exc:
            _LOG.warning("table %s: checkpoint after version %s failed (%s); a later commit takes one", table, version, exc)

    @staticmethod
    def _checkpoint(dt: DeltaTable) -> None:
        dt.create_checkpoint()

    def fresh_checkpoint(self, table: str) -> int:
        """Checkpoint the latest version, then delete every checkpoint file but the newest (a stale one may
        name a user erased since). Retried when another forget replaces the checkpoint this load
        started from. Returns the version checkpointed (-1: no such table)."""
        for attempt in range(COMMIT_RETRIES):
            dt = self._open(table)
            if dt is None:
                return -1
            try:
                self._checkpoint(dt)
                break
            except (DeltaError, OSError) as exc:
                if not _log_moved(exc) or attempt == COMMIT_RETRIES - 1:
                    raise
                self._tables.pop(table, None)
                _backoff(attempt)
        fs, base = self.filesystem()
        log = f"{base}/{table}/_delta_log"
        cps = [(int(i.base_name.split(".")[0]), i.path) for i in fs.get_file_info(pafs.FileSelector(log, allow_not_found=True))
               if i.type == pafs.FileType.File and ".checkpoint." in i.base_name]
        newest = max([dt.version(), *(v for v, _ in cps)])  # another writer's may be newer than ours: keep that one
        for v, path in cps:
            if v < newest:
                self.drop_log_file(fs, path)
        return dt.version()

    @staticmethod
    def drop_log_file(fs: pafs.FileSystem, path: str) -> None:
        """Delete an old checkpoint; one a concurrent forget or writer removed first is gone either way."""
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            pass

    def expire_log(self, table: str) -> None:
        """Checkpoint the latest version and drop the older commit files (they name the users each
        commit touched): history is given up so that a forgotten user's id leaves the log too."""
        dt = self._open(table)
        if dt is None:
            return
        dt.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
        dt.update_incremental()
        dt.create_checkpoint()
        dt.cleanup_metadata()
        dt.alter.set_table_properties({"delta.logRetentionDuration": _TABLE_CONFIG["delta.logRetentionDuration"]})


# Statistics only on the key columns: pruning needs user_key, and no user text enters the log.
_TABLE_CONFIG = {
    "delta.dataSkippingStatsColumns": f"{KEY},{BUCKET}",
    "delta.logRetentionDuration": "interval 30 days",
}


# A staging file (<name>.parquet#N) not modified for this long belongs to a killed writer.
STAGING_STALL_S = float(os.environ.get("QUMEM_FORGET_STAGING_STALL_S", "30"))
STAGING_WAIT_S = float(os.environ.get("QUMEM_FORGET_STAGING_WAIT_S", "600"))


def _file_keys(fs, path: str) -> set[str] | None:
    """The user keys of a complete Parquet data file; None when it cannot be read (then it is
    treated as holding anyone); an empty set when it is gone."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(fs.open_input_file(path))
        if KEY not in pf.schema_arrow.names:
            return None
        return set(pf.read(columns=[KEY]).column(KEY).unique().to_pylist()) - {None}
    except FileNotFoundError:
        return set()
    except Exception:  # noqa: BLE001 - unreadable
        return None


def _row_groups_holding(md, users: list[str]) -> list[int]:
    """Row groups of a file whose user_key [min, max] holds one of sorted `users` (all of them
    when a group has no statistics)."""
    try:
        ci = md.schema.names.index(KEY)
    except ValueError:
        return list(range(md.num_row_groups))
    keep = []
    for i in range(md.num_row_groups):
        st = md.row_group(i).column(ci).statistics
        if st is None or not st.has_min_max:
            keep.append(i)
            continue
        j = bisect.bisect_left(users, st.min)
        if j < len(users) and users[j] <= st.max:
            keep.append(i)
    return keep


def _fragments(fmt, fs, prefix: str, acts: pl.DataFrame, bucket_type) -> list[tuple]:
    """(pyarrow fragment, rows or None) for each file of `acts` (add actions, flattened): its bucket as the
    partition expression, and its size from the log, so that opening a file on an object store does not
    first ask the store for its size (a HEAD per file: on moto's S3 server about a third of a 100-user
    read's time, `bench/store_reads.py --s3`)."""
    if not acts.height:
        return []
    rows = acts["num_records"] if "num_records" in acts.columns else pl.repeat(None, acts.height, eager=True)
    sizes = acts["size_bytes"] if "size_bytes" in acts.columns else pl.repeat(None, acts.height, eager=True)
    return [(fmt.make_fragment(f"{prefix}/{unquote(path)}", filesystem=fs, file_size=size,
                               partition_expression=pads.field(BUCKET) == pa.scalar(b, bucket_type)), n)
            for (path, b), n, size in zip(acts.select("path", f"partition.{BUCKET}").iter_rows(), rows, sizes)]


def _frame(arrow: pa.Table) -> pl.DataFrame:
    df = pl.from_arrow(arrow)
    return df if isinstance(df, pl.DataFrame) else df.to_frame()  # from_arrow of a table is a frame


def _scan_users_local(files: list[tuple[str, int]], schema: pa.Schema, bucket_of: dict[str, int],
                      cols: list[str] | None) -> pl.DataFrame:
    """Rows of the users of `bucket_of` from these local (path, bucket) files, as `_read_users`' pyarrow
    path returns them (the table's schema, `cols` in order), read by polars' Parquet scan: it prunes row
    groups on the `is_in` from their statistics itself, with a much smaller fixed cost per file than a
    pyarrow dataset. That cost is what a nightly incremental sync pays most: it reads back its users
    from their buckets' files, many of them the small files earlier runs appended (bench/ingest.py's
    incremental `merge` step, docs/benchmarks.md).

    One scan per file, each filtered on its own bucket's users, collected together (`collect_all`
    runs them in parallel): one scan of every file with the whole user list cost polars that list's
    check on every row group of every file: 1.5-1.7x the per-file scans' time on a 100-user read
    (bench/store_reads.py). Files written before a column was added get it as nulls; the partition
    column is not in the files, so it comes from the file's bucket."""
    full = pl.from_arrow(schema.empty_table()).schema
    in_files = {c: t for c, t in full.items() if c != BUCKET}
    wanted = list(full) if cols is None else list(cols)
    users_of: dict[int, list[str]] = {}
    for u, b in bucket_of.items():
        users_of.setdefault(b, []).append(u)
    scans = []
    for path, b in files:
        lf = pl.scan_parquet(path, schema=in_files, missing_columns="insert", extra_columns="ignore",
                             hive_partitioning=False, glob=False)
        lf = lf.filter(pl.col(KEY).is_in(users_of.get(b, [])))
        if BUCKET in wanted:
            lf = lf.with_columns(pl.lit(b, dtype=full[BUCKET]).alias(BUCKET))
        scans.append(lf.select(wanted))
    return pl.concat(pl.collect_all(scans), how="vertical", rechunk=False)


def _pa_schema(arrow_schema):
    import pyarrow as pa

    return pa.schema(arrow_schema)


def _normalise(schema: pl.Schema) -> pl.Schema:
    """Dtypes as the store keeps them: microsecond timestamps (Delta's resolution), Null -> String."""
    out = {}
    for c, t in schema.items():
        if isinstance(t, pl.Datetime) and t.time_unit == "ns":
            t = pl.Datetime("us", t.time_zone)
        elif t == pl.Null:
            t = pl.String
        out[c] = t
    return pl.Schema(out)


def _evolve(table: str, have: pl.Schema | None, incoming: pl.Schema) -> tuple[pl.Schema, dict]:
    """The schema rule: new nullable columns are added; a changed or dropped type is an error."""
    if have is None:
        return incoming, {}
    for c, t in incoming.items():
        if c in have and have[c] != t:
            raise SchemaEvolutionError(
                f"table {table}: column {c!r} is {have[c]} in the store but {t} in the new rows; only new "
                f"nullable columns may be added (write a migration for a type change)")
    new = {c: t for c, t in incoming.items() if c not in have}
    return pl.Schema({**dict(have), **new}), new


def _conform(df: pl.DataFrame, target: pl.Schema) -> pl.DataFrame:
    cols = []
    for c, t in target.items():
        if c in df.columns:
            cols.append(pl.col(c).cast(t) if df.schema[c] != t else pl.col(c))
        else:
            cols.append(pl.lit(None, dtype=t).alias(c))
    return df.select([pl.col(KEY), *cols])


def _is_conflict(exc: Exception) -> bool:
    if isinstance(exc, FencedOut):
        return False
    if isinstance(exc, CommitFailedError):
        return True
    msg = str(exc).lower()
    return _log_moved(exc) or _file_moved(exc) or any(s in msg for s in (
        "concurrent", "conflict", "version already exists", "transaction failed", "already exists", "precondition"))


def _file_moved(exc: Exception) -> bool:
    """A data file of this write's (stale) snapshot was removed by a forget: the write is retried on a
    fresh snapshot (a replace is idempotent), where it no longer needs that file."""
    msg = str(exc).lower()
    return ".parquet" in msg and any(s in msg for s in ("not found", "no such file"))


# A checkpoint read while another forget wrote the same version's checkpoint again: the load listed
# one file's length and read the other's (tests/test_erasure_concurrency.py hit both messages).
_TORN_CHECKPOINT_READ = ("requested range was invalid", "could not parse parquet metadata")


def _log_moved(exc: Exception) -> bool:
    """A log file this snapshot named is gone or was replaced under the load (a concurrent forget
    replaced the checkpoint it loaded from): retry on a fresh load. Data files are never retried here."""
    msg = str(exc).lower()
    return "_delta_log" in msg and any(s in msg for s in ("not found", "no such file", "does not exist")) \
        or "invalid table version" in msg or any(s in msg for s in _TORN_CHECKPOINT_READ)


def _backoff(attempt: int) -> None:
    time.sleep(min(2.0, 0.02 * (2 ** attempt)) * (0.5 + random.random()))


def filesystem_for(root: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem for a root URI; S3 honours AWS_ENDPOINT_URL / AWS_ALLOW_HTTP like delta-rs."""
    if not is_uri(root):
        return pafs.LocalFileSystem(), str(Path(root).absolute())
    scheme, _, rest = root.partition("://")
    if scheme in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kw = {"region": os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))}
        if endpoint:
            kw["endpoint_override"] = endpoint
            kw["scheme"] = "http" if endpoint.startswith("http://") else "https"
        return pafs.S3FileSystem(**kw), rest.rstrip("/")
    fs, path = pafs.FileSystem.from_uri(root)
    return fs, path.rstrip("/")
