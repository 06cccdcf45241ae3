"""The repository's instance config (dagster.yaml) uses BatchedSqliteEventLogStorage: Dagster's SQLite
event log whose event batches are written in one transaction per database. It must record exactly
what the stock storage records: the same asset events per run, the same per-partition status
(materialized / failed) the UI shows, the same asset rows and tags.
"""


import dagster as dg
import pytest

from assets.partitions import user_backfill_policy, users_partitions
from qumem_pipeline.runtime.instance_config import install_instance_config
from resources.event_log import BATCH_SIZE_ENV, BatchedSqliteEventLogStorage
from tests.conftest import local_instance

USERS = ["ann", "ben", "cal", "dee"]
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
ASSET_EVENTS = {dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED}


@dg.asset(partitions_def=users_partitions, backfill_policy=user_backfill_policy, code_version="1",
          config_schema={"fail": dg.Field(bool, default_value=False)})
def good(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    if context.op_execution_context.op_config["fail"]:
        raise RuntimeError("good failed on purpose")
    for u in context.partition_keys:
        context.add_asset_metadata({"user_rows": len(u)}, partition_key=u)
    return dg.MaterializeResult(metadata={"users": len(context.partition_keys)})


@dg.asset(partitions_def=users_partitions, backfill_policy=user_backfill_policy, deps=[good], code_version="1",
          config_schema={"fail": dg.Field(bool, default_value=False)})
def downstream(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    if context.op_execution_context.op_config["fail"]:
        raise RuntimeError("downstream failed on purpose")
    return dg.MaterializeResult(metadata={"users": len(context.partition_keys)})


job = dg.define_asset_job("events_job", selection=[good, downstream], partitions_def=users_partitions)
defs = dg.Definitions(assets=[good, downstream], jobs=[job], executor=dg.in_process_executor)


def _runs(instance) -> None:
    """ann..cal succeed; ben..dee fail in `downstream`; then dee fails in `good`."""
    instance.add_dynamic_partitions("users", USERS)
    j = defs.resolve_job_def("events_job")
    for (start, end), failing, ok in ((("ann", "cal"), None, True), (("ben", "dee"), "downstream", False),
                                      (("dee", "dee"), "good", False)):
        run_config = {"ops": {failing: {"config": {"fail": True}}}} if failing else None
        result = j.execute_in_process(instance=instance, tags={RANGE_START: start, RANGE_END: end},
                                      run_config=run_config, raise_on_error=False)
        assert result.success is ok


def _recorded(instance) -> dict:
    """Everything the UI and the schedules read about the assets, with run ids replaced by run order."""
    runs = [r.dagster_run for r in sorted(instance.get_run_records(), key=lambda r: r.create_timestamp)]
    order = {r.run_id: i for i, r in enumerate(runs)}
    out = {"events": [], "status": {}, "rows": {}, "tags": {}, "metadata": {}}
    for r in runs:
        recs = instance.get_records_for_run(r.run_id, of_type=ASSET_EVENTS).records
        out["events"].append([(e.event_log_entry.dagster_event_type.value,
                               e.event_log_entry.dagster_event.asset_key.to_user_string(),
                               e.event_log_entry.dagster_event.partition) for e in recs])
    for key in (good.key, downstream.key):
        name = key.to_user_string()
        status = instance.get_status_by_partition(key, USERS, users_partitions)
        out["status"][name] = {u: (s.value if s else None) for u, s in status.items()}
        rec = instance.get_asset_records([key])[0].asset_entry
        last = rec.last_materialization_record
        out["rows"][name] = (last.event_log_entry.dagster_event.partition if last else None,
                             order.get(rec.last_run_id))
        out["tags"][name] = sorted(tuple(sorted(t.items())) for t in instance.event_log_storage.get_event_tags_for_asset(key))
        out["metadata"][name] = {
            r.partition_key: {k: v.value for k, v in r.asset_materialization.metadata.items()}
            for r in instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=100).records
        }
        attempts = instance.event_log_storage.get_latest_asset_partition_materialization_attempts_without_materializations(key)
        out.setdefault("unfinished", {})[name] = {p: order[run_id] for p, (run_id, _) in attempts.items()}
    return out


@pytest.fixture
def stock(tmp_path):
    with local_instance(tmp_path / "stock") as inst:
        yield inst


@pytest.fixture
def batched(tmp_path, monkeypatch):
    """The repository's dagster.yaml, as `qumem` installs it into a fresh DAGSTER_HOME."""
    home = tmp_path / "home"
    home.mkdir()
    install_instance_config(home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.delenv(BATCH_SIZE_ENV, raising=False)  # restored after the test
    inst = dg.DagsterInstance.local_temp(str(home))
    yield inst
    inst.dispose()


def test_repo_instance_config_batches_event_writes(batched, tmp_path):
    import os

    assert isinstance(batched.event_log_storage, BatchedSqliteEventLogStorage)
    assert os.environ[BATCH_SIZE_ENV] == "1000"
    _runs(batched)
    # Dagster's default layout: the index and per-run event databases under history/runs/
    assert (tmp_path / "home" / "history" / "runs" / "index.db").is_file()
    assert len(list((tmp_path / "home" / "history" / "runs").glob("*.db"))) == 1 + 3


def test_batched_storage_records_exactly_what_the_stock_storage_records(stock, batched):
    _runs(stock)
    _runs(batched)
    want, got = _recorded(stock), _recorded(batched)
    assert got == want
    # and what that is: every partition planned and materialized one by one, failures per user
    assert got["status"]["good"] == {"ann": "MATERIALIZED", "ben": "MATERIALIZED", "cal": "MATERIALIZED", "dee": "FAILED"}
    assert got["status"]["downstream"] == {"ann": "MATERIALIZED", "ben": "FAILED", "cal": "FAILED", "dee": "FAILED"}
    assert sorted(p for t, a, p in got["events"][0] if a == "good") == sorted(2 * ["ann", "ben", "cal"])
    assert got["metadata"]["good"]["ann"] == {"users": 3, "user_rows": 3}  # per-partition metadata kept
    assert got["unfinished"]["downstream"] == {"ben": 1, "cal": 1, "dee": 2}
    assert {k: run for k, (_, run) in got["rows"].items()} == {"good": 2, "downstream": 2}  # the last run planned both


def test_a_mixed_batch_is_written_in_order(batched):
    """Asset events are grouped into transactions; any other event in a batch keeps its place."""
    batched.add_dynamic_partitions("users", USERS)
    result = defs.resolve_job_def("events_job").execute_in_process(
        instance=batched, tags={RANGE_START: "ann", RANGE_END: "ben"},
    )
    entries = batched.all_logs(result.run_id)
    assets = [e for e in entries if e.dagster_event_type in ASSET_EVENTS]
    other = next(e for e in entries if e.dagster_event_type == dg.DagsterEventType.STEP_START)
    batch = [assets[0], other, assets[1], assets[2]]
    batched.event_log_storage.store_event_batch(batch)
    after = batched.all_logs(result.run_id)
    assert len(after) == len(entries) + 4
    assert [dg.serialize_value(e) for e in after[-4:]] == [dg.serialize_value(e) for e in batch]


def test_failed_index_write_leaves_no_run_rows_for_dagsters_fallback(batched, monkeypatch):
    """If the index write of a batch fails, the batch's run rows roll back too: Dagster then stores the
    batch again one event at a time, and every event must end up recorded exactly once."""
    batched.add_dynamic_partitions("users", USERS)
    result = defs.resolve_job_def("events_job").execute_in_process(
        instance=batched, tags={RANGE_START: "ann", RANGE_END: "ben"},
    )
    storage = batched.event_log_storage
    # good's planned and materialized events: the materializations carry tags and index rows
    batch = [e for e in batched.all_logs(result.run_id)
             if e.dagster_event_type in ASSET_EVENTS and e.dagster_event.asset_key == good.key]
    assert [e.dagster_event_type for e in batch].count(dg.DagsterEventType.ASSET_MATERIALIZATION) == 2
    before = len(batched.all_logs(result.run_id))

    def index_state():  # what the index database holds for `good`: its tag rows and materialization records
        mats = batched.fetch_materializations(good.key, limit=100).records
        return len(storage.get_event_tags_for_asset(good.key)), len(mats)

    index_before = index_state()

    def broken(*args, **kwargs):
        raise RuntimeError("index database is full")

    monkeypatch.setattr(storage, "_store_asset_event_tags", broken)
    with pytest.raises(RuntimeError, match="index database is full"):
        storage.store_event_batch(batch)
    assert len(batched.all_logs(result.run_id)) == before  # nothing half-written in the run database
    assert index_state() == index_before  # nor in the index
    monkeypatch.undo()
    for e in batch:  # what Dagster's fallback does after a failed batch
        storage.store_event(e)
    assert len(batched.all_logs(result.run_id)) == before + len(batch)
    after_fallback = index_state()
    # the same batch stored by a write that never fails adds exactly what the fallback added
    storage.store_event_batch(batch)
    clean = index_state()
    added = lambda a, b: tuple(y - x for x, y in zip(a, b))  # noqa: E731
    assert added(index_before, after_fallback) == added(after_fallback, clean) == (2, 2)


# --- the PostgreSQL instance (deploy/postgres/dagster.yaml): the same equivalence, batched vs not ---

@pytest.fixture
def pg_home(tmp_path, monkeypatch):
    """Make homes on fresh PostgreSQL databases (dropped afterwards) from deploy/postgres/dagster.yaml."""
    import os
    import uuid

    from tests.conftest import REPO_ROOT
    from tests.test_postgres_instance import _connect

    if not os.environ.get("DAGSTER_PG_HOST"):
        pytest.skip("DAGSTER_PG_HOST is not set (eval \"$(bash scripts/install_system_deps.sh)\")")
    admin = _connect(os.environ["DAGSTER_PG_DB"])
    admin.autocommit = True
    made = []

    def make(label: str):
        name = f"qumem_test_{label}_{uuid.uuid4().hex[:8]}"
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        made.append(name)
        home = tmp_path / name
        home.mkdir()
        install_instance_config(home / "dagster.yaml", source=REPO_ROOT / "deploy" / "postgres" / "dagster.yaml")
        monkeypatch.setenv("DAGSTER_PG_DB", name)
        return dg.DagsterInstance.from_config(str(home))

    yield make
    with admin.cursor() as cur:
        for name in made:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


def test_postgres_batched_writes_record_exactly_what_unbatched_writes_record(pg_home, monkeypatch):
    import os

    from dagster_postgres import PostgresEventLogStorage

    from resources.event_log import BatchedPostgresEventLogStorage

    monkeypatch.setenv(BATCH_SIZE_ENV, "0")  # Dagster's default: every event stored alone
    with pg_home("unbatched") as plain:
        _runs(plain)
        want = _recorded(plain)
    monkeypatch.delenv(BATCH_SIZE_ENV)
    batches = []  # (event types, size) of every batch the storage was handed: proof the batched paths ran
    ours = BatchedPostgresEventLogStorage.store_event_batch
    monkeypatch.setattr(BatchedPostgresEventLogStorage, "store_event_batch", lambda self, events: (
        batches.append(({e.dagster_event_type for e in events}, len(events))), ours(self, events))[1])
    with pg_home("batched") as batched_pg:
        assert isinstance(batched_pg.event_log_storage, BatchedPostgresEventLogStorage)
        assert isinstance(batched_pg.event_log_storage, PostgresEventLogStorage)
        assert os.environ[BATCH_SIZE_ENV] == "1000"  # the storage switched batching on
        _runs(batched_pg)
        got = _recorded(batched_pg)
    for kind in (dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED):
        assert max(n for types, n in batches if types == {kind}) > 1, batches
    assert got == want
    assert got["status"]["good"] == {"ann": "MATERIALIZED", "ben": "MATERIALIZED", "cal": "MATERIALIZED", "dee": "FAILED"}
    assert got["metadata"]["good"]["ann"] == {"users": 3, "user_rows": 3}
    assert got["unfinished"]["downstream"] == {"ben": 1, "cal": 1, "dee": 2}
