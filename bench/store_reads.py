"""Store reads bench: a 100-user read of a local table store by each reader, in the same run.

Why: `TableStore.read(table, users)` on a local root reads the touched buckets' files with polars'
Parquet scan, one scan per file filtered on that file's bucket's users, collected together
(`table_store._scan_users_local`). One scan of every file filtered on the whole user list (the
earlier reader, `one_scan` here) paid that list's check on every row group of every file: on a
nightly incremental sync's reads (its users' fingerprints, one row each in small files of every
touched bucket; their turns, in large files plus the small ones earlier nights appended) that check
was most of the read's time.

Two tables, 64 buckets:
- `small_files`: a fingerprints-like table, `--users` users with one row each, written in five
  commits (five small files per bucket, as an ingest's merge groups write them);
- `mixed_files`: a turns-like table, `--users`/5 users with `--rows-per-user` rows each in one commit
  (files of many row groups), then 10 more rows for each of the 100 users read (one small file per
  bucket touched, as a nightly append adds).

Per table, the same 100 users are read `--repeat` times by: `chosen` (`TableStore.read` as shipped),
`one_scan` (the earlier reader, kept here as the baseline) and `pyarrow` (the object-store path:
footers pruned here, pyarrow's dataset); medians in milliseconds, and the rows each returned (they
must agree). Last line keys: `small_files_speedup` and `mixed_files_speedup` (one_scan / chosen),
`configs`.

`--s3`: the same two tables also on S3 (moto's standalone server on loopback, as the tests run it),
where reads take the pyarrow path: `chosen` (each file's size from its add action given to pyarrow,
`table_store._fragments`) against `no_sizes` (pyarrow asks the store for each file's size first, a HEAD
request per file); keys `s3_small_files_speedup`, `s3_mixed_files_speedup` (no_sizes / chosen), `s3`.

    python bench/store_reads.py [--users 10000] [--rows-per-user 500] [--repeat 9] [--s3] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qumem_pipeline.storage import table_store  # noqa: E402
from qumem_pipeline.storage.table_store import TableStore  # noqa: E402

READ_USERS = 100


def _users(n: int) -> list[str]:
    return [f"user-{i:06d}" for i in range(n)]


def build(root: Path | str, users: int, rows_per_user: int) -> None:
    store = TableStore(root, n_buckets=64)
    ids = _users(users)
    for k in range(5):
        part = ids[k::5]
        store.replace_keyed("small_files", part, pl.DataFrame({
            "user_id": part, "fingerprint": [u[::-1] for u in part], "n_turns": [rows_per_user] * len(part)}))
    heavy = ids[: max(READ_USERS, users // 5)]
    n = len(heavy) * rows_per_user
    store.replace_keyed("mixed_files", heavy, pl.DataFrame({
        "user_id": [u for u in heavy for _ in range(rows_per_user)],
        "turn_index": [i for _ in heavy for i in range(rows_per_user)],
        "text": pl.Series(range(n)).cast(pl.String) + " some words of a turn, about as long as one",
    }))
    late = ids[:READ_USERS]
    store.append("mixed_files", pl.DataFrame({
        "user_id": [u for u in late for _ in range(10)],
        "turn_index": [rows_per_user + i for _ in late for i in range(10)],
        "text": "a later turn",
    }))


def one_scan(files: list[tuple[str, int]], schema, bucket_of: dict[str, int], cols) -> pl.DataFrame:
    """The earlier local reader: one polars scan of every file, filtered on the whole user list."""
    full = pl.from_arrow(schema.empty_table()).schema
    in_files = {c: t for c, t in full.items() if c != table_store.BUCKET}
    wanted = list(full) if cols is None else list(cols)
    lf = pl.scan_parquet([p for p, _ in files], schema=in_files, missing_columns="insert", extra_columns="ignore",
                         hive_partitioning=False, glob=False)
    lf = lf.filter(pl.col(table_store.KEY).is_in(list(bucket_of)))
    if table_store.BUCKET in wanted:
        lf = lf.with_columns(pl.col(table_store.KEY).replace_strict(bucket_of, return_dtype=full[table_store.BUCKET])
                             .alias(table_store.BUCKET))
    return lf.select(wanted).collect()


LOCAL_READERS = {"chosen": {}, "one_scan": {"_scan_users_local": one_scan}, "pyarrow": {"POLARS_LOCAL_READS": False}}
_fragments = table_store._fragments
S3_READERS = {"chosen": {}, "no_sizes": {"_fragments": lambda fmt, fs, prefix, acts, bucket_type: _fragments(
    fmt, fs, prefix, acts.drop("size_bytes", strict=False), bucket_type)}}


def timed_reads(root: Path | str, table: str, repeat: int, readers: dict[str, dict]) -> dict:
    """Each reader (table_store attributes it replaces) reads the same users `repeat` times."""
    users = _users(READ_USERS)
    out = {}
    for name, patch in readers.items():
        with ExitStack() as stack:
            for attr, value in patch.items():
                stack.enter_context(mock.patch.object(table_store, attr, value))
            store = TableStore(root)
            store.read(table, users)  # the handle loaded once, as a sync's store holds it
            times, rows = [], None
            for _ in range(repeat):
                t = time.perf_counter()
                rows = store.read(table, users).height
                times.append(time.perf_counter() - t)
            out[name] = {"ms": round(statistics.median(times) * 1000, 2), "rows": rows}
    assert len({r["rows"] for r in out.values()}) == 1, out
    dt = TableStore(root)._open(table)
    acts = pl.DataFrame(dt.get_add_actions(flatten=True))
    out["files"], out["single_row_group_files"] = acts.height, int((acts["num_records"] <= table_store.ROW_GROUP_ROWS).sum())
    return out


def s3_configs(users: int, rows_per_user: int, repeat: int) -> dict:
    import uuid

    from qumem_pipeline.runtime.processes import MOTO_S3_ENV, moto_s3

    # the store's S3 filesystem reads its endpoint and keys from the environment (this bench's process ends after)
    with moto_s3(buckets=("bench",)) as endpoint:
        os.environ.update({**MOTO_S3_ENV, "AWS_ENDPOINT_URL": endpoint})
        root = f"s3://bench/{uuid.uuid4().hex[:8]}"
        build(root, users, rows_per_user)
        return {table: timed_reads(root, table, repeat, S3_READERS) for table in ("small_files", "mixed_files")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--rows-per-user", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--s3", action="store_true", help="also on S3 (moto on loopback): file sizes given to pyarrow or not")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="qumem-bench-store-reads-"))
    try:
        t = time.perf_counter()
        build(root, args.users, args.rows_per_user)
        print(f"built in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        configs = {table: timed_reads(root, table, args.repeat, LOCAL_READERS) for table in ("small_files", "mixed_files")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'table':<14}{'files':>7}{'1-group':>9}{'chosen ms':>11}{'one_scan ms':>13}{'pyarrow ms':>12}{'rows':>8}")
    for table, c in configs.items():
        print(f"{table:<14}{c['files']:>7}{c['single_row_group_files']:>9}{c['chosen']['ms']:>11.1f}"
              f"{c['one_scan']['ms']:>13.1f}{c['pyarrow']['ms']:>12.1f}{c['chosen']['rows']:>8}")
    small, mixed = configs["small_files"], configs["mixed_files"]
    out = {"small_files_speedup": round(small["one_scan"]["ms"] / small["chosen"]["ms"], 3),
           "mixed_files_speedup": round(mixed["one_scan"]["ms"] / mixed["chosen"]["ms"], 3),
           "users": args.users, "rows_per_user": args.rows_per_user, "repeat": args.repeat, "configs": configs}
    if args.s3:
        s3 = s3_configs(args.users, args.rows_per_user, args.repeat)
        print(f"{'s3 table':<14}{'files':>7}{'chosen ms':>11}{'no_sizes ms':>13}{'rows':>8}")
        for table, c in s3.items():
            print(f"{table:<14}{c['files']:>7}{c['chosen']['ms']:>11.1f}{c['no_sizes']['ms']:>13.1f}{c['chosen']['rows']:>8}")
        out.update(s3_small_files_speedup=round(s3["small_files"]["no_sizes"]["ms"] / s3["small_files"]["chosen"]["ms"], 3),
                   s3_mixed_files_speedup=round(s3["mixed_files"]["no_sizes"]["ms"] / s3["mixed_files"]["chosen"]["ms"], 3),
                   s3=s3)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
