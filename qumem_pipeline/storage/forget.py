"""Forgetting a user: remove them from every table, index and the warehouse, and keep them out.

The archive a user came from usually still exists (it is the source system's data), so a
forgotten user would reappear at the next discovery. The registry keeps an unsalted
sha256 of each forgotten id (not the id itself) and ingest/discovery skip matching users.
"""

import hashlib
import json
import os
from pathlib import Path

from qumem_pipeline.contracts.ids import validate_user_id


def _digest(user_id: str) -> str:
    return hashlib.sha256(user_id.encode("utf-8")).hexdigest()


class ForgetRegistry:
    def __init__(self, root: str | os.PathLike):
        self.path = Path(root) / "_meta" / "forgotten.json"
        self._digests: set[str] = set(json.loads(self.path.read_text())) if self.path.exists() else set()

    def __len__(self) -> int:
        return len(self._digests)

    def contains(self, user_id: str | None) -> bool:
        return user_id is not None and _digest(user_id) in self._digests

    def add(self, user_id: str) -> None:
        validate_user_id(user_id)
        self._digests.add(_digest(user_id))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self._digests)))
        os.replace(tmp, self.path)

    def remove(self, user_id: str) -> None:
        """Re-admit a user (e.g. they re-consented); their data comes back on the next ingest."""
        self._digests.discard(_digest(user_id))
        if self.path.exists() or self._digests:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(sorted(self._digests)))


def forget_user(data_root: str | os.PathLike, warehouse_path: str | os.PathLike, user_id: str) -> dict:
    """Delete every trace of `user_id` under the data root and in the warehouse; record the tombstone."""
    from qumem_pipeline.storage.layout import DataLayout
    from qumem_pipeline.storage.warehouse import Warehouse

    validate_user_id(user_id)
    ForgetRegistry(data_root).add(user_id)
    removed = DataLayout(data_root).delete_user(user_id)
    deleted_rows = Warehouse(warehouse_path).delete_user(user_id)
    return {"removed_dirs": [str(p) for p in removed], "warehouse_rows_deleted": deleted_rows}
