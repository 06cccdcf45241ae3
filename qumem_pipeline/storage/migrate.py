"""Move a per-user Parquet data root (`<old>/<table>/user_id=<id>/part-0.parquet`, the layout before
the table store) into the Delta table store, losslessly, and prove it.

Every table directory becomes one Delta table, written in chunks of users (one commit per chunk);
each user's rows are read back and compared with the source: the row counts and a content hash (the
sorted multiset of row hashes, after aligning both sides to the table's columns) must be equal, or
the migration stops with the first difference. Per-user FAISS files become rows of `indexes` (the
file bytes are exactly `faiss.serialize_index`'s), a user's checkpoint batches become rows of
`memory_checkpoints`, and `_meta/forgotten.json` becomes the `forgotten_users` registry. The old
root is left untouched (delete it once satisfied); the DuckDB warehouse is not part of the data
layout (reload it with `qumem ingest`/`run`, or keep the file).
"""

import hashlib
import json
import os
from pathlib import Path

import faiss
import numpy as np
import polars as pl

from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.storage.forget import LEGACY_REGISTRY, ForgetRegistry
from qumem_pipeline.storage.layout import TMP_PREFIX, DataLayout

CHUNK_USERS = int(os.environ.get("QUMEM_MIGRATE_CHUNK_USERS", "500"))
INDEX_TABLE = "indexes"
INDEX_SCHEMA = {"user_id": pl.String, "type": pl.String, "ntotal": pl.Int64, "faiss": pl.Binary}


class MigrationMismatch(RuntimeError):
    """A migrated user's rows differ from the source's."""


def _user_dirs(table_dir: Path) -> list[tuple[str, Path]]:
    return sorted((p.name.split("=", 1)[1], p) for p in table_dir.glob("user_id=*") if p.is_dir())


def _read_user(table: str, d: Path, user: str) -> pl.DataFrame | None:
    if table == INDEX_TABLE:
        rows = []
        for f in sorted(d.glob("*.faiss")):
            blob = f.read_bytes()
            index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
            rows.append((user, f.stem, int(index.ntotal), blob))
        return pl.DataFrame(rows, schema=INDEX_SCHEMA, orient="row") if rows else None
    files = sorted(p for p in d.glob("*.parquet") if not p.name.startswith(TMP_PREFIX))
    if not files:
        return None
    return pl.concat([pl.read_parquet(p) for p in files], how="diagonal_relaxed")


def content_hash(df: pl.DataFrame) -> str:
    """Order-free content hash: sha256 of the sorted row hashes (columns in name order). polars row
    hashes are stable within one polars version: both sides are hashed by the same process."""
    if df.height == 0:
        return hashlib.sha256(b"").hexdigest() + f":{sorted(df.columns)}"
    hashes = df.select(sorted(df.columns)).hash_rows(seed=0).sort()
    return hashlib.sha256(hashes.to_numpy().tobytes()).hexdigest()


def _aligned(old: pl.DataFrame, new: pl.DataFrame) -> pl.DataFrame:
    """The source rows as the store keeps them: its column set and dtypes (null for a column the
    source user never had, which is what schema evolution means)."""
    cols = []
    for c, t in new.schema.items():
        cols.append((pl.col(c).cast(t) if old.schema[c] != t else pl.col(c)) if c in old.columns
                    else pl.lit(None, dtype=t).alias(c))
    extra = set(old.columns) - set(new.columns)
    if extra:
        raise MigrationMismatch(f"columns {sorted(extra)} did not reach the store")
    return old.select(cols)


def migrate_storage(old_root: str | os.PathLike, new_root: str | os.PathLike, n_buckets: int | None = None,
                    chunk_users: int = CHUNK_USERS) -> dict:
    """Copy every table of `old_root` into the store at `new_root`; returns per-table rows, users,
    content hashes (source and store) and commits."""
    old = Path(old_root)
    if not old.is_dir():
        raise FileNotFoundError(f"no per-user Parquet root at {old}")
    layout = DataLayout(new_root, n_buckets=n_buckets)
    report: dict[str, dict] = {}
    for table_dir in sorted(p for p in old.iterdir() if p.is_dir() and any(p.glob("user_id=*"))):
        table = table_dir.name
        users = _user_dirs(table_dir)
        rows = commits = 0
        src_hashes, dst_hashes = [], []
        for i in range(0, len(users), chunk_users):
            chunk = users[i:i + chunk_users]
            parts = {u: df for u, d in chunk if (df := _read_user(table, d, u)) is not None}
            if not parts:
                continue
            layout.replace_parts(table, parts)
            commits += 1
            back = layout.read_users(table, list(parts))
            for u, src in parts.items():
                dst = back.get(u)
                if dst is None or dst.height != src.height:
                    raise MigrationMismatch(f"{table}/{u}: {src.height} rows in the source, "
                                            f"{None if dst is None else dst.height} in the store")
                h_src, h_dst = content_hash(_aligned(src, dst)), content_hash(dst)
                if h_src != h_dst:
                    raise MigrationMismatch(f"{table}/{u}: content hash differs after migration")
                src_hashes.append(f"{u}:{h_src}")
                dst_hashes.append(f"{u}:{h_dst}")
                rows += src.height
        digest = lambda hs: hashlib.sha256("\n".join(sorted(hs)).encode()).hexdigest()  # noqa: E731
        report[table] = {"users": len(src_hashes), "rows": rows, "commits": commits,
                         "source_hash": digest(src_hashes), "store_hash": digest(dst_hashes),
                         "unattributed": any(u == UNATTRIBUTED for u, _ in users)}
    legacy = old / LEGACY_REGISTRY
    if legacy.exists():
        registry = ForgetRegistry(new_root)
        registry.add_legacy_digests(json.loads(legacy.read_text()))
        report["forgotten_users"] = {"digests": len(registry)}
    return report
