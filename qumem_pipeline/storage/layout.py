"""The per-user table interface every stage uses, over the Delta table store (storage/table_store.py).

Stages keep thinking in "this user's rows of table T": `write_user_table`, `read_user_table`,
`read_table`, `users_in`, `delete_user`. Underneath there are no per-user files: each table is one
Delta table partitioned by user bucket, and `replace_users` writes all of a run's users of a table
in ONE transaction (assets use it), so a killed run leaves the previous version and a rerun converges.
A user written with no rows stays "present, empty" (a placeholder row the reads hide), which is how
stages tell "nothing here" from "not materialized yet".

`write_parquet` / `atomic_write_parquet` remain for files that are not tables (exports, benches).
"""

import itertools
import os
import re
import threading
from pathlib import Path
from typing import Iterable

import polars as pl

from qumem_pipeline.contracts.ids import validate_user_id
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.storage.table_store import PLACEHOLDER, STORE_COLUMNS, KEY, TableStore, is_uri

PART_FILE = "part-0.parquet"
TMP_PREFIX = ".tmp-"
# Renames are atomic against process crashes without fsync; QUMEM_FSYNC=1 also survives power loss.
FSYNC = os.environ.get("QUMEM_FSYNC", "0") == "1"
_TMP_SEQ = itertools.count()  # next() on a count is atomic under the GIL
_TMP_PID = re.compile(re.escape(TMP_PREFIX) + r"(\d+)-")


def temp_prefix() -> str:
    """Temp names carry the writer's pid, so cleanup removes only files whose writer is gone."""
    return f"{TMP_PREFIX}{os.getpid()}-"


def write_parquet(df: pl.DataFrame, path: str | os.PathLike) -> None:
    """Encode one file with polars' native writer (zstd, statistics on; the GIL is released)."""
    df.write_parquet(path, compression="zstd", statistics=True)


def atomic_write_parquet(df: pl.DataFrame, target: Path) -> Path:
    """Write `target` via a pid-named temp file and a rename: readers see the old file or the new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{temp_prefix()}{threading.get_ident()}-{next(_TMP_SEQ)}.parquet"
    try:
        write_parquet(df, tmp)
        if FSYNC:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _check_key(user_id: str) -> str:
    if user_id != UNATTRIBUTED:
        validate_user_id(user_id)
    return user_id


def _data(df: pl.DataFrame) -> pl.DataFrame:
    """A store read as the stage wrote it: placeholder rows and store columns dropped."""
    if df[PLACEHOLDER].any():  # else skip a copy of every column
        df = df.filter(~pl.col(PLACEHOLDER))
    return df.drop([c for c in STORE_COLUMNS if c in df.columns])


def _ascending(users: list[str]) -> bool:
    return all(a < b for a, b in zip(users, users[1:]))


class DataLayout:
    """Reads and transactional writes of every per-user table under the data root (local or URI)."""

    def __init__(self, root: str | os.PathLike, n_buckets: int | None = None):
        self.root = str(root) if is_uri(root) else Path(root)
        self.store = TableStore(self.root, n_buckets=n_buckets)

    @property
    def is_remote(self) -> bool:
        return isinstance(self.root, str)

    def table_dir(self, table: str) -> str:
        """Where the table lives (its Delta table URI), for messages and external readers."""
        return self.store.uri(table)

    # ------------------------------------------------------------------ writes
    def write_user_table(self, table: str, user_id: str, df: pl.DataFrame) -> int:
        """Replace one user's rows of `table` (an empty frame is recorded too). One commit per call:
        stages writing many users use `replace_users`."""
        return self.store.replace(table, {_check_key(user_id): df})

    def replace_users(self, table: str, users: Iterable[str], df: pl.DataFrame, key: str = "user_id") -> int:
        """Replace all of `users`' rows of `table` with `df` (rows keyed by `df[key]`) in ONE transaction;
        users without rows in `df` are recorded as present and empty."""
        users = [_check_key(u) for u in dict.fromkeys(users)]
        return self.store.replace_keyed(table, users, df, key_column=key)

    def replace_parts(self, table: str, parts: dict[str, pl.DataFrame]) -> int:
        """One transaction from user -> rows (for rows whose key is not a column, e.g. unattributed)."""
        return self.store.replace(table, {_check_key(u): f for u, f in parts.items()})

    def write_or_remove_user_table(self, table: str, user_id: str, df: pl.DataFrame) -> None:
        """For sparse tables (quarantines, query states): rows -> write; none -> drop a stale partition."""
        if df.height:
            self.write_user_table(table, user_id, df)
        else:
            self.remove_user_table(table, user_id)

    def replace_or_remove_users(self, table: str, users: Iterable[str], df: pl.DataFrame, key: str = "user_id") -> int:
        """Sparse tables, batched: users with rows are replaced, users without are removed; one commit."""
        users = [_check_key(u) for u in dict.fromkeys(users)]
        return self.store.replace_keyed(table, users, df, key_column=key, placeholders=False)

    def remove_user_table(self, table: str, user_id: str) -> bool:
        """Drop one user's rows of `table` (e.g. their quarantine is now empty)."""
        return self.store.delete(table, [_check_key(user_id)]) > 0

    # ------------------------------------------------------------------ reads
    def read_user_table(self, table: str, user_id: str) -> pl.DataFrame | None:
        """The user's rows, an empty frame if written empty, None if never written."""
        df = self.store.read(table, [_check_key(user_id)])
        if df is None or df.height == 0:
            return None
        return _data(df)

    def count_user_rows(self, table: str, user_id: str) -> int:
        """How many rows the user has (0 if none or never written), reading only the key columns."""
        df = self.store.read(table, [_check_key(user_id)], columns=[])
        return 0 if df is None else int((~df[PLACEHOLDER]).sum())

    def read_users(self, table: str, users: Iterable[str]) -> dict[str, pl.DataFrame]:
        """user -> rows for the present ones among `users`, in one read."""
        users = [_check_key(u) for u in dict.fromkeys(users)]
        df = self.store.read(table, users)
        if df is None or df.height == 0:
            return {}
        out = {k[0]: _data(v) for k, v in df.partition_by(KEY, as_dict=True, maintain_order=True).items()}
        return {u: out[u] for u in users if u in out}

    def read_table(self, table: str, user_ids: list[str] | None = None) -> pl.DataFrame | None:
        """Rows of `user_ids` (all users when None), in user order; None when none of them is present."""
        df = self.store.read(table, None if user_ids is None else [_check_key(u) for u in user_ids])
        if df is None or df.height == 0:
            return None
        if user_ids is not None and not _ascending(user_ids):  # the store returns user order already
            order = {u: i for i, u in enumerate(dict.fromkeys(user_ids))}
            df = df.with_columns(pl.col(KEY).replace_strict(order, return_dtype=pl.Int64).alias("__o")) \
                .sort("__o", maintain_order=True).drop("__o")
        return _data(df)

    def users_present(self, table: str, user_ids: Iterable[str]) -> list[str]:
        """Which of `user_ids` have been written to `table` (with rows or empty)."""
        user_ids = [_check_key(u) for u in user_ids]
        df = self.store.read(table, user_ids, columns=[KEY])
        have = set() if df is None else set(df[KEY].unique().to_list())
        return [u for u in user_ids if u in have]

    def tables(self) -> list[str]:
        return self.store.tables()

    def users_in(self, table: str) -> list[str]:
        return self.store.users_in(table)

    # ------------------------------------------------------------------ deletion / maintenance
    def delete_user(self, user_id: str) -> list[str]:
        """Delete the user's rows from every table (one commit per table that held them); returns those tables.
        Old file versions stay until `vacuum` (forget runs it with zero retention)."""
        validate_user_id(user_id)
        return [t for t in self.tables() if self.store.delete(t, [user_id]) > 0]

    def vacuum(self, retention_hours: int | None = None) -> dict[str, int]:
        return {t: len(self.store.vacuum(t, retention_hours)) for t in self.tables()}

    def compact(self) -> dict[str, dict]:
        return {t: self.store.compact(t) for t in self.tables()}
