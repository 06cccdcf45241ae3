"""The DuckDB warehouse: one table per stage, refreshed per user from the Delta tables, plus Parquet export.

Stages register their table names in WAREHOUSE_TABLES; loading a set of users replaces
exactly those users' rows in one transaction, so reruns converge and other users are
untouched. A warehouse table may gather several Delta tables of one shape (WAREHOUSE_SOURCES):
`llm_ledger` holds the decomposition's ledger and those of the later LLM stages (each written by its
own asset), every row naming its `stage`, so `SELECT stage, sum(prompt_tokens), sum(completion_tokens)
FROM llm_ledger GROUP BY stage` is the cost per stage. Deleting a user rewrites the database file,
because DuckDB does not zero the pages of deleted rows and a forgotten user's text must not survive on disk.

DuckDB lets one process open a file read-write, and no reader while it does; a second process
fails at once with an IO error. Every connection therefore first takes an inter-process lock,
``flock`` on ``<warehouse>.lock`` (exclusive for writers, shared for readers), waiting up to
QUMEM_WAREHOUSE_LOCK_TIMEOUT seconds, so two runs started at once queue instead of failing.
"""

import fcntl
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb
import polars as pl

from qumem_pipeline.runtime.faults import fault_point
from qumem_pipeline.contracts.ids import USER_ID_PATTERN, validate_user_id
from qumem_pipeline.storage.layout import DataLayout, temp_prefix
from qumem_pipeline.storage.warehouse_locations import record_warehouse

LOCK_TIMEOUT_S = float(os.environ.get("QUMEM_WAREHOUSE_LOCK_TIMEOUT", "600"))
_held = threading.local()  # lock files this thread holds: nested connects (delete -> compact) re-enter


# Where the warehouse keeps what it loaded last from sources outside any user's partition; a schema of
# its own, so nothing that lists the `main` tables (exports, counts, forget's delete) sees it.
_META_SCHEMA_SQL = "CREATE SCHEMA IF NOT EXISTS qumem_meta"
_META_TABLE_SQL = "CREATE TABLE IF NOT EXISTS qumem_meta.loaded_sources (source VARCHAR PRIMARY KEY, state VARCHAR)"

class WarehouseBusy(TimeoutError):
    """Another process held the warehouse lock for longer than the timeout."""

# Per-user tables mirrored into the warehouse, in load order. Later stages add theirs here.
WAREHOUSE_TABLES: list[str] = [
    "turns", "quarantine", "fingerprints", "episodes", "memories", "memory_quarantine", "llm_ledger",
    "query_states", "query_quarantine", "persona_profiles",
]


# Warehouse table -> the Delta tables whose rows it holds (a table not named here holds its own), and
# the `stage` a source's rows take where they name none (decomposition rows written before the column).
WAREHOUSE_SOURCES: dict[str, tuple[str, ...]] = {
    "llm_ledger": ("llm_ledger", "persona_llm_ledger", "query_llm_ledger"),
}
SOURCE_STAGE_DEFAULT: dict[str, str] = {"llm_ledger": "decompose"}


def read_sources(layout: DataLayout, table: str, user_ids: list[str] | None) -> "pl.DataFrame | None":
    """The rows of warehouse table `table` for these users: its Delta sources' rows, stacked."""
    frames = []
    for src in WAREHOUSE_SOURCES.get(table, (table,)):
        df = layout.read_table(src, user_ids)
        if df is None:
            continue
        if src in SOURCE_STAGE_DEFAULT:
            stage = pl.lit(SOURCE_STAGE_DEFAULT[src], pl.String)
            df = df.with_columns((pl.col("stage").fill_null(stage) if "stage" in df.columns else stage).alias("stage"))
        frames.append(df)
    if not frames:
        return None
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")


def default_warehouse_path(data_root: str | os.PathLike) -> Path:
    """<data_root>/warehouse.duckdb for a local root; DuckDB needs a local file, so for an object-store
    root it is ./warehouse.duckdb (set QUMEM_WAREHOUSE to choose)."""
    if "://" in str(data_root):
        return Path.cwd() / "warehouse.duckdb"
    return Path(data_root) / "warehouse.duckdb"


def register_table(name: str) -> None:
    if name not in WAREHOUSE_TABLES:
        WAREHOUSE_TABLES.append(name)


class Warehouse:
    def __init__(self, path: str | os.PathLike, lock_timeout_s: float | None = None):
        self.path = Path(path)
        self.lock_timeout_s = LOCK_TIMEOUT_S if lock_timeout_s is None else lock_timeout_s

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def lock(self, shared: bool = False):
        """Hold the inter-process warehouse lock (re-entrant within a thread)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = str(self.lock_path.resolve())
        held = _held.__dict__.setdefault("paths", set())
        if key in held:
            yield
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise WarehouseBusy(
                            f"warehouse {self.path} is busy: another process has held {self.lock_path} for more than "
                            f"{self.lock_timeout_s:g}s (raise QUMEM_WAREHOUSE_LOCK_TIMEOUT, or wait for that run to finish)"
                        ) from None
                    time.sleep(0.05)
            held.add(key)
            try:
                yield
            finally:
                held.discard(key)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextmanager
    def connect(self, read_only: bool = False):
        """A DuckDB connection, opened and closed under the warehouse lock."""
        with self.lock(shared=read_only):
            con = duckdb.connect(str(self.path), read_only=read_only)
            try:
                yield con
            finally:
                con.close()

    def load_users(self, layout: DataLayout, user_ids: list[str], tables: list[str] | None = None,
                   progress=None) -> dict[str, int]:
        """Replace the given users' rows in every table from the Delta tables' active files
        (`progress(done, total)` after each table).

        Rows are read through deltalake/pyarrow (DuckDB's delta extension is downloaded at first use,
        which a machine without network cannot do) and handed to DuckDB as Arrow."""
        for u in user_ids:
            validate_user_id(u)
        record_warehouse(layout.store, self.path)  # before any row lands: every forget must find this file
        loaded: dict[str, int] = {}
        with self.connect() as con:
            # Under the writer lock, which a forget's delete also takes: a user forgotten before this
            # point is dropped here, one forgotten after is deleted by that forget.
            gone = layout.store.tombstones().forgotten_among(user_ids)
            names = list(tables or WAREHOUSE_TABLES)
            for i, table in enumerate(names, start=1):
                if progress is not None:
                    progress(i - 1, len(names))
                df = read_sources(layout, table, user_ids)
                if df is not None and gone and "user_id" in df.columns:
                    df = df.filter(~pl.col("user_id").is_in(sorted(gone)))
                exists = self._has_table(con, table)
                if df is None and not exists:
                    continue
                self._replace(con, table, df, 'user_id IN (SELECT unnest(?))', [user_ids], exists)
                fault_point("warehouse.table")  # crash tests: some tables refreshed, the rest not yet
                # what the transaction just put there (a count query would scan the column once more)
                loaded[table] = 0 if df is None else df.height
            if progress is not None:
                progress(len(names), len(names))
        return loaded

    def load_unattributed(self, layout: DataLayout, key: str) -> int | None:
        """Mirror quarantined rows that have no valid user id (their own partition) into `quarantine`.
        Every warehouse step calls this, and a reload deletes with a pattern match over the whole
        `quarantine` table, so it is skipped (None) while the Delta files that may hold those rows are
        the ones last loaded (their digest, kept in `qumem_meta.loaded_sources` beside the tables)."""
        state = layout.store.user_state("quarantine", key)
        source = f"quarantine/{key}"
        with self.connect() as con:
            if state is not None and self._loaded_state(con, source) == state:
                return None
            df = layout.read_user_table("quarantine", key)
            if df is None:
                return 0
            self._replace(con, "quarantine", df,
                          "user_id IS NULL OR NOT regexp_full_match(user_id, ?) OR contains(user_id, '..')",
                          [USER_ID_PATTERN.pattern], self._has_table(con, "quarantine"),
                          after=[(_META_SCHEMA_SQL, []), (_META_TABLE_SQL, []),
                                 ("INSERT OR REPLACE INTO qumem_meta.loaded_sources VALUES (?, ?)", [source, state])])
        return df.height

    @staticmethod
    def _loaded_state(con, source: str) -> str | None:
        """The state last loaded from `source` (None: never, or a warehouse without the meta table:
        `compact` copies the `main` tables only, so a compacted warehouse reloads once)."""
        if not con.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'qumem_meta' "
                           "AND table_name = 'loaded_sources'").fetchone()[0]:
            return None
        row = con.execute("SELECT state FROM qumem_meta.loaded_sources WHERE source = ?", [source]).fetchone()
        return None if row is None else row[0]

    def _replace(self, con, table: str, df, where: str, params: list, exists: bool,
                 after: list[tuple[str, list]] = ()) -> None:
        """In one DuckDB transaction: delete the rows matching `where`, insert `df` (new columns added),
        then the statements `after`."""
        con.execute("BEGIN TRANSACTION")
        try:
            if df is not None:
                con.register("incoming", df.to_arrow())
            if not exists:
                con.execute(f'CREATE TABLE "{table}" AS SELECT * FROM incoming LIMIT 0')
            con.execute(f'DELETE FROM "{table}" WHERE {where}', params)
            if df is not None:
                self._add_missing_columns(con, table)
                con.execute(f'INSERT INTO "{table}" BY NAME SELECT * FROM incoming')
            for sql, args in after:
                con.execute(sql, args)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        finally:
            if df is not None:
                con.unregister("incoming")

    @staticmethod
    def _has_table(con: duckdb.DuckDBPyConnection, table: str) -> bool:
        return bool(
            con.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = ? AND table_schema = 'main'",
                [table],
            ).fetchone()[0]
        )

    @staticmethod
    def _add_missing_columns(con: duckdb.DuckDBPyConnection, table: str) -> None:
        """A stage that gains a column must not break loading into an older warehouse."""
        have = {r[0] for r in con.execute(f'DESCRIBE "{table}"').fetchall()}
        for name, dtype, *_ in con.execute("DESCRIBE SELECT * FROM incoming").fetchall():
            if name not in have:
                con.execute(f'ALTER TABLE "{table}" ADD COLUMN "{name}" {dtype}')

    def counts(self) -> dict[str, int]:
        if not self.path.exists():
            return {}
        with self.connect(read_only=True) as con:
            names = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main' ORDER BY 1").fetchall()]
            return {n: con.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names}

    def users(self, table: str = "turns") -> list[str]:
        if not self.path.exists():
            return []
        with self.connect(read_only=True) as con:
            if not self._has_table(con, table):
                return []
            return [r[0] for r in con.execute(f'SELECT DISTINCT user_id FROM "{table}" ORDER BY 1').fetchall()]

    def delete_user(self, user_id: str) -> dict[str, int]:
        """Delete the user everywhere, then rewrite the file so no freed page keeps their text."""
        validate_user_id(user_id)
        if not self.path.exists():
            return {}
        deleted: dict[str, int] = {}
        with self.lock():  # no other writer between the delete and the rewrite
            with self.connect() as con:
                names = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main'").fetchall()]
                for n in names:
                    cols = {r[0] for r in con.execute(f'DESCRIBE "{n}"').fetchall()}
                    if "user_id" in cols:
                        deleted[n] = con.execute(f'DELETE FROM "{n}" WHERE user_id = ?', [user_id]).fetchone()[0]
            self.compact()
        return deleted

    def compact(self) -> None:
        """Copy every table into a fresh database file and atomically swap it in."""
        tmp = self.path.with_name(f"{temp_prefix()}{self.path.name}")
        tmp.unlink(missing_ok=True)
        with self.lock():  # the swap, too, must not race another writer
            with self.connect() as con:
                con.execute(f"ATTACH '{_sql_path(tmp)}' AS fresh")
                names = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database() AND table_schema='main'").fetchall()]
                for n in names:
                    con.execute(f'CREATE TABLE fresh."{n}" AS SELECT * FROM main."{n}"')
                con.execute("DETACH fresh")
            os.replace(tmp, self.path)
            Path(str(self.path) + ".wal").unlink(missing_ok=True)

    def export_parquet(self, out_dir: str | os.PathLike, store=None) -> dict[str, str]:
        """COPY every table to `<out_dir>/<table>.parquet` for other warehouses. With the data root's
        `store`, the folder is recorded first (`record_export`), so every later forget rewrites it."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if store is not None:
            from qumem_pipeline.storage.warehouse_locations import record_export

            record_export(store, out)
        written = {}
        with self.connect(read_only=True) as con:
            names = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main' ORDER BY 1").fetchall()]
            for n in names:
                target = out / f"{n}.parquet"
                tmp = out / f"{temp_prefix()}{n}.parquet"
                con.execute(f"COPY (SELECT * FROM \"{n}\" ORDER BY ALL) TO '{_sql_path(tmp)}' (FORMAT parquet, COMPRESSION zstd)")
                os.replace(tmp, target)
                written[n] = str(target)
        return written


def _sql_path(p: Path) -> str:
    return str(p).replace("'", "''")
