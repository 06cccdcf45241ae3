"""Compare two `qumem export` folders table by table (row counts, schema, content).

Used to show a refactor leaves the warehouse unchanged: run `qumem run && qumem export --out A` in a
checkout of each revision, then `python scripts/compare_exports.py A B --root-a DIR_A --root-b DIR_B`.
Wall-clock columns (`created_at`, `latency_s`, …) are left out, and `source_file` paths are compared
relative to each checkout's root (`--root-a/--root-b`), since the archive's absolute path differs
between checkouts. Prints one JSON object; exit 1 when any table differs.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import polars as pl

WALL_CLOCK = ("created_at", "latency_s", "ingested_at", "seconds")


def _normalised(df: pl.DataFrame, root: str | None) -> pl.DataFrame:
    df = df.drop([c for c in WALL_CLOCK if c in df.columns])
    if root and "source_file" in df.columns:
        prefix = str(Path(root).resolve()).rstrip("/") + "/"
        df = df.with_columns(pl.col("source_file").str.strip_prefix(prefix))
    sortable = [c for c, t in df.schema.items() if t.is_numeric() or t in (pl.String, pl.Boolean)]
    return df.sort(sortable) if sortable else df


def _digest(df: pl.DataFrame) -> str:
    return hashlib.sha256(df.write_ipc(None).getvalue()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--root-a")
    ap.add_argument("--root-b")
    args = ap.parse_args(argv)
    report, same = {}, True
    names = sorted({p.stem for p in Path(args.a).glob("*.parquet")} | {p.stem for p in Path(args.b).glob("*.parquet")})
    for name in names:
        fa, fb = Path(args.a) / f"{name}.parquet", Path(args.b) / f"{name}.parquet"
        if not (fa.exists() and fb.exists()):
            report[name] = {"missing_in": "a" if not fa.exists() else "b"}
            same = False
            continue
        da, db = _normalised(pl.read_parquet(fa), args.root_a), _normalised(pl.read_parquet(fb), args.root_b)
        equal = da.schema == db.schema and _digest(da) == _digest(db)
        report[name] = {"rows": [da.height, db.height], "schema_equal": da.schema == db.schema, "content_equal": equal}
        same &= equal
    print(json.dumps({"identical": same, "tables": report}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
