"""Forgetting a user: out of every table, log, file and warehouse, and kept out while runs go on.

The order is what makes a forget linearizable with concurrent runs (ARCHITECTURE.md, "Erasure and
concurrency"):
1. a keyed tombstone row is appended to the registry (`storage/tombstones.py`): from here on every
   commit of every writer drops the user's rows (`TableStore` reads the registry after its snapshot);
2. per table: the erase epoch is bumped (a metadata commit, so any in-flight commit on an older
   snapshot fails and is retried against the registry), then the user's rows are deleted;
3. per table: the files that hold the user and that the latest version does not reference (the
   deleted files, and untracked files of writers whose commit can no longer land) are removed
   from the user's bucket only, after waiting for delta-rs' staging files there to settle; no
   other writer's file is touched, so no live writer loses a file it is about to commit;
4. per table: a fresh checkpoint is written and every log entry that names the user (add stats,
   predicates) is rewritten without user ids, older checkpoints removed; commit files are never
   deleted, so a writer's conflict check always finds the commits it must read;
5. every warehouse the data root has ever loaded (recorded in the `warehouse_locations` table) has
   the user deleted and its file rewritten; one this host cannot reach fails the forget (rerun it
   where it can: every step is idempotent);
6. every Parquet export made from a warehouse (`qumem export`, recorded in `export_locations`
   before its first file) has its files holding the user rewritten without their rows; likewise
   one this host cannot reach fails the forget.
The Dagster instance is scrubbed by the Dagster layer (`assets/forget.py`).
"""

import json
import os
import re
from pathlib import Path

import polars as pl
import pyarrow.fs as pafs

from qumem_pipeline.contracts.ids import validate_user_id
from qumem_pipeline.storage.table_store import TableStore, is_uri
from qumem_pipeline.storage.tombstones import ERASED, READMIT, REGISTRY_TABLE, Tombstones
from qumem_pipeline.storage.warehouse_locations import (EXPORT_LOCATIONS, WAREHOUSE_LOCATIONS, _host,
                                                         export_locations, record_warehouse, warehouse_locations)

LEGACY_REGISTRY = Path("_meta") / "forgotten.json"  # before the table store (storage/migrate.py)


class StoreUnreachable(RuntimeError):
    """A store that holds (or may hold) the user could not be reached: the forget is not complete."""


def _digest(user_id: str) -> str:
    """The pre-HMAC tombstone (plain sha256): still matched, never written for a new forget."""
    import hashlib

    return hashlib.sha256(user_id.encode("utf-8")).hexdigest()


class ForgetRegistry:
    """The registry as ingest and discovery use it (a thin view over `Tombstones`)."""

    def __init__(self, root: str | os.PathLike):
        self.store = TableStore(root)
        self.tombstones = self.store.tombstones()
        self.tombstones.refresh()
        legacy = None if is_uri(root) else Path(root) / LEGACY_REGISTRY
        self._legacy = set(json.loads(legacy.read_text())) if legacy is not None and legacy.exists() else set()

    def __len__(self) -> int:
        return len(self.tombstones) + len(self._legacy)

    def contains(self, user_id: str | None) -> bool:
        if user_id is None:
            return False
        if self._legacy and _digest(user_id) in self._legacy:
            return True
        return bool(self.tombstones.forgotten_among([user_id], refresh=False))

    def among(self, user_ids) -> set[str]:
        """Which of `user_ids` are forgotten (one registry read for all)."""
        out = self.tombstones.forgotten_among(user_ids)
        if self._legacy:
            out |= {u for u in user_ids if u is not None and _digest(u) in self._legacy}
        return out

    def add(self, user_id: str) -> None:
        validate_user_id(user_id)
        self.tombstones.record([user_id])
        self.tombstones.refresh()

    def add_legacy_digests(self, digests: list[str]) -> None:
        """Carry a pre-table registry's sha256 digests over (storage/migrate.py), as legacy rows. They
        are `erased`: the old layout deleted those users when it recorded them."""
        from datetime import datetime, timezone

        from qumem_pipeline.storage.tombstones import LEGACY_KEY_ID, REGISTRY_KEY, SCHEMA

        now = datetime.now(timezone.utc)
        df = pl.DataFrame([{"digest": d, "key_id": LEGACY_KEY_ID, "action": ERASED, "at": now} for d in digests],
                          schema=SCHEMA).with_columns(pl.lit(REGISTRY_KEY).alias("_owner"))
        if df.height:
            self.tombstones.store.append(REGISTRY_TABLE, df, key_column="_owner", guarded=False)
        self.tombstones.refresh()

    def remove(self, user_id: str) -> None:
        """Re-admit a user (e.g. they re-consented); their data comes back on the next ingest."""
        validate_user_id(user_id)
        self.tombstones.record([user_id], action=READMIT)
        self.tombstones.refresh()


# ---------------------------------------------------------------------------------------- tables
def scrub_log(store: TableStore, table: str, needles: list[str]) -> int:
    """Checkpoint the latest version, rewrite every commit file that names a needle without any
    user id (add/remove statistics and operation predicates dropped: whole files, so two forgets
    rewriting one file concurrently both leave it clean), and remove the older checkpoints.
    Commit files stay (a writer's conflict check reads them; a missing one would let a stale writer
    re-create it). Returns the files rewritten."""
    if store.fresh_checkpoint(table) < 0:
        return 0
    fs, base = store.filesystem()
    log = f"{base}/{table}/_delta_log"
    rewritten = 0
    for info in fs.get_file_info(pafs.FileSelector(log, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        if not info.base_name.endswith(".json") or info.base_name.startswith("_"):
            continue
        with fs.open_input_stream(info.path) as f:
            text = f.read().decode("utf-8")
        if not any(n in text for n in needles):
            continue
        clean = "\n".join(_scrub_line(line) for line in text.splitlines()) + "\n"
        if any(re.search(f"(?<![A-Za-z0-9_.\\-]){re.escape(n)}(?![A-Za-z0-9_.\\-])", clean) for n in needles):
            raise RuntimeError(f"{info.path}: a user id survives the log scrub (unknown action)")
        _atomic_put(fs, info.path, clean.encode("utf-8"))
        rewritten += 1
    return rewritten


def _scrub_line(line: str) -> str:
    if not line.strip():
        return line
    action = json.loads(line)
    for kind, body in action.items():
        if kind == "commitInfo":
            body.pop("operationParameters", None)
            for k in [k for k in body if k.startswith("qumem.") and k not in ("qumem.operation", "qumem.users")]:
                body.pop(k)
        elif kind in ("add", "remove"):
            body.pop("stats", None)
            body.pop("tags", None)
    return json.dumps(action, separators=(",", ":"))


def _atomic_put(fs, path: str, data: bytes) -> None:
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{path}.scrub-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:  # an object PUT replaces the whole object atomically
        with fs.open_output_stream(path) as f:
            f.write(data)


def erase_from_tables(store: TableStore, user_id: str) -> dict:
    """Delete the user from every table, mark the erasure finished in the registry, then remove the
    unreferenced files still holding their rows. The files go only after the mark: until every
    delete of the user has committed, such a file may be a concurrent commit's, not yet in the log
    (tests/test_erasure_concurrency.py, `test_a_cleanup_leaves_a_file_an_unfinished_forget_may_commit`)."""
    report = {"tables": [], "rows_deleted": {}, "files_removed": {}, "log_files_rewritten": {}}
    tables = [t for t in store.tables() if t not in (REGISTRY_TABLE, WAREHOUSE_LOCATIONS, EXPORT_LOCATIONS)]
    for t in tables:
        store.n_buckets = None  # erase from every table, whatever bucket count it was made with
        store.bump_erase_epoch(t)
        report["rows_deleted"][t] = store.delete(t, [user_id])
        report["log_files_rewritten"][t] = scrub_log(store, t, [user_id])
    store.tombstones().record([user_id], action=ERASED)
    for t in tables:
        store.n_buckets = None
        report["files_removed"][t] = len(store.remove_dead_files(t, [user_id]))
    report["tables"] = [t for t in tables if report["rows_deleted"][t] or report["files_removed"][t]
                        or report["log_files_rewritten"][t]]
    return report


# ---------------------------------------------------------------------------------------- warehouses
def erase_from_warehouses(store: TableStore, configured: str | os.PathLike | None, user_id: str) -> dict:
    """Delete the user from every warehouse this root has loaded, and the configured one."""
    from qumem_pipeline.storage.warehouse import Warehouse

    targets = warehouse_locations(store)
    if configured is not None:
        targets.add((_host(), str(Path(configured).absolute())))
    out, unreachable = {}, []
    for host, path in sorted(targets):
        if host != _host():
            unreachable.append(f"{path} on host {host}")
            continue
        out[path] = Warehouse(path).delete_user(user_id)  # a missing file holds nothing
    if unreachable:
        raise StoreUnreachable(
            "forget is not complete: warehouse(s) " + "; ".join(unreachable) + f" cannot be reached from {_host()}. "
            "The tables are erased; rerun the same forget on that host (QUMEM_HOST_ID names a host) to finish")
    return out


def erase_from_exports(store: TableStore, user_id: str) -> dict:
    """Rewrite every Parquet file of every recorded export folder that holds the user, without their
    rows (written beside, then swapped in: the old file's bytes go with it). Run after the warehouses:
    an export made since reads a warehouse the user is gone from."""
    import duckdb

    out, unreachable = {}, []
    for host, path in sorted(export_locations(store)):
        if host != _host():
            unreachable.append(f"{path} on host {host}")
            continue
        rewritten = {}
        for f in sorted(Path(path).glob("*.parquet")):
            src = str(f).replace("'", "''")
            with duckdb.connect() as con:
                cols = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet('{src}')").fetchall()}
                if "user_id" not in cols:
                    continue
                n = con.execute(f"SELECT count(*) FROM read_parquet('{src}') WHERE user_id = ?", [user_id]).fetchone()[0]
                if not n:
                    continue
                tmp = f.with_name(f".forget-{f.name}")
                con.execute(f"COPY (SELECT * FROM read_parquet('{src}') WHERE user_id IS DISTINCT FROM ?) "
                            f"TO '{str(tmp).replace(chr(39), chr(39) * 2)}' (FORMAT parquet, COMPRESSION zstd)", [user_id])
            os.replace(tmp, f)
            rewritten[f.name] = n
        out[path] = rewritten
    if unreachable:
        raise StoreUnreachable(
            "forget is not complete: export folder(s) " + "; ".join(unreachable) + f" cannot be reached from {_host()}. "
            "The tables and warehouses are erased; rerun the same forget on that host to finish")
    return out


def forget_user(data_root: str | os.PathLike, warehouse_path: str | os.PathLike | None, user_id: str) -> dict:
    """Delete every trace of `user_id` under the data root and in every warehouse; keep the tombstone."""
    validate_user_id(user_id)
    store = TableStore(data_root)
    tombs = store.tombstones()
    tombs.refresh()
    if not tombs.forgotten_among([user_id], refresh=False):  # a rerun adds no second row
        tombs.record([user_id])
    report = erase_from_tables(store, user_id)
    report["warehouse_rows_deleted"] = erase_from_warehouses(store, warehouse_path, user_id)
    report["export_rows_deleted"] = erase_from_exports(store, user_id)
    report["removed_dirs"] = report["tables"]
    return report
