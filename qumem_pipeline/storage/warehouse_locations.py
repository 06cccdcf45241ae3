"""Where this data root's rows were copied outside it (host, path): DuckDB warehouses and the Parquet
exports made from them (`qumem export`). A forget must reach each.

Root-level registry tables (not user tables), appended to before a location's first rows land."""

import os
import socket
from pathlib import Path

import polars as pl

from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.storage.table_store import TableStore

WAREHOUSE_LOCATIONS = "warehouse_locations"
EXPORT_LOCATIONS = "export_locations"


WAREHOUSE_HOST_ENV = "QUMEM_WAREHOUSE_HOST"


def _host() -> str:
    """Where a warehouse path is reachable: `QUMEM_WAREHOUSE_HOST`, a name for the filesystem it lives
    on (every pod mounting one volume names it alike: on Kubernetes each step is a pod of its own,
    and a hostname per pod made every forget find the warehouse "on another host"), else
    `QUMEM_HOST_ID`, else the hostname."""
    return os.environ.get(WAREHOUSE_HOST_ENV) or os.environ.get("QUMEM_HOST_ID") or socket.gethostname()


def record_warehouse(store: TableStore, path: str | os.PathLike) -> None:
    """Remember where this data root's rows were loaded, so a forget reaches it from anywhere."""
    _record(store, WAREHOUSE_LOCATIONS, path)


def warehouse_locations(store: TableStore) -> set[tuple[str, str]]:
    return _locations(store, WAREHOUSE_LOCATIONS)


def record_export(store: TableStore, out_dir: str | os.PathLike) -> None:
    """Remember a folder Parquet exports of a warehouse were written to (before the first file)."""
    _record(store, EXPORT_LOCATIONS, out_dir)


def export_locations(store: TableStore) -> set[tuple[str, str]]:
    return _locations(store, EXPORT_LOCATIONS)


def _record(store: TableStore, table: str, path: str | os.PathLike) -> None:
    path, host = str(Path(path).absolute()), _host()
    store = store.plain_handle()  # a registry of the root, not a user table: any bucket count
    if (host, path) in _locations(store, table):
        return
    row = pl.DataFrame({"owner": [UNATTRIBUTED], "host": [host], "path": [path]})
    store.append(table, row, key_column="owner", guarded=False)


def _locations(store: TableStore, table: str) -> set[tuple[str, str]]:
    df = store.plain_handle().read(table)
    if df is None or not df.height:
        return set()
    return set(df.filter(~pl.col("user_placeholder")).select("host", "path").iter_rows())
