"""Where this data root's rows were loaded into DuckDB warehouses (host, path): a forget must reach each.

A root-level registry table (not a user table), appended to by a warehouse's first load."""

import os
import socket
from pathlib import Path

import polars as pl

from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.storage.table_store import TableStore

WAREHOUSE_LOCATIONS = "warehouse_locations"


WAREHOUSE_HOST_ENV = "QUMEM_WAREHOUSE_HOST"


def _host() -> str:
    """Where a warehouse path is reachable: `QUMEM_WAREHOUSE_HOST`, a name for the filesystem it lives
    on (every pod mounting one volume names it alike: on Kubernetes each step is a pod of its own,
    and a hostname per pod made every forget find the warehouse "on another host"), else
    `QUMEM_HOST_ID`, else the hostname."""
    return os.environ.get(WAREHOUSE_HOST_ENV) or os.environ.get("QUMEM_HOST_ID") or socket.gethostname()


def record_warehouse(store: TableStore, path: str | os.PathLike) -> None:
    """Remember where this data root's rows were loaded, so a forget reaches it from anywhere."""
    path, host = str(Path(path).absolute()), _host()
    store = store.plain_handle()  # a registry of the root, not a user table: any bucket count
    known = warehouse_locations(store)
    if (host, path) in known:
        return
    row = pl.DataFrame({"owner": [UNATTRIBUTED], "host": [host], "path": [path]})
    store.append(WAREHOUSE_LOCATIONS, row, key_column="owner", guarded=False)


def warehouse_locations(store: TableStore) -> set[tuple[str, str]]:
    df = store.plain_handle().read(WAREHOUSE_LOCATIONS)
    if df is None or not df.height:
        return set()
    return set(df.filter(~pl.col("user_placeholder")).select("host", "path").iter_rows())
