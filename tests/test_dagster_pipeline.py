"""Real Dagster runs on an ephemeral instance: definitions, multi-user runs, sensor, forget."""

import importlib
import json

import dagster as dg
import polars as pl
import pytest

from tests.conftest import conversation, write_jsonl

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def load_defs():
    import assets.definitions as d

    importlib.reload(d)
    return d.build_definitions()


def run_main(defs, instance, users, job="main_job"):
    instance.add_dynamic_partitions("users", [u for u in users if not instance.has_dynamic_partition("users", u)])
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, tags={RANGE_START: users[0], RANGE_END: users[-1]}
    )


def test_definitions_load_and_snapshot(dagster_env, small_archive):
    _, set_archive = dagster_env
    set_archive(small_archive)
    defs = load_defs()
    repo = defs.get_repository_def()
    keys = sorted(k.to_user_string() for k in repo.asset_graph.get_all_asset_keys())
    assert {"turns", "warehouse"} <= set(keys)
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    policies = set()
    for k in keys:
        node = repo.asset_graph.get(dg.AssetKey.from_user_string(k))
        assert isinstance(node.partitions_def, dg.DynamicPartitionsDefinition) and node.partitions_def.name == "users"
        policies.add(node.backfill_policy.max_partitions_per_run)
    assert len(policies) == 1, "every partitioned asset must share one backfill policy"
    assert repo.asset_graph.get(dg.AssetKey("warehouse")).pools == {"warehouse"}
    assert {"main_job", "ingest_job", "forget_user_job"} <= {j.name for j in repo.get_all_jobs()}
    assert [s.name for s in repo.sensor_defs] == ["user_discovery_sensor"]
    assert specs["turns"].code_version


def test_multi_user_run_writes_one_partition_per_user(dagster_env, small_archive):
    data_root, set_archive = dagster_env
    set_archive(small_archive)
    defs = load_defs()
    instance = dg.DagsterInstance.ephemeral()
    result = run_main(defs, instance, ["alice", "bob", "chen"])
    assert result.success
    files = sorted(p.relative_to(data_root).as_posix() for p in (data_root / "turns").rglob("*.parquet"))
    assert files == [f"turns/user_id={u}/part-0.parquet" for u in ("alice", "bob", "chen")]
    alice = pl.read_parquet(data_root / "turns" / "user_id=alice" / "part-0.parquet")
    assert alice["user_id"].unique().to_list() == ["alice"] and alice.height == 4
    mats = result.get_asset_materialization_events()
    assert {(m.asset_key.to_user_string(), m.partition) for m in mats} == {
        (a, u) for a in ("turns", "warehouse") for u in ("alice", "bob", "chen")
    }
    import duckdb

    with duckdb.connect(str(data_root / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("SELECT user_id, count(*) FROM turns GROUP BY 1 ORDER BY 1").fetchall() == [
            ("alice", 4), ("bob", 4), ("chen", 4)
        ]


def test_sensor_registers_new_users_and_requests_runs_for_changes(dagster_env, small_archive):
    _, set_archive = dagster_env
    set_archive(small_archive)
    defs = load_defs()
    instance = dg.DagsterInstance.ephemeral()
    sensor = defs.resolve_sensor_def("user_discovery_sensor")
    ctx = dg.build_sensor_context(instance=instance, resources=defs.resources)
    res = sensor(ctx)
    assert sorted(res.dynamic_partitions_requests[0].partition_keys) == ["alice", "bob", "chen"]
    assert sorted(r.partition_key for r in res.run_requests) == ["alice", "bob", "chen"]
    cursor = res.cursor
    # Nothing changed: no runs.
    res2 = sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources))
    assert res2.run_requests == [] and res2.dynamic_partitions_requests == []
    # bob's history grows; a new user appears.
    write_jsonl(small_archive / "c.jsonl", conversation("bob", "c9", ["New puppy!", "Congrats"], start="2024-05-01T00:00:00Z")
                + conversation("dana", "c10", ["Hi", "Hello"]))
    res3 = sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources))
    assert sorted(r.partition_key for r in res3.run_requests) == ["bob", "dana"]
    assert res3.dynamic_partitions_requests[0].partition_keys == ["dana"]
    assert json.loads(res3.cursor).keys() == {"alice", "bob", "chen", "dana"}


def test_forget_removes_canary_everywhere_and_keeps_others(dagster_env, tmp_path):
    data_root, set_archive = dagster_env
    canary = "CANARY-d41d8cd9-unique-to-bob"
    archive = tmp_path / "arch"
    write_jsonl(
        archive / "x.jsonl",
        conversation("alice", "c1", ["alice text one", "reply", "alice text two", "reply"])
        + conversation("bob", "c2", [f"my secret is {canary}", "ok", "more bob", "fine"])
        + [{"user_id": "bob", "conversation_id": "c2", "role": "robot", "text": f"bad row {canary}"}],
    )
    set_archive(archive)
    defs = load_defs()
    instance = dg.DagsterInstance.ephemeral()
    assert run_main(defs, instance, ["alice", "bob"]).success
    hits_before = [p for p in data_root.rglob("*") if p.is_file() and canary.encode() in p.read_bytes()]
    assert hits_before, "the canary must be somewhere before forgetting, or the test proves nothing"

    r = defs.resolve_job_def("forget_user_job").execute_in_process(
        instance=instance, run_config={"ops": {"forget_user_op": {"config": {"user_id": "bob"}}}}
    )
    assert r.success
    leftovers = [p for p in data_root.rglob("*") if p.is_file() and canary.encode() in p.read_bytes()]
    assert leftovers == []
    assert not instance.has_dynamic_partition("users", "bob")
    assert pl.read_parquet(data_root / "turns" / "user_id=alice" / "part-0.parquet").height == 4
    import duckdb

    with duckdb.connect(str(data_root / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("SELECT DISTINCT user_id FROM turns").fetchall() == [("alice",)]
    # A rerun of the whole pipeline does not bring bob back from the archive.
    assert run_main(defs, instance, ["alice"]).success
    sensor_res = defs.resolve_sensor_def("user_discovery_sensor")(
        dg.build_sensor_context(instance=instance, resources=defs.resources)
    )
    assert "bob" not in [r.partition_key for r in sensor_res.run_requests]
    assert [p for p in data_root.rglob("*") if p.is_file() and canary.encode() in p.read_bytes()] == []


def test_forget_rejects_malicious_id(dagster_env, small_archive):
    _, set_archive = dagster_env
    set_archive(small_archive)
    defs = load_defs()
    with pytest.raises(Exception, match="invalid user id"):
        defs.resolve_job_def("forget_user_job").execute_in_process(
            instance=dg.DagsterInstance.ephemeral(),
            run_config={"ops": {"forget_user_op": {"config": {"user_id": "../x"}}}},
        )
