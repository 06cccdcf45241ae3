"""Erasure audit: every object of the data root and every warehouse, searched for a user id and canaries.

The evidence an operator keeps for an erasure request (`qumem forget --verify USER_ID`). Parquet
files (data and checkpoints) are decoded and every string value searched, because their pages are
compressed; every other object (commit JSON, keys, manifests) is searched byte for byte. The user
id counts as found only as a whole token (so `al` is not found inside `alice`); canaries as
substrings. Warehouses: every text column of every table, plus the file's raw bytes. Export
folders (`qumem export`): every file, as the data root's objects.
"""

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from qumem_pipeline.storage.table_store import filesystem_for, is_uri

_ID_CHARS = "A-Za-z0-9_.\\-"


def _id_pattern(user_id: str) -> re.Pattern:
    return re.compile(f"(?<![{_ID_CHARS}]){re.escape(user_id)}(?![{_ID_CHARS}])")


def _found(text: str, user_id: str | None, canaries: list[str]) -> list[str]:
    out = []
    if user_id and _id_pattern(user_id).search(text):
        out.append("user_id")
    out += [f"canary:{c}" for c in canaries if c in text]
    return out


def _parquet_text(fs, path: str) -> str:
    table = pq.read_table(fs.open_input_file(path))
    parts = []
    for col in table.columns:
        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t) \
                or pa.types.is_list(t) or pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_large_list(t):
            parts.append(str(col.to_pylist()))
        elif pa.types.is_dictionary(t):
            parts.append(str(pc.cast(col, pa.string()).to_pylist()))
    return "\n".join(parts)


def audit_data_root(root: str, user_id: str | None, canaries: list[str]) -> dict:
    fs, base = filesystem_for(root if is_uri(root) else str(Path(root).absolute()))
    hits, n = [], 0
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        n += 1
        rel = info.path[len(base) + 1:]
        if rel.endswith(".duckdb") or rel.endswith(".duckdb.wal"):
            continue  # warehouses are audited as databases below
        found = []
        if info.base_name.endswith(".parquet"):
            try:
                found = _found(_parquet_text(fs, info.path), user_id, canaries)
            except Exception:  # noqa: BLE001 - not a readable Parquet file: search its bytes
                found = None
        if not found:
            with fs.open_input_stream(info.path) as f:
                raw = f.read().decode("latin-1")
            found = sorted(set((found or []) + _found(raw, user_id, canaries)))
        if found:
            hits.append({"object": rel, "found": found})
    return {"root": root, "objects_scanned": n, "hits": hits}


def audit_warehouse(path: str, user_id: str | None, canaries: list[str]) -> dict:
    from qumem_pipeline.storage.warehouse import Warehouse

    p = Path(path)
    if not p.exists():
        return {"path": path, "exists": False, "hits": []}
    hits = []
    wh = Warehouse(p)
    with wh.connect(read_only=True) as con:
        # every schema: the warehouse's tables (`main`) and its own bookkeeping (`qumem_meta`)
        tables = con.execute("SELECT table_schema, table_name FROM information_schema.tables "
                             "WHERE table_catalog = current_database()").fetchall()
        for schema, name in tables:
            t, label = f'"{schema}"."{name}"', name if schema == "main" else f"{schema}.{name}"
            for col, dtype, *_ in con.execute(f'DESCRIBE {t}').fetchall():
                if "VARCHAR" not in str(dtype).upper() and "[]" not in str(dtype) and "STRUCT" not in str(dtype).upper() \
                        and "JSON" not in str(dtype).upper():
                    continue
                expr = f'CAST("{col}" AS VARCHAR)'
                if user_id:
                    n = con.execute(f'SELECT count(*) FROM {t} WHERE regexp_matches({expr}, ?)',
                                    [f"(^|[^{_ID_CHARS}]){re.escape(user_id)}([^{_ID_CHARS}]|$)"]).fetchone()[0]
                    if n:
                        hits.append({"table": label, "column": col, "found": "user_id", "rows": n})
                for c in canaries:
                    n = con.execute(f'SELECT count(*) FROM {t} WHERE contains({expr}, ?)', [c]).fetchone()[0]
                    if n:
                        hits.append({"table": label, "column": col, "found": f"canary:{c}", "rows": n})
    raw = p.read_bytes().decode("latin-1")
    for f in _found(raw, user_id, canaries):
        hits.append({"table": None, "column": "<file bytes>", "found": f})
    return {"path": path, "exists": True, "hits": hits}


def audit_export(path: str, user_id: str | None, canaries: list[str]) -> dict:
    """Every file of an export folder, Parquet decoded, the rest byte for byte (as `audit_data_root`)."""
    p = Path(path)
    if not p.exists():
        return {"path": path, "exists": False, "hits": []}
    fs = pafs.LocalFileSystem()
    hits = []
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        found = []
        if f.name.endswith(".parquet"):
            try:
                found = _found(_parquet_text(fs, str(f)), user_id, canaries)
            except Exception:  # noqa: BLE001 - not a readable Parquet file: search its bytes
                found = []
        found = sorted(set(found + _found(f.read_bytes().decode("latin-1"), user_id, canaries)))
        if found:
            hits.append({"object": str(f.relative_to(p)), "found": found})
    return {"path": path, "exists": True, "hits": hits}
