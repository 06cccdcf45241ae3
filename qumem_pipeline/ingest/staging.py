"""Stage a sync's files: read, check and key each file's candidate rows, several files at once.

Why: reading (polars' JSON scan, the content hash and line count, the row rules) is about half of
an ingest's CPU, and one file at a time kept it on one core while the box had two. Files are
independent (each numbers its own rows and has its own hash), and polars, BLAKE3 and the Arrow IPC
writer release the GIL, so `READ_THREADS` files are read at once; their results are taken in
archive order, so every staged key lists its rows in source order (`_pos` stays sorted and the
merge does not sort by it).

Each file's candidates are cut by spill key (store bucket, or a hash piece of one) and either
spilled (Arrow IPC, uncompressed: local scratch read back once; one file per key and flush, named
`part-<file rank>-<n>` so a key's parts list in archive order) or, for a read that fits in memory,
held by key. The merge takes whole keys either way (`take`), so a read held in memory is merged in
several groups too and each group's writes overlap the next group's merge.

A spilled part stores only what cannot be derived: the caller's `slim(frame, rank)` drops the columns
that are constant in a file or copies of another column, and `restore(frame, rank)` puts them back
as a part is read (five columns fewer: bytes written to scratch and read back cost CPU in the kernel
too; bench/ingest.py reports `spilled_bytes_per_turn`).
"""

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from qumem_pipeline.ingest.stream import RESTART, content_digest, content_hasher, read_batches

# Files read at once. Two: this box has two cores, and each read also runs its hash on a thread.
READ_THREADS = max(1, min(2, int(os.environ.get("QUMEM_INGEST_READ_THREADS", os.cpu_count() or 2))))


@dataclass
class StagedFile:
    """What one file gave: its quarantine rows, its users, its rows held by key (not spilled)."""
    quarantine: list[pl.DataFrame] = field(default_factory=list)
    users: list[pl.DataFrame] = field(default_factory=list)
    held: dict[int, list[pl.DataFrame]] = field(default_factory=dict)
    rows: int = 0
    bad: int = 0
    digest: str = ""


class Stopped(Exception):
    """Another file's read failed: this one stops at its next batch."""


class Staging:
    """The staged candidates of one sync, by spill key: spilled under `scratch/bucket=<key>/`, or
    held in memory (`spill=False`).

    `prepare(batch, file, pos)` -> (candidate rows with provenance, quarantine rows) applies the
    row rules to one batch; `keys(user_id series)` -> the spill key of each row."""

    def __init__(self, scratch: Path, spill: bool, prepare: Callable, keys: Callable, flush_bytes: int,
                 threads: int = READ_THREADS, slim: Callable | None = None, restore: Callable | None = None):
        self.scratch, self.spill, self.prepare, self.keys = scratch, spill, prepare, keys
        self.slim = slim or (lambda frame, rank: frame)
        self.restore = restore or (lambda frame, rank: frame)
        self.threads = max(1, threads)
        self.flush_total = flush_bytes
        self.flush_bytes = flush_bytes
        self.held: dict[int, list[pl.DataFrame]] = {}
        self._spilled_bytes: dict[int, int] = {}
        self.spilled_file_bytes = 0  # bytes of the spill files kept for the merge
        self._cost_lock = threading.Lock()
        self._stop = threading.Event()

    def files(self, files: list, *, chunk_bytes: int, batch_rows: int, reader: str) -> Iterator[tuple[object, StagedFile]]:
        """(file, StagedFile) for each of `files` ((rank, ArchiveFile) pairs) in their order, up to
        `threads` of them read at once; held rows are added to `self.held` in that order."""
        def one(item):
            rank, f = item
            return f, self._file(rank, f, chunk_bytes, batch_rows, reader)

        # The spill buffers of the files being read together share one flush budget.
        self.flush_bytes = max(1, self.flush_total // max(1, min(self.threads, len(files))))

        if self.threads == 1 or len(files) < 2:
            results = map(one, files)
            for f, staged in results:
                yield f, self._keep(staged)
            return
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="qumem-ingest-read") as pool:
            futures = [pool.submit(one, item) for item in files]
            try:
                for fut in futures:
                    f, staged = fut.result()
                    yield f, self._keep(staged)
            except BaseException:
                self._stop.set()  # the files still being read stop at their next batch
                for fut in futures:
                    fut.cancel()
                raise

    def _keep(self, staged: StagedFile) -> StagedFile:
        for k, chunks in staged.held.items():
            self.held.setdefault(k, []).extend(chunks)
        staged.held = {}
        return staged

    def _file(self, rank: int, f, chunk_bytes: int, batch_rows: int, reader: str) -> StagedFile:
        """Read one file; a RESTART of its reader drops what it staged so far."""
        out, parts, buffered, size = StagedFile(), [], {}, 0
        cost: dict[int, int] = {}  # this file's spilled rows by key, as taken back (published as it ends)
        on_disk = 0
        hasher = content_hasher()
        pos = 0

        def flush() -> None:
            nonlocal size, on_disk
            for k, chunks in buffered.items():
                d = self.scratch / f"bucket={k}"
                d.mkdir(exist_ok=True)
                path = d / f"part-{rank:06d}-{len(parts):06d}.arrow"
                part = pl.concat(chunks, how="vertical", rechunk=False)
                slim = self.slim(part, rank)
                slim.write_ipc(path)
                # the budget counts the rows as taken back: the file plus the columns `restore` adds
                restored = part.select(c for c in part.columns if c not in slim.columns).estimated_size()
                written = path.stat().st_size
                cost[k] = cost.get(k, 0) + written + int(restored)
                on_disk += written
                parts.append(path)
            buffered.clear()
            size = 0

        for batch in read_batches(f.path, f.format, chunk_bytes=chunk_bytes, batch_rows=batch_rows, hasher=hasher,
                                  reader=reader):
            if self._stop.is_set():
                raise Stopped(str(f.path))
            if batch is RESTART:  # the fast reader gave up: forget what it staged for this file
                for p in parts:
                    p.unlink()
                cost.clear()
                out, parts, pos, on_disk = StagedFile(), [], 0, 0
                buffered.clear()
                size = 0
                continue
            n = batch.raw.height
            good, q = self.prepare(batch, f, pos)
            pos += n
            out.quarantine.append(q)
            out.bad += q.height
            out.rows += good.height
            out.users.append(good.select(pl.col("user_id").unique()))
            if good.height == 0:
                continue
            good = good.with_columns(_bucket=self.keys(good["user_id"]))
            target = buffered if self.spill else out.held
            for (k,), chunk in good.partition_by("_bucket", as_dict=True).items():
                target.setdefault(k, []).append(chunk.drop("_bucket"))
            if self.spill:
                size += good.estimated_size()
                if size >= self.flush_bytes:
                    flush()
        flush()
        out.digest = content_digest(hasher)
        with self._cost_lock:  # files are read on several threads
            for k, n in cost.items():
                self._spilled_bytes[k] = self._spilled_bytes.get(k, 0) + n
            self.spilled_file_bytes += on_disk
        return out

    def cost(self, key: int) -> int:
        """Bytes staged for `key` (the held frames' size, or the spill files' with the restored
        columns)."""
        if not self.spill:
            return sum(int(c.estimated_size()) for c in self.held.get(key, ()))
        return self._spilled_bytes.get(key, 0)

    def take(self, keys: list[int], empty: pl.DataFrame) -> pl.DataFrame:
        """One group's staged candidates, in archive order per key, in one chunk (a chunked frame
        sorts and gathers ~2x slower); held rows are released as they are taken."""
        parts = [empty]
        for k in keys:
            parts += self.held.pop(k, [])
            d = self.scratch / f"bucket={k}"
            if self.spill and d.exists():
                parts += [self.restore(read_spilled(p), _part_rank(p)) for p in sorted(d.glob("*.arrow"))]
        return pl.concat(parts, how="diagonal_relaxed", rechunk=True)


def _part_rank(path: Path) -> int:
    """The rank of the file a spilled part came from (`part-<rank>-<n>.arrow`)."""
    return int(path.stem.split("-")[1])


def read_spilled(path: Path) -> pl.DataFrame:
    """A spilled part, memory-mapped (pyarrow's IPC reader, zero-copy into polars): ~6x less CPU than
    `pl.read_ipc`, which copies every buffer. The map lives as long as a frame holds its buffers."""
    import pyarrow as pa
    import pyarrow.ipc

    return pl.from_arrow(pa.ipc.open_file(pa.memory_map(str(path))).read_all())
