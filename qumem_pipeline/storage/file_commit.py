"""Add rows to a Delta table by writing its Parquet files here and committing them in one transaction.

Why: delta-rs' own writer (`write_deltalake`) spends about 1.4-1.5x the CPU of polars' Parquet writer
on the same rows and codec (`python bench/ingest.py` `writers`: the turns of a generated archive
written both ways in the same run), and on a fresh ingest that write is the largest stage. A
write that removes nothing needs none of delta-rs' rewrite machinery: an append, or a replace
whose users no file of the touched partitions can hold (a fresh table, new users, the groups of
a first ingest), is the new files plus one commit of their add actions. Every write that must
take rows out still goes through delta-rs (predicate overwrite: it rewrites the files it touches).
A blind append cannot conflict, so a replace checks after its commit that no other writer added
rows of the same users meanwhile; if one did, the caller replaces them through delta-rs, so the
last writer wins as with delta-rs' own conflict retry.

Files follow the table's layout exactly: one directory per `user_bucket` (the partition column is
not stored in the file), rows in the order given (sorted by `user_key`), row groups of
`row_group_rows` rows (footer statistics prune a user lookup), add-action statistics on
`user_key` only (no user text in the log). A writer killed before the commit leaves unreferenced
files only: the table's previous version is intact and vacuum removes them.
"""

import io
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import polars as pl
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Schema
from deltalake.transaction import AddAction, create_table_with_add_actions

# zstd level 1: between zstd's default level (smaller files, more CPU) and snappy (less CPU, larger
# files); bench/ingest.py `writers` compares the resulting write with delta-rs' writer.
CODEC, CODEC_LEVEL = "zstd", 1
# No checkpoint from delta-rs' post-commit hook: the table store takes its own (table_store._after_commit).
NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
# Files of one write encoded at once (write_files).
ENCODE_THREADS = max(1, min(4, os.cpu_count() or 2))


def fast_path_ok(schema: pl.Schema) -> bool:
    """Whether polars writes every column as delta-rs would: flat signed types only (lists,
    arrays, structs, unsigned ints and timestamps without a time zone differ in their
    Parquet/Delta mapping) — other tables keep delta-rs' writer."""
    for t in schema.values():
        if isinstance(t, (pl.List, pl.Array, pl.Struct, pl.Object, pl.Decimal, pl.Categorical, pl.Enum)):
            return False
        if t in (pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64):  # Delta has no unsigned ints
            return False
        if isinstance(t, pl.Datetime) and t.time_zone is None:
            return False
    return True


def may_hold(dt: DeltaTable | None, users_by_bucket: dict[int, list[str]], key: str, bucket: str,
             exclude: set[str] = frozenset()) -> bool:
    """Whether a file of the touched partitions (other than `exclude`) may hold one of the users
    (its `key` range, from the add actions' statistics, covers one of them; a file without
    statistics may)."""
    if dt is None:
        return False
    acts = pl.DataFrame(dt.get_add_actions(flatten=True))
    if exclude and acts.height:
        acts = acts.filter(~pl.col("path").is_in(sorted(exclude)))
    if acts.height == 0:
        return False
    part, lo, hi = f"partition.{bucket}", f"min.{key}", f"max.{key}"
    if lo not in acts.columns or hi not in acts.columns:
        return True
    acts = acts.filter(pl.col(part).is_in(list(users_by_bucket)))
    for b, lo_v, hi_v in acts.select(part, lo, hi).iter_rows():
        if lo_v is None or hi_v is None:
            return True
        if any(lo_v <= u <= hi_v for u in users_by_bucket.get(b, ())):
            return True
    return False


def write_files(df: pl.DataFrame, fs: pafs.FileSystem, table_path: str, *, key: str, bucket: str,
                row_group_rows: int, target_file_bytes: int, threads: int | None = None) -> list[AddAction]:
    """One Parquet file (or more, for a partition over `target_file_bytes` in memory) per bucket of
    `df`, under `table_path`; the add actions that name them, in bucket order. The files are
    encoded on `threads` threads (ENCODE_THREADS; polars' Parquet writer releases the GIL): the
    encoding is most of a write's CPU, and one thread left a core idle."""
    pieces = []
    for (b,), part in df.partition_by(bucket, as_dict=True, maintain_order=True).items():
        part = part.drop(bucket)
        n = max(1, -(-int(part.estimated_size()) // max(1, target_file_bytes)))
        step = -(-part.height // n)
        pieces += [(b, i, piece) for i in range(n) if (piece := part.slice(i * step, step)).height]
    local = isinstance(fs, pafs.LocalFileSystem)

    def one(item) -> AddAction:
        b, i, piece = item
        rel = f"{bucket}={b}/part-{i:05d}-{uuid.uuid4()}-c000.{CODEC}.parquet"
        path = f"{table_path}/{rel}"
        if local:  # staged as <name>#q like delta-rs (`<name>#N`): a data file name is always complete
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            staging = f"{path}#q"
            piece.write_parquet(staging, compression=CODEC, compression_level=CODEC_LEVEL,
                                row_group_size=row_group_rows, statistics=True)
            os.replace(staging, path)
            size = os.path.getsize(path)
        else:
            buf = io.BytesIO()
            piece.write_parquet(buf, compression=CODEC, compression_level=CODEC_LEVEL,
                                row_group_size=row_group_rows, statistics=True)
            data = buf.getvalue()
            with fs.open_output_stream(path) as out:
                out.write(data)
            size = len(data)
        keys = piece.get_column(key)
        stats = {"numRecords": piece.height, "minValues": {key: keys.min()}, "maxValues": {key: keys.max()},
                 "nullCount": {key: keys.null_count()}}
        return AddAction(rel, size, {bucket: str(b)}, int(time.time() * 1000), True, json.dumps(stats))

    threads = ENCODE_THREADS if threads is None else threads
    if threads <= 1 or len(pieces) < 2:
        return [one(p) for p in pieces]
    with ThreadPoolExecutor(max_workers=min(threads, len(pieces)), thread_name_prefix="qumem-parquet") as pool:
        return list(pool.map(one, pieces))


def commit_new_table(uri: str, schema, adds: list[AddAction], *, partition_by: list[str], description: str,
                     configuration: dict, storage_options: dict | None, commit: CommitProperties) -> None:
    """Create the table with these files as its first version (fails if it exists: the caller retries)."""
    create_table_with_add_actions(uri, Schema.from_arrow(schema), adds, mode="error", partition_by=partition_by,
                                  description=description, configuration=configuration,
                                  storage_options=storage_options, commit_properties=commit,
                                  post_commithook_properties=NO_HOOKS)


def commit_append(dt: DeltaTable, adds: list[AddAction], *, partition_by: list[str], commit: CommitProperties) -> None:
    """One append commit of these files, under the table's own schema."""
    dt.create_write_transaction(adds, "append", dt.schema(), partition_by=partition_by, commit_properties=commit,
                                post_commithook_properties=NO_HOOKS)
