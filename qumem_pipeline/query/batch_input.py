"""A batch of personalization queries read as a stream of bounded chunks: JSONL, Parquet (a file or a
directory of files) or a Delta table, on a local path or an object store (`s3://`, `gs://`, `az://`,
credentials from the environment as for the table store).

Each chunk is a list of `(row number, object, error)` records, what `queries.validate_query_records`
takes: a JSONL row is its line number (blank lines count, as `read_queries` numbers them), a Parquet or
Delta row its 1-based position in the stream. No chunk holds more than `chunk_rows` records, so a batch
larger than memory is read in pieces. `batch_digest` is the content digest of the records in order (the
default batch id): the same rows give the same id, any change gives another.
"""

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import PurePosixPath

import pyarrow.dataset as pads
import pyarrow.fs as pafs

from qumem_pipeline.query.queries import jsonl_records
from qumem_pipeline.storage.table_store import PLACEHOLDER, filesystem_for, is_uri

FORMATS = ("jsonl", "parquet", "delta")
DEFAULT_CHUNK_ROWS = 10_000
Record = tuple[int, dict, str | None]


def _fs(uri: str) -> tuple[pafs.FileSystem, str]:
    return filesystem_for(str(uri))


def detect_format(uri: str) -> str:
    """`delta` for a directory holding `_delta_log`, `parquet` for a .parquet/.pq file or another
    directory (of Parquet files), else `jsonl`."""
    fs, path = _fs(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"queries not found: {uri}")
    if info.type == pafs.FileType.Directory:
        log = fs.get_file_info(f"{path}/_delta_log")
        return "delta" if log.type == pafs.FileType.Directory else "parquet"
    return "parquet" if PurePosixPath(path).suffix.lower() in (".parquet", ".pq") else "jsonl"


def _jsonl(uri: str, chunk_rows: int) -> Iterator[list[Record]]:
    fs, path = _fs(uri)
    chunk: list[Record] = []
    with fs.open_input_stream(path) as raw:
        lines = (line.rstrip(b"\n") for line in io.BufferedReader(raw, 1 << 20))
        for rec in jsonl_records(lines):
            chunk.append(rec)
            if len(chunk) >= chunk_rows:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _arrow_batches(uri: str, fmt: str, chunk_rows: int):
    if fmt == "delta":
        from deltalake import DeltaTable

        target = str(uri).rstrip("/") if is_uri(uri) else _fs(uri)[1]
        ds = DeltaTable(target).to_pyarrow_dataset()
    else:
        fs, path = _fs(uri)
        ds = pads.dataset(path, filesystem=fs, format="parquet")
    where = (pads.field(PLACEHOLDER) != True) if PLACEHOLDER in ds.schema.names else None  # noqa: E712
    return ds.to_batches(batch_size=chunk_rows, filter=where)


def _arrow(uri: str, fmt: str, chunk_rows: int) -> Iterator[list[Record]]:
    row = 0
    chunk: list[Record] = []
    for batch in _arrow_batches(uri, fmt, chunk_rows):
        for obj in batch.to_pylist():
            row += 1
            chunk.append((row, obj, None))
            if len(chunk) >= chunk_rows:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def iter_records(uri: str, fmt: str | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[list[Record]]:
    """The batch's records in chunks of at most `chunk_rows`, in input order."""
    fmt = fmt or detect_format(uri)
    if fmt not in FORMATS:
        raise ValueError(f"unknown query format {fmt!r}; expected one of {FORMATS}")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    return _jsonl(uri, chunk_rows) if fmt == "jsonl" else _arrow(uri, fmt, chunk_rows)


def batch_digest(uri: str, fmt: str | None = None) -> str:
    """Content digest of the batch (its records in order): 16 hex characters of a sha256."""
    h = hashlib.sha256()
    for chunk in iter_records(uri, fmt):
        for _, obj, err in chunk:
            h.update(json.dumps([obj, err], sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
            h.update(b"\n")
    return h.hexdigest()[:16]
