"""Forgetting a user: remove them from every table, index and the warehouse, and keep them out.

Deleting rows from a Delta table only writes new files without them: the old files stay for time
travel until vacuum. So forget deletes the user's rows from every table, then vacuums every table
with zero retention (every unreferenced file removed, orphans of killed writers included) and
expires the transaction log (older commits name the users they touched): afterwards no object of
the data root holds the user's data.

The archive a user came from usually still exists (it is the source system's data), so a
forgotten user would reappear at the next discovery. The registry keeps an unsalted
sha256 of each forgotten id (not the id itself), as rows of the `forgotten_users` table, and
ingest/discovery skip matching users.
"""

import hashlib
import json
import os
from pathlib import Path

import polars as pl

from qumem_pipeline.contracts.ids import validate_user_id
from qumem_pipeline.storage.table_store import TableStore, is_uri

REGISTRY_TABLE = "forgotten_users"
REGISTRY_KEY = "_registry"  # the registry is one partition key, not a user
LEGACY_REGISTRY = Path("_meta") / "forgotten.json"  # before the table store
# Files outside the log (a killed writer's orphans, or a live writer's not yet committed) younger
# than this survive forget's vacuum. 0 = strict erasure; a run writing while forget vacuums then
# fails its reads of the touched bucket until rerun. Raise it where forgets overlap runs.
ORPHAN_GRACE_HOURS = int(os.environ.get("QUMEM_FORGET_ORPHAN_GRACE_HOURS", "0"))


def _digest(user_id: str) -> str:
    return hashlib.sha256(user_id.encode("utf-8")).hexdigest()


class ForgetRegistry:
    def __init__(self, root: str | os.PathLike):
        self.store = TableStore(root)
        df = self.store.read(REGISTRY_TABLE, [REGISTRY_KEY])
        self._digests: set[str] = set() if df is None else set(df.filter(~df["user_placeholder"])["digest"].to_list())
        legacy = None if is_uri(root) else Path(root) / LEGACY_REGISTRY
        if legacy is not None and legacy.exists():
            self._digests |= set(json.loads(legacy.read_text()))

    def __len__(self) -> int:
        return len(self._digests)

    def contains(self, user_id: str | None) -> bool:
        return user_id is not None and _digest(user_id) in self._digests

    def add(self, user_id: str) -> None:
        validate_user_id(user_id)
        self._digests.add(_digest(user_id))
        self._save()

    def remove(self, user_id: str) -> None:
        """Re-admit a user (e.g. they re-consented); their data comes back on the next ingest."""
        self._digests.discard(_digest(user_id))
        if self._digests or self.store.exists(REGISTRY_TABLE):
            self._save()

    def digests(self) -> list[str]:
        return sorted(self._digests)

    def _save(self) -> None:
        df = pl.DataFrame({"digest": sorted(self._digests)}, schema={"digest": pl.String})
        self.store.replace(REGISTRY_TABLE, {REGISTRY_KEY: df})


def forget_user(data_root: str | os.PathLike, warehouse_path: str | os.PathLike, user_id: str) -> dict:
    """Delete every trace of `user_id` under the data root and in the warehouse; record the tombstone."""
    from qumem_pipeline.storage.layout import DataLayout
    from qumem_pipeline.storage.warehouse import Warehouse

    validate_user_id(user_id)
    ForgetRegistry(data_root).add(user_id)
    layout = DataLayout(data_root)
    tables = layout.delete_user(user_id)
    vacuumed = {}
    for t in layout.tables():  # every table: a killed writer's orphan file may hold the user anywhere
        vacuumed[t] = len(layout.store.vacuum(t, retention_hours=0, orphans_grace_hours=ORPHAN_GRACE_HOURS))
        layout.store.expire_log(t)
    deleted_rows = Warehouse(warehouse_path).delete_user(user_id)
    return {"removed_dirs": tables, "tables": tables, "files_vacuumed": vacuumed,
            "warehouse_rows_deleted": deleted_rows}
