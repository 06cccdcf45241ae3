"""Streaming, incremental ingest: bring the tables up to date with the archive, file by file.

    sync_archive(cfg, layout)   # reads only new or changed files; an unchanged archive reads none

1. The manifest (ingest/manifest.py) sorts the archive's files into new, changed, unchanged and
   gone (a stat per file; a hash only where size or mtime moved).
2. Each new or changed file is read in bounded batches (ingest/stream.py), two files at once
   (ingest/staging.py); each batch gets the row rules (validate.check_rows); its candidate rows
   are spilled to a local scratch directory, split by the table store's own user bucket
   (contracts/buckets.py; a store bucket is cut in hash pieces only when one bucket of the read is
   over the memory budget). A read of at most `IN_MEMORY_BYTES` is not spilled: it is held in
   memory, split the same way. Spilled parts are buffered per bucket and written per file (few,
   large Arrow IPC files), read back memory-mapped.
3. Spill buckets are merged in groups of whole store buckets whose staged bytes (plus stored
   history) fit `bucket_bytes`, so no step holds more than one group in memory, each store
   partition gets about one new file per run and each commit touches only its group's
   partitions (before this, each group's commit touched all 64: ~1,500 files per table at 10M
   turns, and every commit and read scanned them all). In each group every *affected* user (a
   user with rows in a read, changed or gone file) is rebuilt: their stored rows from the other
   files (turns, plus the rare rows held back as duplicates) + the new rows, through the same
   duplicate rule and history order as the whole-archive path (validate.merge_candidates).
   Turns, quarantine, duplicates, per-user file list and fingerprints are written for those
   users only, one commit per table and group, on a writer thread while the next group merges.
   A user whose stored turns are an unchanged prefix of the rebuilt history (a later file only
   added turns) gets only the new turns appended, so the files holding their history are not
   rewritten (Delta rewrites whole files on a replace); sparse tables with nothing stored and
   nothing new are not written.
4. The manifest is written last. Before any user is written, the files being read are marked
   pending in it, so a run killed half-way is finished by the next one (a pending file counts as
   changed: its rows leave every affected user first).

History order and turn_index (the rule, tested in tests/test_ingest_incremental.py): a user's
turns are ordered exactly as the whole-archive path orders them (validate._finalise_turns), with
"source order" across files = the archive's file order (sorted paths, as `expand_paths` lists
them), then the row's position in its file; turn_index numbers that order 0..N-1 per user. So
a user's history spanning several files gets the same turn_index as a one-shot read of the whole
archive, and a later file whose turns come later in that order (later timestamps, or a later
path at equal keys) only appends: every earlier turn keeps its turn_index. A file that inserts
turns before existing ones shifts the later indices, as a re-read of the whole archive would.

Rows carry their provenance in four extra turn columns: source_file_id (path relative to the
archive root), source_row, source_pos (0-based position in the file) and source_turn_index (the
explicit turn_index of the source row, if any).
"""

import fcntl
import functools
import hashlib
import math
import operator
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import polars as pl

from qumem_pipeline.contracts.buckets import DEFAULT_BUCKETS, user_bucket
from qumem_pipeline.contracts.ids import valid_user_id_expr
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.ingest.version import stage_version
from qumem_pipeline.ingest.archive import (
    _EMPTY_FINGERPRINT,
    FINGERPRINT_SCHEMA,
    WRITER_THREADS,
    ArchiveConfig,
    UserRuns,
    _in_history_order,
)
from qumem_pipeline.ingest.importers.base import RAW_COLUMNS
from qumem_pipeline.ingest.manifest import (
    FILE_USERS_SCHEMA,
    FILE_USERS_TABLE,
    MANIFEST_TABLE,
    FilePlan,
    is_keyed,
    keyed_file_ids,
    list_archive,
    manifest_frame,
    plan_files,
    read_manifest,
)
from qumem_pipeline.ingest.staging import Staging
from qumem_pipeline.ingest.stream import DEFAULT_BATCH_ROWS, DEFAULT_CHUNK_BYTES, RESTART, read_batches
from qumem_pipeline.ingest.validate import (
    DUPLICATE_REASON_PREFIX,
    KEEP_PREFIX,
    QUARANTINE_POLARS_SCHEMA,
    check_rows,
    merge_candidates,
    raise_if_bad,
)

DUPLICATES_TABLE = "turn_duplicates"
# Every table a sync (or a forget's keying of the manifest) commits to: only these carry the root's
# ingest lease fence (storage/lease.py `fenced(tables=...)`); a commit to another one while fenced raises.
INGEST_TABLES = ("turns", "quarantine", DUPLICATES_TABLE, "fingerprints", FILE_USERS_TABLE, MANIFEST_TABLE)
# A stored turn in memory, about (bench/ingest.py's generated turns): sizes the merge groups, so a
# small new file that touches users with long histories still merges in bounded pieces.
_STORED_ROW_BYTES = 400
# Scratch bytes of candidate rows per user bucket: the unit of memory of the merge step.
BUCKET_BYTES = 128 << 20
# A read of up to this many bytes of files is held in memory by bucket (no spill round trip; peak
# RSS about 2-3x it); a larger read spills by bucket. Either way it merges in groups of
# `bucket_bytes`. A caller that sets `bucket_bytes` (a smaller unit) gets it as this limit too.
IN_MEMORY_BYTES = 512 << 20
# Spilled candidates are buffered per bucket and written one Arrow IPC file per bucket when the
# buffers of the files being read hold this many bytes or a file ends: few large scratch files
# (each costs a fixed open/write/read overhead that 64 buckets x every batch made a third of the
# spill's CPU). ingest/staging.py.
SPILL_FLUSH_BYTES = 256 << 20
_FILE_RANK_STRIDE = 1 << 40  # _pos = file rank * 2^40 + position in file (files of < 10^12 rows)
PROVENANCE = {"source_file_id": pl.String, "source_row": pl.Int64, "source_pos": pl.Int64, "source_turn_index": pl.Int64}
_KEEP = {KEEP_PREFIX + k: v for k, v in PROVENANCE.items()}


def ingest_version(cfg: ArchiveConfig) -> str:
    """Rows ingested under other rules are re-ingested: the code version and the text limit."""
    return f"{stage_version('turns')}:max_text={cfg.max_text_chars}"


@dataclass
class SyncReport:
    new: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    unchanged: int = 0
    files_read: int = 0
    users_rebuilt: int = 0
    rows_read: int = 0
    quarantined_read: int = 0
    # Bytes of candidate rows written to this host's scratch (0 when the read was held in memory): the
    # local disk a sync of that size needs, at most this much at once.
    spilled_bytes: int = 0
    seconds: float = 0.0
    # Seconds by step. The fixed steps (lock: this host's lock and the root's lease; plan: archive
    # listing, manifest read, change detection; manifest: its pending and final writes) are most of an
    # incremental run's time, so they are timed too (bench/ingest.py: `incremental_stages_s`).
    stages_s: dict = field(default_factory=lambda: {"lock": 0.0, "plan": 0.0, "manifest": 0.0, "read_check_spill": 0.0,
                                                             "take": 0.0, "merge": 0.0, "fingerprints": 0.0, "write": 0.0,
                                                             "write_wait": 0.0})

    def _add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.stages_s[stage] = round(self.stages_s[stage] + now - since, 3)
        return now

    @property
    def touched(self) -> bool:
        return bool(self.new or self.changed or self.gone)


def sync_archive(
    cfg: ArchiveConfig,
    layout,
    forgotten=None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    bucket_bytes: int = BUCKET_BYTES,
    memory_bytes: int | None = None,
    now: datetime | None = None,
    reader: str = "auto",
    before_commit=None,
    progress=None,
) -> SyncReport:
    """Ingest the archive's new and changed files, drop its gone files' rows (see the module doc).

    `progress(stage, done, total)`, when given, is called as files are read ("archive files read")
    and as users are rebuilt ("users rebuilt").

    `before_commit(turns, quarantine)` sees each group's rows before they are written and may
    raise to stop the sync (blocking checks): nothing of that group is written, groups written
    before it stay, and the files stay pending, so the next sync redoes them."""
    t0 = time.perf_counter()
    with _exclusive(layout) as lease:
        t_locked = time.perf_counter()
        # the registry as of now, not as of when the caller built it: a forget that keyed its files
        # while this sync waited for the lock must not be undone by a plan made on the older read
        if getattr(forgotten, "tombstones", None) is not None:
            forgotten.tombstones.refresh()
        version = ingest_version(cfg)
        plan = plan_files(list_archive(cfg.path, cfg.format), read_manifest(layout), version, keyed=_file_keyer(forgotten))
        report = SyncReport(new=[f.file_id for f in plan.new], changed=[f.file_id for f in plan.changed],
                            gone=list(plan.gone), unchanged=len(plan.unchanged))
        report.stages_s["lock"] = round(t_locked - t0, 3)
        report._add("plan", t_locked)
        if plan.touched:
            job = _Sync(cfg, layout, forgotten, plan, version, report, now)
            job.reader, job.before_commit, job.lease, job.progress = reader, before_commit, lease, progress
            if memory_bytes is None:
                memory_bytes = IN_MEMORY_BYTES if bucket_bytes == BUCKET_BYTES else bucket_bytes
            job.run(chunk_bytes, batch_rows, bucket_bytes, memory_bytes)
        elif plan.hashes:  # touched, same bytes: remember the new mtime so the hash is not redone
            _write_manifest(layout, plan, {}, version)
    report.seconds = round(time.perf_counter() - t0, 3)
    return report


@dataclass(frozen=True)
class ArchiveLook:
    """What a tick may know of the archive without reading a file: its listing against the manifest."""

    files: int
    new: int
    changed: int  # size or mtime moved (not hashed: a touched file counts), pending, or older ingest rules
    gone: int
    # digest of the listing (file ids, sizes, mtimes) and the ingest version: what a sync is planned on. Not
    # of the manifest's verdict, which a failed sync moves (its files marked pending) on the same archive
    state: str

    @property
    def behind(self) -> bool:
        """The tables may not hold what the archive holds: a sync has work (or at least a hash) to do."""
        return bool(self.new or self.changed or self.gone)


def look_at_archive(cfg: ArchiveConfig, layout, forgotten=None) -> ArchiveLook:
    """The archive's listing (a stat per file) against the ingest manifest (one row per file), with
    no file opened, no lock taken and nothing written: what the discovery sensor and the archive
    sync schedule check before they request an `archive_sync` run (assets/archive_sync.py)."""
    version = ingest_version(cfg)
    files = list_archive(cfg.path, cfg.format)
    plan = plan_files(files, read_manifest(layout), version, keyed=_file_keyer(forgotten), hash_moved=False)
    h = hashlib.sha256(version.encode())
    for f in files:
        h.update(f"{f.file_id}\t{f.size}\t{f.mtime_ns}\n".encode())
    return ArchiveLook(len(files), len(plan.new), len(plan.changed), len(plan.gone), h.hexdigest())


def _host_path(layout, suffix: str) -> Path:
    """This host's lock file (".lock") or scratch parent (".scratch") of the layout's data root."""
    key = hashlib.sha256(str(getattr(layout, "root", id(layout))).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"qumem-ingest-{key}{suffix}"


@contextmanager
def _exclusive(layout):
    """One sync at a time per data root (two would rebuild the same users): a file lock among this
    machine's processes, then the root's ingest lease among hosts (storage/lease.py) when the
    layout is the table store, its fence on the store's commits while held. Yields the lease
    (None without a store): check it before writes."""
    with open(_host_path(layout, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # A sync killed on this host left its spill files (users' raw turns) here; under the lock no
        # sync of this root runs on this host, so whatever is left is dead: removed by the next sync
        # or forget (key_forgotten_files) that takes the lock here.
        shutil.rmtree(_host_path(layout, ".scratch"), ignore_errors=True)
        store = getattr(layout, "store", None)
        if store is None:
            yield None
            return
        from qumem_pipeline.storage.lease import fenced, held

        # fenced: every commit of the sync carries the lease's fencing token (a holder that lost
        # the lease, even one paused past its ttl, commits nothing: storage/lease.py)
        with held(store.root, "ingest", storage_options=store.storage_options) as lease, \
                fenced(lease, store, tables=INGEST_TABLES):
            yield lease


class _Sync:
    def __init__(self, cfg, layout, forgotten, plan: FilePlan, version: str, report: SyncReport, now):
        self.cfg, self.layout, self.forgotten, self.plan = cfg, layout, forgotten, plan
        self.version, self.report, self.now = version, report, now
        self.rank = {f.file_id: i for i, f in enumerate(plan.files)}
        # Rows of these files leave the tables: read again (new, changed, pending) or gone.
        self.dropped = {f.file_id for f in plan.to_read} | set(plan.gone)
        self.path_ids = {r["path"]: fid for fid, r in plan.old.items()} | {str(f.path): f.file_id for f in plan.files}
        self.file_stats: dict[str, dict] = {}
        self.lease = None  # the root's ingest lease (storage/lease.py), set by sync_archive
        self.progress = None  # progress(stage, done, total), set by sync_archive
        self.staged_users: list[pl.DataFrame] = []
        self.staging: Staging | None = None
        self._keys_lock, self._forgotten_lock = threading.Lock(), threading.Lock()

    def run(self, chunk_bytes: int, batch_rows: int, bucket_bytes: int, memory_bytes: int | None = None) -> None:
        read_bytes = sum(f.size for f in self.plan.to_read)
        # Spill by the store's own user buckets (cut into `n_sub` pieces when one store bucket of
        # the read is over the memory budget), so each merge group covers whole store partitions:
        # every partition gets about one new file per run, and each commit touches only its group's.
        self.n_store = _store_buckets(self.layout)
        self.spill = read_bytes > (bucket_bytes if memory_bytes is None else memory_bytes)
        self.n_sub = max(1, math.ceil(read_bytes / self.n_store / bucket_bytes))
        self._bucket_of: dict[str, int] = {}
        parent = _host_path(self.layout, ".scratch")
        parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="sync-", dir=parent))
        self._writer, self._pending_write = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qumem-ingest-write"), None
        self._store_lock = threading.Lock()
        try:
            # Pending first: a run killed from here on is redone by the next (see module doc). Written on
            # the writer thread while the files are read: its writes run in order, so the mark lands
            # before any user's rows, and a failed mark is raised before the first group is written.
            def pending() -> None:
                t = time.perf_counter()
                _write_manifest(self.layout, self.plan, {}, self.version, pending=True)
                self.report._add("manifest", t)

            self._submit(pending)
            t = time.perf_counter()
            new_q = self._stage(scratch, chunk_bytes, batch_rows)
            self.report._add("read_check_spill", t)
            users_by_key = self._affected_users(new_q)
            attributed = new_q.filter(valid_user_id_expr())
            history = self._stored_rows([u for us in users_by_key.values() for u in us])
            max_rows = max(1, bucket_bytes // _STORED_ROW_BYTES)
            n_users, rebuilt = sum(len(us) for us in users_by_key.values()), 0
            if self.progress is not None:
                self.progress("users rebuilt", 0, n_users)
            for keys in self._key_groups(users_by_key, history, bucket_bytes):
                users_all = [u for k in keys for u in users_by_key[k]]
                groups = _groups(users_all, history, max_rows) if len(keys) == 1 or not self.spill else [users_all]
                t = time.perf_counter()
                staged = self._take(keys)
                self.report._add("take", t)
                for users in groups:
                    mine = staged if len(groups) == 1 else staged.filter(pl.col("user_id").is_in(users))
                    self._rebuild(users, mine, attributed.filter(pl.col("user_id").is_in(users)))
                    rebuilt += len(users)
                    if self.progress is not None:
                        self.progress("users rebuilt", rebuilt, n_users)
                del staged
            t = time.perf_counter()
            self._drain()
            self.report._add("write_wait", t)
            self._rebuild_unattributed(new_q.filter(~valid_user_id_expr()))
        finally:
            # A failure elsewhere still lets the write in flight finish before the lock is released.
            self._writer.shutdown(wait=True)
            shutil.rmtree(scratch, ignore_errors=True)
        if self.lease is not None:
            self.lease.check()
        t = time.perf_counter()
        _write_manifest(self.layout, self.plan, self.file_stats, self.version, keyer=_file_keyer(self.forgotten))
        self.report._add("manifest", t)

    def _take(self, keys: list[int]) -> pl.DataFrame:
        """One merge group's staged candidates, whole (staging.py `take`, provenance put back). Spilled
        parts are gathered without the derived columns (a concat would fill them with nulls first)."""
        empty = _empty_candidates()
        if self.spill:
            empty = empty.drop(list(self._DERIVED))
        return self._with_provenance(self.staging.take(keys, empty))

    def _key_groups(self, users_by_key: dict[int, list[str]], history: dict[str, int],
                    bucket_bytes: int) -> list[list[int]]:
        """Spill keys (store bucket order) cut into runs whose staged bytes plus stored history
        stay under `bucket_bytes`: one merge and one commit per table for each run (held in
        memory or spilled alike, so each run's writes overlap the next run's merge)."""
        def cost(k: int) -> int:
            return self.staging.cost(k) + _STORED_ROW_BYTES * sum(history.get(u, 0) for u in users_by_key[k])

        return _pack(sorted(users_by_key), cost, bucket_bytes)

    # --- 2. read, check, spill -------------------------------------------------------------
    def _stage(self, scratch: Path, chunk_bytes: int, batch_rows: int) -> pl.DataFrame:
        """Read every new/changed file once, several at once (ingest/staging.py); stage candidates
        by spill key (spilled, or held in memory); return the quarantine rows, in archive order."""
        self.staging = Staging(scratch, self.spill, self._prepare, self._keys, SPILL_FLUSH_BYTES,
                               slim=self._spill_form, restore=self._from_spill_form)
        quarantine = []
        if self.progress is not None:
            self.progress("archive files read", 0, len(self.plan.to_read))
        for f, staged in self.staging.files(list(enumerate(self.plan.to_read)), chunk_bytes=chunk_bytes,
                                            batch_rows=batch_rows, reader=self.reader):
            quarantine += staged.quarantine
            self.staged_users += staged.users
            self.file_stats[f.file_id] = {"sha256": staged.digest, "rows": staged.rows, "quarantined": staged.bad}
            self.report.files_read += 1
            self.report.rows_read += staged.rows
            if self.progress is not None:
                self.progress("archive files read", self.report.files_read, len(self.plan.to_read))
            self.report.quarantined_read += staged.bad
        self.report.spilled_bytes = self.staging.spilled_file_bytes
        return pl.concat(quarantine, how="vertical") if quarantine else pl.DataFrame(schema=QUARANTINE_POLARS_SCHEMA)

    def _prepare(self, batch, f, pos: int) -> tuple[pl.DataFrame, pl.DataFrame]:
        """One batch of file `f` through the row rules: (candidates with provenance, quarantine)."""
        good, q = check_rows(batch, max_text_chars=self.cfg.max_text_chars, now=self.now, pos_offset=pos)
        q = self._not_forgotten(q.drop("_parse"))
        if self.cfg.strict:
            raise_if_bad(q)
        good = self._not_forgotten(good).with_columns(
            **{KEEP_PREFIX + "source_file_id": pl.lit(f.file_id),
               KEEP_PREFIX + "source_row": pl.col("source_row"),
               KEEP_PREFIX + "source_pos": pl.col("_pos"),
               KEEP_PREFIX + "source_turn_index": pl.col("turn_index")},
        ).with_columns(_pos=pl.col("_pos") + self.rank[f.file_id] * _FILE_RANK_STRIDE)
        return good, q

    # Candidate columns a spilled part leaves out (all set by `_prepare`): copies of another column
    # or functions of `_pos`, put back once per merge group (`_with_provenance`).
    _DERIVED = (KEEP_PREFIX + "source_file_id", KEEP_PREFIX + "source_row", KEEP_PREFIX + "source_pos",
                KEEP_PREFIX + "source_turn_index")

    def _spill_form(self, good: pl.DataFrame, read_rank: int) -> pl.DataFrame:
        """Staged candidates of the `read_rank`-th file read, as spilled: without the derived
        columns, and without `source_file` when every row names the file's own path (the readers
        set it so; an importer that sets something else keeps it)."""
        drop = list(self._DERIVED)
        if good["source_file"].eq_missing(str(self.plan.to_read[read_rank].path)).all():
            drop.append("source_file")
        return good.drop(drop)

    def _from_spill_form(self, part: pl.DataFrame, read_rank: int) -> pl.DataFrame:
        if "source_file" in part.columns:
            return part
        return part.with_columns(source_file=pl.lit(str(self.plan.to_read[read_rank].path), dtype=pl.String))

    def _with_provenance(self, staged: pl.DataFrame) -> pl.DataFrame:
        """The derived columns `_spill_form` left out, for a whole merge group at once (rows held in
        memory carry them already)."""
        if not self.spill:
            return staged
        file_rank = pl.col("_pos") // _FILE_RANK_STRIDE
        ids = {i: f.file_id for i, f in enumerate(self.plan.files)}
        return staged.with_columns(**{
            KEEP_PREFIX + "source_file_id": file_rank.replace_strict(ids, return_dtype=pl.String),
            KEEP_PREFIX + "source_row": pl.col("source_row"),
            KEEP_PREFIX + "source_pos": pl.col("_pos") - file_rank * _FILE_RANK_STRIDE,
            KEEP_PREFIX + "source_turn_index": pl.col("turn_index"),
        })

    def _keys(self, users: pl.Series) -> pl.Series:
        """Spill key of each row's user: store bucket * n_sub + a hash piece of it."""
        cache = self._bucket_of
        with self._keys_lock:  # files are read on several threads (ingest/staging.py)
            mine = {}
            for u in users.unique().to_list():
                b = cache.get(u)
                if b is None:
                    b = cache[u] = user_bucket(u, self.n_store)
                mine[u] = b
        store = users.replace_strict(mine, return_dtype=pl.Int64)
        if self.n_sub == 1:
            return store.alias("_bucket")
        return (store * self.n_sub + (users.hash(seed=0) % self.n_sub).cast(pl.Int64)).alias("_bucket")

    def _not_forgotten(self, df: pl.DataFrame) -> pl.DataFrame:
        if self.forgotten is None or not len(self.forgotten) or df.height == 0:
            return df
        with self._forgotten_lock:  # files are read on several threads (ingest/staging.py)
            gone = [u for u in df["user_id"].drop_nulls().unique().to_list() if self.forgotten.contains(u)]
        return df.filter(pl.col("user_id").is_null() | ~pl.col("user_id").is_in(gone)) if gone else df

    def _affected_users(self, new_q: pl.DataFrame) -> dict[int, list[str]]:
        """spill key -> users to rebuild: users of the files read, plus the old users of changed,
        pending and gone files (from the per-user file lists)."""
        frames = list(self.staged_users)
        frames.append(new_q.filter(valid_user_id_expr()).select("user_id"))
        if self.plan.changed or self.plan.gone:
            held = self.layout.read_table(FILE_USERS_TABLE)
            if held is not None:
                frames.append(held.filter(pl.col("file_id").is_in(sorted(self.dropped))).select("user_id"))
        users = pl.concat(frames, how="vertical").unique()
        users = users.with_columns(_b=self._keys(users["user_id"]))
        if self.forgotten is not None and len(self.forgotten):
            users = users.filter(~pl.col("user_id").map_elements(self.forgotten.contains, return_dtype=pl.Boolean))
        return {b: sorted(g["user_id"].to_list()) for (b,), g in users.partition_by("_b", as_dict=True).items()}

    # --- 3. rebuild the affected users of one bucket ------------------------------------------
    def _stored_rows(self, users: list[str]) -> dict[str, int]:
        """Rows each affected user already has in the tables (their fingerprint's n_turns)."""
        if not users or not self.plan.old:
            return {}
        fp = self.layout.read_table("fingerprints", sorted(users))  # user order: no sort back
        return {} if fp is None else dict(fp.select("user_id", "n_turns").iter_rows())

    def _read_stored(self, users: list[str]) -> dict[str, pl.DataFrame | None]:
        """What these users hold now in the tables a rebuild reads (turns, duplicates, quarantine and,
        in the table store, their file list), read at once on threads: each read is mostly pyarrow
        and delta-rs, which release the GIL, and on an incremental run these reads were a third of
        its time one after another. None for every table before there is a manifest (see _kept)."""
        held = dict.fromkeys(["turns", DUPLICATES_TABLE, "quarantine", FILE_USERS_TABLE])
        if not self.plan.old:
            return held
        tables = [t for t in held if t != FILE_USERS_TABLE or (hasattr(self.layout, "store") and not self._only_new_files)]
        # in user order, as the store returns them: `users` comes in spill-key order, and asking for that
        # order made each read sort its rows back into it (and `_appendable` sort them again)
        users = sorted(users)
        with self._store_lock, ThreadPoolExecutor(max_workers=len(tables), thread_name_prefix="qumem-ingest-read-back") as pool:
            # one table per thread: a table's handle is never used by two threads at once
            held.update(zip(tables, pool.map(lambda t: self.layout.read_table(t, users), tables)))
        return held

    def _source_order(self) -> pl.Expr:
        """`_pos` of a candidate: its file's rank in the archive, then its position in the file
        (staged rows get it as they are read, stored rows as they are merged back)."""
        return (pl.col(KEEP_PREFIX + "source_file_id").replace_strict(self.rank, return_dtype=pl.Int64) * _FILE_RANK_STRIDE
                + pl.col(KEEP_PREFIX + "source_pos"))

    def _rebuild(self, users: list[str], staged: pl.DataFrame, new_q: pl.DataFrame) -> None:
        t = time.perf_counter()
        parts = [staged]
        held = self._read_stored(users)
        stored_turns, stored_dups, old_q = held["turns"], held[DUPLICATES_TABLE], held["quarantine"]
        if self.plan.old:  # with no manifest yet, stored rows belong to files read again (see _kept)
            stored = [_turns_to_candidates(self._kept(stored_turns)), _duplicates_to_candidates(self._kept(stored_dups))]
            parts += [p.with_columns(_pos=self._source_order()) for p in stored if p is not None]
        candidates = pl.concat([_empty_candidates()] + parts, how="diagonal_relaxed")
        # Staged rows alone (nothing stored to merge back) are in source order within each user
        # (staging.py: a key's parts in archive order); stored rows come after them out of order.
        turns, dups, dup_q = merge_candidates(candidates, ordered_per_user=len(parts) == 1)
        if self.cfg.strict:
            raise_if_bad(dup_q)
        kept_q = None
        if old_q is not None:
            kept_q = old_q.filter(~pl.col("source_file").replace_strict(self.path_ids, default="").is_in(sorted(self.dropped))
                                  & ~pl.col("reason").str.starts_with(DUPLICATE_REASON_PREFIX))
        quarantine = pl.concat([q for q in (kept_q, new_q, dup_q) if q is not None], how="vertical_relaxed")
        quarantine = quarantine.cast(dict(QUARANTINE_POLARS_SCHEMA)).select(list(QUARANTINE_POLARS_SCHEMA))
        dup_rows = _candidates_to_duplicates(dups)
        file_users = pl.concat([
            _distinct_runs(turns.select("user_id", file_id="source_file_id")),
            dup_rows.select("user_id", file_id="source_file_id"),
            quarantine.select("user_id", file_id=pl.col("source_file").replace_strict(self.path_ids, default=None)),
        ], how="vertical").drop_nulls().unique().sort("user_id", "file_id").cast(FILE_USERS_SCHEMA)
        t = self.report._add("merge", t)
        # Fingerprints are hashed while the turns are written (building lines and BLAKE3 release the
        # GIL); the writer waits for them only before it writes the fingerprints table, last.
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qumem-fingerprints")
        runs = UserRuns(turns)
        fp_blocks = [pool.submit(b.hash) for b in runs.fingerprint_blocks()]
        pool.shutdown(wait=False)
        n_q = dict(quarantine.group_by("user_id").len().iter_rows()) if quarantine.height else {}
        n_t = runs.counts

        def fingerprints() -> pl.DataFrame:
            t = time.perf_counter()
            fps: dict[str, str] = {}
            for block in fp_blocks:
                fps.update(block.result())
            self.report._add("fingerprints", t)  # the wait for them, past the writes they overlapped
            return pl.DataFrame(
                {"user_id": users, "fingerprint": [fps.get(u, _EMPTY_FINGERPRINT) for u in users],
                 "n_turns": [n_t.get(u, 0) for u in users], "n_quarantined": [n_q.get(u, 0) for u in users],
                 "code_version": [stage_version("turns")] * len(users)},
                schema=FINGERPRINT_SCHEMA,
            )

        if self.before_commit is not None:  # blocking checks on the rows: a failure commits nothing of them
            self.before_commit(turns, quarantine)

        def write() -> None:
            with self._store_lock:
                _write(time.perf_counter())

        def _write(w: float) -> None:
            if self.lease is not None:  # a host that lost the root's ingest lease writes nothing more
                self.lease.check()
            writes = [lambda: self._write_turns(users, turns, stored_turns),
                      lambda: self._write_file_users(users, file_users, held[FILE_USERS_TABLE])]
            if self._may_hold(old_q, quarantine):
                writes.append(lambda: replace_users(self.layout, "quarantine", users, quarantine))
            if self._may_hold(stored_dups, dup_rows):
                writes.append(lambda: replace_users(self.layout, DUPLICATES_TABLE, users, dup_rows))
            self._write_tables(writes)
            # Recorded only after the users' data is in place: a fingerprint vouches for its turns.
            replace_users(self.layout, "fingerprints", users, fingerprints(), dense=True)
            self.report._add("write", w)
            self.report.users_rebuilt += len(users)

        self._submit(write)

    def _write_tables(self, writes: list) -> None:
        """The users' data tables, each its own commit, written at once on threads (one table per
        thread, as `_read_stored` reads them): on an incremental run each commit is mostly fixed
        waits (log reads, the registry check, the commit's put) that overlap. All of them end
        before the fingerprints are written; the first failure is raised after the rest ended, and
        a killed run leaves its files pending, so the next sync rebuilds these users (module doc)."""
        if len(writes) == 1 or not hasattr(self.layout, "store"):
            for w in writes:
                w()
            return
        with ThreadPoolExecutor(max_workers=len(writes), thread_name_prefix="qumem-ingest-tables") as pool:
            futures = [pool.submit(w) for w in writes]
        for f in futures:
            f.result()

    def _submit(self, write) -> None:
        """Run one group's writes on the writer thread while the next group merges (delta-rs
        encodes and commits without the GIL): at most one group's writes in flight, in order."""
        t = time.perf_counter()
        self._drain()
        self._pending_write = self._writer.submit(write)
        self.report._add("write_wait", t)

    def _drain(self) -> None:
        """Wait for the group in flight; its failure is raised here."""
        pending, self._pending_write = self._pending_write, None
        if pending is not None:
            pending.result()

    def _may_hold(self, stored: pl.DataFrame | None, rows: pl.DataFrame) -> bool:
        """Whether a sparse table needs a write for these users: rows to write, or stored rows to
        remove (known only once there is a manifest: before it, stale rows may exist unread)."""
        return not self.plan.old or rows.height > 0 or (stored is not None and stored.height > 0)

    def _write_turns(self, users: list[str], turns: pl.DataFrame, stored: pl.DataFrame | None) -> None:
        """Users whose stored turns stay exactly as they are (same rows, same turn_index: a later
        file only added turns after them) get just their new turns appended, so the files that
        hold their history are not rewritten; every other user's turns are replaced."""
        tail, rest = _appendable(users, turns, stored, self.dropped) if hasattr(self.layout, "store") else (None, users)
        if tail is not None and tail.height:
            self.layout.store.append("turns", tail)
        if rest:
            mine = turns if len(rest) == len(users) else turns.filter(pl.col("user_id").is_in(rest))
            replace_users(self.layout, "turns", rest, mine, dense=True)

    @property
    def _only_new_files(self) -> bool:
        """This run reads new files only (none changed, pending or gone) over a manifest: no stored
        row leaves the tables, so no stored (user, file) pair goes away, and the pairs a rebuild
        adds are exactly those of the new files (a new file has no stored row: a killed run's files
        are listed pending, so they come back as changed). The nightly case: the stored file lists
        need not be read at all."""
        return bool(self.plan.old) and not self.plan.replaced_ids

    def _write_file_users(self, users: list[str], rows: pl.DataFrame, stored: pl.DataFrame | None) -> None:
        """Per-user file list: when no stored pair goes away, only the new pairs are appended."""
        if hasattr(self.layout, "store") and self._only_new_files:
            added = rows.filter(pl.col("file_id").is_in(sorted(f.file_id for f in self.plan.new)))
            if added.height:
                self.layout.store.append(FILE_USERS_TABLE, added)
            return
        if stored is not None:
            stored = stored.select(list(FILE_USERS_SCHEMA)).cast(FILE_USERS_SCHEMA)
            if stored.join(rows, on=list(FILE_USERS_SCHEMA), how="anti").height == 0:
                added = rows.join(stored, on=list(FILE_USERS_SCHEMA), how="anti")
                if added.height:
                    self.layout.store.append(FILE_USERS_TABLE, added)
                return
        replace_users(self.layout, FILE_USERS_TABLE, users, rows)

    def _kept(self, df: pl.DataFrame | None) -> pl.DataFrame | None:
        """Stored rows that stay: those from files not read again and not gone. Rows written
        before there was a manifest (no source_file_id) belong to files being read again."""
        if df is None or df.height == 0 or not self.plan.old or "source_file_id" not in df.columns:
            return None
        return df.filter(~pl.col("source_file_id").is_in(sorted(self.dropped)))

    def _rebuild_unattributed(self, new_q: pl.DataFrame) -> None:
        """Bad rows with no usable user id live under their own key (as before)."""
        if self._only_new_files and new_q.height == 0:
            return  # nothing added, and the stored rows come from files that all stay: not even read
        old = self.layout.read_user_table("quarantine", UNATTRIBUTED) if self.plan.old else None
        kept = None
        if old is not None:
            kept = old.filter(~pl.col("source_file").replace_strict(self.path_ids, default="").is_in(sorted(self.dropped)))
        if self.plan.old and new_q.height == 0 and (old is None or kept.height == old.height):
            return  # nothing added and nothing of a dropped file's to take out: the stored rows stand as they are
        q = pl.concat([x for x in (kept, new_q) if x is not None], how="vertical_relaxed").cast(dict(QUARANTINE_POLARS_SCHEMA))
        self.layout.write_user_table("quarantine", UNATTRIBUTED, q.select(list(QUARANTINE_POLARS_SCHEMA)))


def _appendable(users: list[str], turns: pl.DataFrame, stored: pl.DataFrame | None, dropped: set[str]) -> tuple[pl.DataFrame | None, list[str]]:
    """(the new turns of users whose stored turns are an unchanged prefix of their rebuilt history,
    the other users). A user qualifies when none of their stored rows comes from a file being
    dropped and their first n rebuilt turns equal their n stored turns in every column."""
    if stored is None or stored.height == 0 or turns.height == 0:
        return None, users
    cols = turns.columns
    if any(c not in stored.columns or stored.schema[c] != turns.schema[c] for c in cols):
        return None, users
    stored = _in_history_order(stored.select(cols))  # read back in history order already: usually no sort
    n = stored.group_by("user_id").agg(_n=pl.len(), _bad=pl.col("source_file_id").is_in(sorted(dropped)).any()
                                       | pl.col("source_file_id").is_null().any())
    have = turns.group_by("user_id").agg(_m=pl.len())
    ok = n.join(have, on="user_id", how="inner").filter(~pl.col("_bad") & (pl.col("_m") >= pl.col("_n")))
    ok_users = ok["user_id"]
    a = stored.filter(pl.col("user_id").is_in(ok_users))
    b = turns.join(ok.select("user_id", "_n"), on="user_id", how="inner", maintain_order="left")
    b = b.filter(pl.col("turn_index") < pl.col("_n"))
    b = _in_history_order(b).select(cols)
    if a.height != b.height:  # cannot happen when both are numbered 0..n-1; be safe
        return None, users
    changed = set()
    if a.height:
        differs = functools.reduce(operator.or_, [a[c].ne_missing(b[c]) for c in cols])
        changed = set(a.filter(differs)["user_id"].unique().to_list())
    good = set(ok_users.to_list()) - changed
    tail = turns.join(ok.filter(pl.col("user_id").is_in(sorted(good))).select("user_id", "_n"), on="user_id", how="inner")
    tail = tail.filter(pl.col("turn_index") >= pl.col("_n")).drop("_n")
    rest = [u for u in users if u not in good]
    return tail, rest


def _distinct_runs(pairs: pl.DataFrame) -> pl.DataFrame:
    """Rows of `pairs` that differ from the row before them: a history-ordered table's (user, file)
    pairs come in long runs, so the `unique` after hashes a few rows per user instead of every turn."""
    if pairs.height < 2:
        return pairs
    changed = functools.reduce(operator.or_, [pl.col(c).ne_missing(pl.col(c).shift()) for c in pairs.columns])
    return pairs.filter(changed.fill_null(True))


def _store_buckets(layout) -> int:
    """The store's bucket count for the turns table (fixed at its creation), or the default."""
    store = getattr(layout, "store", None)
    return store.buckets_of("turns") if store is not None else DEFAULT_BUCKETS


def _groups(users: list[str], stored: dict[str, int], max_rows: int) -> list[list[str]]:
    """Consecutive users cut so each group's stored history stays under `max_rows` rows (a user
    over it is a group of its own)."""
    return _pack(users, lambda u: stored.get(u, 0), max_rows)


def _pack(items: list, cost, budget: int) -> list[list]:
    """`items` in order, cut into consecutive runs whose summed `cost(item)` stays within `budget`
    (an item over it alone is a run of its own)."""
    groups, cur, size = [], [], 0
    for it in items:
        c = cost(it)
        if cur and size + c > budget:
            groups.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += c
    return groups + [cur] if cur else groups


# --- stored rows <-> candidate rows ---------------------------------------------------------
def _empty_candidates() -> pl.DataFrame:
    from qumem_pipeline.ingest.importers.base import ImportResult

    good, _ = check_rows(ImportResult.empty())
    return good.with_columns(**{KEEP_PREFIX + k: pl.lit(None, dtype=v) for k, v in PROVENANCE.items()})


def _turns_to_candidates(t: pl.DataFrame | None) -> pl.DataFrame | None:
    """A stored turn back into the form check_rows gives (its source turn_index and position)."""
    if t is None:
        return None
    return t.select(
        "user_id", "conversation_id", "session_id",
        turn_index=pl.col("source_turn_index"),
        role="role", speaker="speaker", text="text",
        timestamp=pl.col("timestamp").dt.strftime("%Y-%m-%dT%H:%M:%S%.6fZ"),
        source_ref="source_ref", source_file="source_file", source_row="source_row",
        _ts=pl.col("timestamp"),
        **{KEEP_PREFIX + k: pl.col(k) for k in PROVENANCE},
    )


_DUP_EXTRA = {k: v for k, v in PROVENANCE.items() if k not in RAW_COLUMNS}
_DUP_COLUMNS = list(RAW_COLUMNS) + ["parsed_timestamp"] + list(_DUP_EXTRA) + ["code_version"]


def _candidates_to_duplicates(d: pl.DataFrame) -> pl.DataFrame:
    """Rows held back as later copies of a turn id: kept whole, because removing the file of
    the first copy makes them valid again."""
    return d.select(
        *RAW_COLUMNS, parsed_timestamp=pl.col("_ts"),
        **{k: pl.col(KEEP_PREFIX + k).cast(v) for k, v in _DUP_EXTRA.items()},
        code_version=pl.lit(stage_version("turns")),
    ).select(_DUP_COLUMNS)


def _duplicates_to_candidates(d: pl.DataFrame | None) -> pl.DataFrame | None:
    if d is None:
        return None
    return d.select(*RAW_COLUMNS, _ts=pl.col("parsed_timestamp"), **{KEEP_PREFIX + k: pl.col(k) for k in PROVENANCE})



# --- writes -------------------------------------------------------------------------------
def replace_users(layout, table: str, users: list[str], df: pl.DataFrame, dense: bool = False) -> None:
    """These users' rows of `table` become `df`'s: one transaction where the layout offers
    `replace_users`; else one atomic file per user (a user with no rows: an empty file for
    `dense` tables, no file for sparse ones)."""
    if hasattr(layout, "replace_users"):  # the Delta table store: one commit
        if not dense and hasattr(layout, "replace_or_remove_users"):
            layout.replace_or_remove_users(table, users, df)
        else:
            layout.replace_users(table, users, df)
        return
    if df.height and not df["user_id"].is_sorted():
        df = df.sort("user_id", maintain_order=True)
    runs: dict[str, tuple[int, int]] = {}
    if df.height:
        start = 0
        r = df["user_id"].rle().struct.unnest()
        for u, n in zip(r["value"].to_list(), r["len"].to_list()):
            runs[u] = (start, n)
            start += n
    empty = df.clear()

    def one(u: str) -> None:
        part = df.slice(*runs[u]) if u in runs else empty
        if dense:
            layout.write_user_table(table, u, part)
        else:
            layout.write_or_remove_user_table(table, u, part)

    with ThreadPoolExecutor(max_workers=WRITER_THREADS) as pool:
        list(pool.map(one, users))


def _file_keyer(forgotten):
    """`keyed_file_ids` under the root's tombstone keys when anyone is forgotten, else None."""
    tombstones = getattr(forgotten, "tombstones", None)
    if tombstones is None or not len(forgotten):
        return None
    return lambda file_id: keyed_file_ids(tombstones, file_id)


def _keyed_row(row: dict, keyed_id: str) -> dict:
    return {**row, "file_id": keyed_id, "path": keyed_id}


def _write_manifest(layout, plan: FilePlan, stats: dict[str, dict], version: str, pending: bool = False,
                    keyer=None) -> None:
    """A file listed under a keyed id (its users all forgotten: ingest/manifest.py) stays keyed; a
    file read now that gave no row but forgotten users' (no turn, no quarantined row) is keyed."""
    rows = []
    reading = {f.file_id for f in plan.to_read}
    for f in plan.files:
        keyed = plan.keyed.get(f.file_id)
        old = plan.old.get(keyed or f.file_id)
        if f.file_id in reading:
            if pending:  # counts as changed until this run finishes it
                row = _file_row(f, "", "pending", 0, 0)
                rows.append(_keyed_row(row, keyed) if keyed else row)
            else:
                s = stats[f.file_id]
                row = _file_row(f, s["sha256"], version, s["rows"], s["quarantined"])
                if keyer is not None and s["rows"] == 0 and s["quarantined"] == 0:
                    row = _keyed_row(row, keyed or keyer(f.file_id)[0])
                rows.append(row)
        elif old is not None:
            rows.append({**old, "size": f.size, "mtime_ns": f.mtime_ns,
                         "path": old["path"] if is_keyed(old["file_id"]) else str(f.path),
                         "sha256": plan.hashes.get(f.file_id, old["sha256"])})
    if pending:  # gone files stay listed until their rows are gone
        rows += [plan.old[fid] for fid in plan.gone]
    layout.write_user_table(MANIFEST_TABLE, UNATTRIBUTED, manifest_frame(rows))


def key_forgotten_files(layout) -> int:
    """A forget's part in the manifest (after the user's rows left the tables): every file that
    holds rows and no user any more (`ingest_file_users` lists none: they were all forgotten) is
    listed under its keyed id, then the manifest's replaced files (removed by its own commits;
    they may still name such a file) are deleted. Under the root's ingest lock and lease: the sync
    is the manifest's only reader and writer, so none reads or writes it meanwhile. Idempotent (a
    rerun finds nothing left to key). Reads the whole `ingest_file_users` table's file ids once.
    Returns the files keyed."""
    from qumem_pipeline.storage.forget import ForgetRegistry

    forgotten = ForgetRegistry(layout.store.root)
    keyer = _file_keyer(forgotten)
    if keyer is None:
        return 0
    with _exclusive(layout):
        manifest = read_manifest(layout)
        held = layout.read_table(FILE_USERS_TABLE)
        if not manifest or held is None:  # no per-user file lists (an older root): nothing is known
            return 0
        holders = set(held["file_id"].unique().to_list())
        to_key = {fid for fid, r in manifest.items() if not is_keyed(fid) and (r["rows"] or 0) > 0 and fid not in holders}
        if to_key:
            rows = [_keyed_row(r, keyer(fid)[0]) if fid in to_key else r for fid, r in manifest.items()]
            layout.write_user_table(MANIFEST_TABLE, UNATTRIBUTED, manifest_frame(rows))
        dt = layout.store._open(MANIFEST_TABLE)
        if dt is not None:  # replaced versions: no reader or writer of the manifest runs beside this
            dt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
    return len(to_key)


def _file_row(f, sha: str, version: str, rows: int, quarantined: int) -> dict:
    return {"file_id": f.file_id, "path": str(f.path), "format": f.format, "size": f.size, "mtime_ns": f.mtime_ns,
            "sha256": sha, "ingest_version": version, "rows": rows, "quarantined": quarantined}


# --- reading the result ---------------------------------------------------------------------
def stored_fingerprints(layout, forgotten=None) -> dict[str, str]:
    """user -> fingerprint for every user with >= 1 turn, from the fingerprints table."""
    fp = layout.read_table("fingerprints")
    if fp is None or fp.height == 0:
        return {}
    fp = fp.filter(pl.col("n_turns") > 0)
    out = dict(fp.select("user_id", "fingerprint").iter_rows())
    if forgotten is not None and len(forgotten):
        out = {u: f for u, f in out.items() if not forgotten.contains(u)}
    return out


def validate_streamed(path: str, archive_format: str | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      batch_rows: int = DEFAULT_BATCH_ROWS, max_text_chars: int | None = None,
                      now: datetime | None = None, strict: bool = False, reader: str = "auto"):
    """The archive through the streaming reader and the split rules, held in memory: the same
    ValidationResult `validate(import_archive(path))` gives (plus the provenance columns).
    For tests and benches; `sync_archive` is the bounded-memory path."""
    from qumem_pipeline.ingest.validate import DEFAULT_MAX_TEXT_CHARS, ValidationResult

    limit = DEFAULT_MAX_TEXT_CHARS if max_text_chars is None else max_text_chars
    goods, quarantine = [], []
    for rank, f in enumerate(list_archive(path, archive_format)):
        pos = 0
        file_goods, file_q = len(goods), len(quarantine)
        for batch in read_batches(f.path, f.format, chunk_bytes=chunk_bytes, batch_rows=batch_rows, reader=reader):
            if batch is RESTART:
                del goods[file_goods:], quarantine[file_q:]
                pos = 0
                continue
            good, q = check_rows(batch, max_text_chars=limit, now=now, pos_offset=pos)
            pos += batch.raw.height
            if strict:
                raise_if_bad(q.drop("_parse"))
            quarantine.append(q.drop("_parse"))
            goods.append(good.with_columns(
                **{KEEP_PREFIX + "source_file_id": pl.lit(f.file_id), KEEP_PREFIX + "source_row": pl.col("source_row"),
                   KEEP_PREFIX + "source_pos": pl.col("_pos"), KEEP_PREFIX + "source_turn_index": pl.col("turn_index")},
                _pos=pl.col("_pos") + rank * _FILE_RANK_STRIDE,
            ))
    turns, _, dup_q = merge_candidates(pl.concat([_empty_candidates()] + goods, how="vertical_relaxed"))
    if strict:
        raise_if_bad(dup_q)
    return ValidationResult(turns=turns, quarantine=pl.concat(quarantine + [dup_q], how="vertical"))
