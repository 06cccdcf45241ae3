"""The production instance config (deploy/postgres/dagster.yaml) against a real local PostgreSQL.

`.ci/run` installs Debian's postgresql, starts it and exports DAGSTER_PG_* (see
scripts/install_system_deps.sh). Each test run works in a database of its own, dropped at the end.
"""

import importlib
import json
import os
import uuid
from pathlib import Path

import dagster as dg
import pytest

from qumem_pipeline.runtime.instance_config import install_instance_config
from tests.conftest import REPO_ROOT

PG_VARS = ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB")
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"

pytestmark = [pytest.mark.skipif(
    not os.environ.get("DAGSTER_PG_HOST"),
    reason="DAGSTER_PG_HOST is not set: no PostgreSQL server to test against "
    "(.ci/run starts one: eval \"$(bash scripts/install_system_deps.sh)\")",
)]


def _connect(dbname: str):
    import psycopg2

    return psycopg2.connect(
        host=os.environ["DAGSTER_PG_HOST"], port=int(os.environ.get("DAGSTER_PG_PORT", "5432")),
        user=os.environ["DAGSTER_PG_USER"], password=os.environ.get("DAGSTER_PG_PASSWORD", ""), dbname=dbname,
    )


@pytest.fixture
def scratch_database(monkeypatch):
    """A fresh database for this test (the role has CREATEDB), so reruns never see old runs."""
    missing = [v for v in PG_VARS if v not in os.environ]
    assert not missing, f"DAGSTER_PG_HOST is set but {missing} are not (see scripts/install_system_deps.sh)"
    name = f"qumem_test_{uuid.uuid4().hex[:12]}"
    admin = _connect(os.environ["DAGSTER_PG_DB"])
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    monkeypatch.setenv("DAGSTER_PG_DB", name)
    try:
        yield name
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_partitioned_materialization_is_recorded_in_postgres(tmp_path, dagster_env, small_archive, scratch_database):
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    data_root, set_archive = dagster_env
    set_archive(small_archive)
    home = tmp_path / "dagster_home"
    home.mkdir()
    install_instance_config(home / "dagster.yaml", source=REPO_ROOT / "deploy" / "postgres" / "dagster.yaml")

    import assets.definitions as definitions

    defs = importlib.reload(definitions).build_definitions()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        instance.add_dynamic_partitions("users", ["alice", "bob", "chen"])
        result = defs.resolve_job_def("ingest_job").execute_in_process(
            instance=instance, tags={RANGE_START: "alice", RANGE_END: "bob"}
        )
        assert result.success
        run = instance.get_run_by_id(result.run_id)
        assert run.status == dg.DagsterRunStatus.SUCCESS
        assert instance.get_materialized_partitions(dg.AssetKey("turns")) == {"alice", "bob"}
        assert instance.get_materialized_partitions(dg.AssetKey("warehouse")) == {"alice", "bob"}

    # The same facts, read straight from PostgreSQL's tables rather than through Dagster.
    with _connect(scratch_database) as con, con.cursor() as cur:
        cur.execute("SELECT status FROM runs WHERE run_id = %s", (result.run_id,))
        assert cur.fetchall() == [("SUCCESS",)]
        cur.execute(
            "SELECT asset_key, partition FROM event_logs WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION'",
            (result.run_id,),
        )
        mats = {(tuple(json.loads(k)), p) for k, p in cur.fetchall()}
        assert mats == {(("turns",), "alice"), (("turns",), "bob"), (("warehouse",), "alice"), (("warehouse",), "bob")}
        cur.execute("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'users' ORDER BY partition")
        assert [r[0] for r in cur.fetchall()] == ["alice", "bob", "chen"]
    # ...and the store holds the turns: the archive sync ingests each new file once, for every user it
    # holds (the run's materializations above are exactly the two users of the range).
    from qumem_pipeline.storage.layout import DataLayout

    assert DataLayout(data_root).users_in("turns") == ["alice", "bob", "chen"]
