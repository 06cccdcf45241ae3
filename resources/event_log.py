"""SQLite event log storage that writes Dagster's event batches in one transaction per database.

A run over N users records, per asset, N `ASSET_MATERIALIZATION_PLANNED` events when it is created
and N `ASSET_MATERIALIZATION` events when its step finishes: one per partition, which is what the
UI's per-user partition status (materialized, failed, in progress) is built from, so every one of
them is kept. Dagster's stock `SqliteEventLogStorage.store_event` opens a fresh engine and
connection, and commits, for the run database, the index database and the tags-table check, per
event: about 12 ms an event on two CPU cores, most of the orchestration overhead of a 100-user run
(one-off profile: 1,000 asset events, 13 s of a 68 s run).

Dagster already hands these events to the storage in batches (`DagsterEventBatchMetadata`; when
`DAGSTER_EVENT_BATCH_SIZE` > 0 they reach `EventLogStorage.store_event_batch`, whose default stores
them one by one and which `dagster-postgres` overrides). This class overrides it for SQLite: the
same rows in the same order in the same databases and tables that `store_event` writes (run
database, index database, asset tags, asset keys), so the UI, the asset status cache and every
reader see the same history, with one transaction per database per batch. Any other event type
still goes through `store_event`.

Configured in the repository's `dagster.yaml` (the same layout as Dagster's default SQLite storage):

    event_log_storage:
      module: resources.event_log
      class: BatchedSqliteEventLogStorage
      config:
        base_dir: {env: DAGSTER_HOME}   # event databases in <base_dir>/history/runs/

`event_batch_size` (default 1000) is exported as `DAGSTER_EVENT_BATCH_SIZE` by every process that
loads the instance (webserver, daemon, run workers, `qumem`) unless the environment sets it.
"""

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from dagster._config import Field, IntSource, StringSource
from dagster._core.events import DagsterEventType
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.event_log.schema import SqlEventLogStorageTable
from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
    INDEX_SHARD_NAME,
    SqliteEventLogStorage,
)
from dagster._core.storage.sqlalchemy_compat import db_result
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._serdes import ConfigurableClassData
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

DEFAULT_EVENT_BATCH_SIZE = 1000
BATCH_SIZE_ENV = "DAGSTER_EVENT_BATCH_SIZE"

# Asset events that `store_event` writes to the run database and mirrors into the index database.
_BATCHED = frozenset({
    DagsterEventType.ASSET_MATERIALIZATION,
    DagsterEventType.ASSET_OBSERVATION,
    DagsterEventType.ASSET_MATERIALIZATION_PLANNED,
})


def event_log_dir(dagster_home: str) -> str:
    """Where Dagster's default SQLite storage keeps the event databases of a DAGSTER_HOME."""
    return os.path.join(dagster_home, "history", "runs", "")


class BatchedSqliteEventLogStorage(SqliteEventLogStorage):
    """`SqliteEventLogStorage` whose `store_event_batch` writes a batch of asset events in one
    transaction per database (module docstring). `base_dir` is the DAGSTER_HOME."""

    def __init__(self, base_dir: str, event_batch_size: int = DEFAULT_EVENT_BATCH_SIZE,
                 inst_data: ConfigurableClassData | None = None):
        self._event_batch_size = int(event_batch_size)
        if self._event_batch_size > 0:
            # Dagster reads the batch size from the environment at every event.
            os.environ.setdefault(BATCH_SIZE_ENV, str(self._event_batch_size))
        super().__init__(event_log_dir(base_dir), inst_data=inst_data)

    @classmethod
    def config_type(cls):
        return {
            "base_dir": StringSource,
            "event_batch_size": Field(IntSource, is_required=False, default_value=DEFAULT_EVENT_BATCH_SIZE),
        }

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]):
        return cls(inst_data=inst_data, **config_value)

    def store_event_batch(self, events: Sequence[EventLogEntry]) -> None:
        group: list[EventLogEntry] = []
        for event in events:  # in order: runs of asset events batched, anything else as before
            if _batchable(event):
                group.append(event)
                continue
            self._store_asset_events(group)
            group = []
            self.store_event(event)
        self._store_asset_events(group)

    def _store_asset_events(self, events: list[EventLogEntry]) -> None:
        """`store_event` for each of `events`, with one transaction per database."""
        if not events:
            return
        rows = [self._event_to_row(e) for e in events]  # serialised once, written to both databases
        by_run: dict[str, list[dict]] = {}
        for event, row in zip(events, rows):
            by_run.setdefault(event.run_id, []).append(row)
        # Both databases' transactions are open together and the index commits first: if the index
        # write fails, the run rows roll back too, so Dagster's fallback (storing the batch again one
        # event at a time) cannot duplicate them. Stock storage never holds two SQLite write locks at
        # once, so holding the run database's while waiting for the index's cannot deadlock with it.
        with self._db_lock, ExitStack() as stack:
            for run_id, run_rows in by_run.items():
                stack.enter_context(self._open_transaction(run_id)).execute(SqlEventLogStorageTable.insert(), run_rows)
            with self._open_transaction(INDEX_SHARD_NAME) as conn:
                event_ids = []
                for row in rows:  # one by one: each event's index id is needed for its tags and asset row
                    with db_result(conn, SqlEventLogStorageTable.insert().values(**row)) as result:
                        event_ids.append(result.inserted_primary_key[0])
                self._store_asset_event_tags(conn, events, event_ids)
                # The asset-keys row is an upsert that overwrites the columns each event type sets, so
                # applying, in order, the last event of each (asset, event type) leaves it exactly as
                # applying every event would.
                last: dict[tuple[str, str], int] = {}
                for i, event in enumerate(events):
                    dagster_event = event.get_dagster_event()
                    last[(dagster_event.asset_key.to_string(), dagster_event.event_type_value)] = i
                for i in sorted(last.values()):
                    self._store_asset_event(conn, events[i], event_ids[i])

    @contextmanager
    def _open_transaction(self, shard: str) -> Iterator[Connection]:
        """`SqliteEventLogStorage._connect` without taking `_db_lock` (the caller holds it), so that
        two shards' transactions can be open at once."""
        engine = create_engine(self.conn_string_for_shard(shard), poolclass=NullPool,
                               connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS})
        try:
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
            with engine.connect() as conn, conn.begin():
                yield conn
        finally:
            engine.dispose()


def _batchable(event: EventLogEntry) -> bool:
    return bool(
        event.is_dagster_event
        and event.dagster_event_type in _BATCHED
        and event.get_dagster_event().asset_key
    )


DEFAULT_PG_POOL_SIZE = 2
PG_POOL_RECYCLE_S = 3600


class _PooledPostgresEngine:
    """Mixin for a dagster-postgres storage: replace its connection-per-call engine (NullPool: a
    connect and authentication per write, a large share of a bucket run's overhead in bench/scale.py
    --instance postgres) with a small pool per process, checked before use and recycled hourly.
    `size` 0 keeps dagster-postgres's engine."""

    def _use_pool(self, token_provider, size: int) -> None:
        self._pool_size = int(size)
        if self._pool_size > 0:
            from dagster_postgres.utils import create_pg_engine

            self._engine = create_pg_engine(
                self.postgres_url, token_provider, isolation_level="AUTOCOMMIT",
                pool_size=self._pool_size, max_overflow=self._pool_size, pool_pre_ping=True,
                pool_recycle=PG_POOL_RECYCLE_S)

    def dispose(self) -> None:
        super().dispose()
        if self._pool_size > 0:
            self._engine.dispose()  # close the pooled connections with the instance


class BatchedPostgresEventLogStorage:
    """Placeholder replaced below when dagster-postgres is importable (it is a dependency)."""


try:
    from dagster._core.storage.config import pg_config
    from dagster_postgres import PostgresEventLogStorage
    from dagster_postgres.utils import get_token_provider_from_config, pg_url_from_config
except ImportError:  # pragma: no cover - dagster-postgres is in the project's dependencies
    pass
else:
    class BatchedPostgresEventLogStorage(_PooledPostgresEngine, PostgresEventLogStorage):  # noqa: F811
        """dagster-postgres's event log with Dagster's batched writes switched on.

        dagster-postgres already writes a batch of ASSET_MATERIALIZATION events with one INSERT …
        RETURNING and one index transaction (`store_event_batch`), but Dagster only hands it batches
        when DAGSTER_EVENT_BATCH_SIZE > 0, which nothing sets: measured by bench/event_batch.py, a
        100-partition run is faster with it. This class exports the variable (as the SQLite one does)
        for every process that loads the instance, and batches what dagster-postgres stores one by one:
        a batch of ASSET_MATERIALIZATION_PLANNED events (N per asset when a run over N partitions is
        created) becomes one INSERT … RETURNING and one index transaction, exactly as dagster-postgres
        does for materializations; the asset-keys row gets the last event of each asset (an upsert
        that the last event decides, as in the SQLite class). `deploy/postgres/dagster.yaml` uses it.
        """

        def __init__(self, postgres_url: str, should_autocreate_tables: bool = True,
                     inst_data: ConfigurableClassData | None = None, token_provider=None,
                     event_batch_size: int = DEFAULT_EVENT_BATCH_SIZE,
                     connection_pool_size: int = DEFAULT_PG_POOL_SIZE):
            self._event_batch_size = int(event_batch_size)
            if self._event_batch_size > 0:
                os.environ.setdefault(BATCH_SIZE_ENV, str(self._event_batch_size))
            super().__init__(postgres_url, should_autocreate_tables=should_autocreate_tables,
                             inst_data=inst_data, token_provider=token_provider)
            self._use_pool(token_provider, connection_pool_size)

        def store_event_batch(self, events: Sequence[EventLogEntry]) -> None:
            planned = DagsterEventType.ASSET_MATERIALIZATION_PLANNED
            if not events or not all(e.is_dagster_event and e.dagster_event_type == planned
                                     and e.get_dagster_event().asset_key for e in events):
                return super().store_event_batch(events)
            with self._connect() as conn:
                result = conn.execute(self.prepare_insert_event_batch(events).returning(SqlEventLogStorageTable.c.id))
                event_ids = [int(row[0]) for row in result.fetchall()]
            with self.index_transaction() as conn:
                self._store_asset_event_tags(conn, events, event_ids)
                last: dict[str, int] = {}
                for i, event in enumerate(events):
                    last[event.get_dagster_event().asset_key.to_string()] = i
                for i in sorted(last.values()):
                    self._store_asset_event(conn, events[i], event_ids[i])

        @classmethod
        def config_type(cls):
            return {**pg_config(),
                    "event_batch_size": Field(IntSource, is_required=False, default_value=DEFAULT_EVENT_BATCH_SIZE),
                    "connection_pool_size": Field(IntSource, is_required=False, default_value=DEFAULT_PG_POOL_SIZE,
                                                  description="connections kept open per process (0 = one "
                                                              "connection per write, dagster-postgres's default)")}

        @classmethod
        def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]):
            cfg = dict(config_value)
            size = cfg.pop("event_batch_size", DEFAULT_EVENT_BATCH_SIZE)
            pool = cfg.pop("connection_pool_size", DEFAULT_PG_POOL_SIZE)
            return cls(inst_data=inst_data, postgres_url=pg_url_from_config(cfg),
                       should_autocreate_tables=cfg.get("should_autocreate_tables", True),
                       token_provider=get_token_provider_from_config(cfg), event_batch_size=size,
                       connection_pool_size=pool)


class PooledPostgresRunStorage:
    """Placeholder replaced below when dagster-postgres is importable (it is a dependency)."""


try:
    from dagster_postgres import PostgresRunStorage
except ImportError:  # pragma: no cover
    pass
else:
    class PooledPostgresRunStorage(_PooledPostgresEngine, PostgresRunStorage):  # noqa: F811
        """dagster-postgres's run storage with a small connection pool per process (as the event log
        above): every run start, step and status change otherwise opens and authenticates a new
        connection. `connection_pool_size: 0` keeps dagster-postgres's connection per call."""

        def __init__(self, postgres_url: str, should_autocreate_tables: bool = True,
                     inst_data: ConfigurableClassData | None = None, token_provider=None,
                     connection_pool_size: int = DEFAULT_PG_POOL_SIZE):
            super().__init__(postgres_url, should_autocreate_tables=should_autocreate_tables,
                             inst_data=inst_data, token_provider=token_provider)
            self._use_pool(token_provider, connection_pool_size)

        @classmethod
        def config_type(cls):
            return {**pg_config(),
                    "connection_pool_size": Field(IntSource, is_required=False, default_value=DEFAULT_PG_POOL_SIZE)}

        @classmethod
        def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]):
            cfg = dict(config_value)
            pool = cfg.pop("connection_pool_size", DEFAULT_PG_POOL_SIZE)
            return cls(inst_data=inst_data, postgres_url=pg_url_from_config(cfg),
                       should_autocreate_tables=cfg.get("should_autocreate_tables", True),
                       token_provider=get_token_provider_from_config(cfg), connection_pool_size=pool)
