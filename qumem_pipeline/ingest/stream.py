"""Read one archive file as a sequence of bounded batches, each an ImportResult.

* Canonical JSONL: blocks of about `chunk_bytes` cut at line ends, each parsed by the importer's
  own fast path (polars) with its line-by-line fallback (`import_jsonl_bytes`), numbered by the
  file's real line numbers. Lines are independent, so the batches hold exactly the rows and
  failures the whole-file read gives. A line longer than a block is read whole (memory is
  bounded by max(block, longest line)).
* Canonical Parquet: pyarrow record batches of `batch_rows` rows.
* LoCoMo / ChatGPT JSON: one document per file (conversations nest; the file is one JSON value),
  read whole by their importers, one batch per file.

Every archive read in the ingest goes through `read_batches` (and `hash_file`), so a test can
count them: `READS` counts the files opened for reading.
"""

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import polars as pl

from qumem_pipeline.ingest.importers import WHOLE_FILE_FORMATS
from qumem_pipeline.ingest.importers.base import ImportResult, empty_raw_frame
from qumem_pipeline.ingest.importers.canonical import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    import_jsonl_bytes,
    parquet_frame,
    unreadable_parquet,
)

# 64 MiB of JSONL per batch: big enough that polars' parser runs at full speed, small enough that
# a batch and its validation copies stay a few hundred MB.
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_BATCH_ROWS = 256_000
READS: Counter = Counter()  # path -> times opened for reading (tests assert on it)
# Yielded by read_batches when the fast reader gave up part-way: drop this file's batches so far,
# the ones that follow (from the block reader) replace them.
RESTART = object()
READERS = ("auto", "blocks")
# The manifest's content hash of a file: BLAKE3 (docs/storage.md#content-hashes), its hex digest
# behind this tag, so a digest says which function made it (a manifest row of an older version
# holds a bare sha256 and is re-read anyway: its ingest_version differs).
CONTENT_HASH_TAG = "blake3:"


def content_hasher():
    """A fresh hasher of the manifest's content hash (`.update(bytes)`, `.hexdigest()`)."""
    return blake3.blake3()


def content_digest(hasher) -> str:
    return CONTENT_HASH_TAG + hasher.hexdigest()


def file_format(path: Path, archive_format: str) -> str:
    """The format of one file of the archive: a directory or glob is canonical, by suffix."""
    name = path.name.lower()
    if archive_format in WHOLE_FILE_FORMATS:
        return archive_format
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise ValueError(f"{path}: unsupported file type (expected .jsonl/.ndjson or .parquet)")


def read_batches(path: Path, fmt: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 batch_rows: int = DEFAULT_BATCH_ROWS, hasher=None, reader: str = "auto") -> Iterator[ImportResult]:
    """The file's batches in file order. `hasher` (`content_hasher()`) is fed the file's bytes.

    JSONL, reader "auto": polars' streaming scan first (measured ~3x faster than parsing blocks
    here: bench/ingest.py `readers`), valid only when its rows are exactly the file's lines and
    no value needs the line-by-line rules; otherwise it yields RESTART and the block reader
    (reader "blocks", the importer's own fast path + fallback) reads the file instead."""
    READS[str(path)] += 1
    if fmt == "jsonl":
        if reader == "auto":
            yield from _jsonl_scan_or_blocks(path, chunk_bytes, hasher, batch_rows)
        else:
            yield from _jsonl_batches(path, chunk_bytes, hasher)
        return
    if hasher is not None:
        _feed(path, hasher)
    if fmt == "parquet":
        yield from _parquet_batches(path, batch_rows)
    elif fmt in WHOLE_FILE_FORMATS:
        from qumem_pipeline.ingest.importers import IMPORTERS

        yield IMPORTERS[fmt](str(path))
    else:
        raise ValueError(f"unknown file format {fmt!r}")


def _jsonl_batches(path: Path, chunk_bytes: int, hasher=None) -> Iterator[ImportResult]:
    src = str(path)
    line = 1
    carry = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if hasher is not None:
                hasher.update(block)
            data = carry + block if carry else block
            if not block:  # end of file: the last line may lack its "\n"
                if data:
                    yield import_jsonl_bytes(src, data, line)
                return
            cut = data.rfind(b"\n")
            if cut < 0:
                carry = data  # one line longer than a block: keep reading it
                continue
            whole, carry = data[: cut + 1], data[cut + 1 :]
            n = whole.count(b"\n")
            yield import_jsonl_bytes(src, whole, line, n_lines=n)
            line += n


def _jsonl_scan_or_blocks(path: Path, chunk_bytes: int, hasher=None, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[ImportResult]:
    from qumem_pipeline.ingest.importers.base import RAW_COLUMNS
    from qumem_pipeline.ingest.importers.canonical import SOURCE_COLUMNS, _suspect_expr

    if os.stat(path).st_size == 0:
        return
    # The hash and the line count (rows must be lines) take a pass of their own over the bytes:
    # on a thread, beside the scan (BLAKE3 releases the GIL), so the file costs one pass of time.
    counting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qumem-hash")
    lines = counting.submit(_hash_and_count_lines, path, hasher)
    counting.shutdown(wait=False)
    src = str(path)
    seen = 0
    try:
        scan = pl.scan_ndjson(path, schema=SOURCE_COLUMNS, row_index_name="source_row", row_index_offset=1)

        def ready(frames: list[pl.DataFrame]) -> ImportResult:
            # The scan hands out morsels of ~2k rows: one batch of them, in one chunk, so the
            # steps after (spill files, sorts, gathers) work on few large pieces.
            df = pl.concat(frames, how="vertical", rechunk=True)
            df = df.with_columns(source_file=pl.lit(src, dtype=pl.String), source_row=pl.col("source_row").cast(pl.Int64))
            df = df.select(list(RAW_COLUMNS))
            if df.select(_suspect_expr()).to_series().any():
                raise _GiveUp
            return ImportResult(raw=df)

        pending, n_pending = [], 0
        for df in scan.collect_batches():
            pending.append(df)
            n_pending += df.height
            if n_pending >= batch_rows:
                batch = ready(pending)
                pending, n_pending = [], 0
                seen += batch.raw.height
                yield batch
        if pending:
            batch = ready(pending)
            seen += batch.raw.height
            yield batch
        if seen != lines.result():  # blank lines: rows are not lines
            raise _GiveUp
    except Exception:  # noqa: BLE001 - a bad line, a non-string value, blank lines: the block reader decides
        if seen:
            yield RESTART
        lines.result()  # the hash is complete before the file's batches are (the caller reads it after)
        yield from _jsonl_batches(path, chunk_bytes, None)
    finally:
        lines.result()


class _GiveUp(Exception):
    pass


def _hash_and_count_lines(path: Path, hasher, block: int = 4 << 20) -> int:
    """Lines of the file (a last line without "\n" counts), hashing it on the same pass. One
    reused buffer (`readinto`): a fresh 16 MiB `bytes` per read cost ~40% more CPU in page faults.
    Newlines are counted by numpy's vectorised compare (less CPU than `bytes.count`'s byte loop)."""
    n, last = 0, 10
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            if hasher is not None:
                hasher.update(view[:k])
            n += int(np.count_nonzero(np.frombuffer(buf, dtype=np.uint8, count=k) == 10))
            last = buf[k - 1]
    return n + (last != 10)


def _parquet_batches(path: Path, batch_rows: int) -> Iterator[ImportResult]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = str(path)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        yield ImportResult(raw=empty_raw_frame(), failures=[unreadable_parquet(src, e)])
        return
    first = 1
    with pf:
        for batch in pf.iter_batches(batch_size=batch_rows):
            df = pl.from_arrow(batch)
            yield parquet_frame(df, src, first)
            first += batch.num_rows


def hash_file(path: Path, block: int = 8 << 20) -> str:
    """The content digest of the file's bytes, read in blocks (only for files whose size or mtime
    moved): what `read_batches(hasher=content_hasher())` gives for the same bytes."""
    READS[str(path)] += 1
    return content_digest(_feed(path, content_hasher(), block))


def _feed(path: Path, hasher, block: int = 8 << 20):
    with open(path, "rb") as f:
        while chunk := f.read(block):
            hasher.update(chunk)
    return hasher


def stat_key(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
