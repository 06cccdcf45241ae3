"""Two partition schemes, one set of assets: `users` (a partition per user) and `user_buckets`
(a partition per storage bucket). Real Dagster runs in each: `qumem ingest` + `forget` through
the CLI, a backfill's range run, the nightly schedule (changed and unfinished users only)."""

import json

import dagster as dg
import pytest

from tests.conftest import conversation, local_instance, write_jsonl
from tests.schemes import partition_scheme
from tests.ticks import run_archive_sync

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
TICK = "2026-11-30T02:00:00+00:00"
BASE = {"alice": ["I like tea.", "Noted.", "Green tea mostly.", "OK."],
        "bob": ["My dog is sick.", "Sorry.", "The vet says rest.", "Good."],
        "chen": ["I play piano.", "Nice!", "Scales are hard.", "Keep going."]}
# with QUMEM_BUCKETS=4: alice -> b001, bob and chen -> b002, dan -> b001


def _archive(path, users):
    write_jsonl(path / "a.jsonl", [r for u, texts in users.items() for r in conversation(u, f"{u}-c1", texts)])


def _registered(instance, scheme: str, data_root) -> list[str]:
    """The registry: dynamic partitions (`users`), the data root's `user_registry` table (`user_buckets`)."""
    if scheme == "users":
        return instance.get_dynamic_partitions("users")
    from qumem_pipeline.storage.user_registry import UserRegistry

    assert instance.get_dynamic_partitions("users") == []
    return UserRegistry(str(data_root)).users()


def _turn_files(data_root) -> list[str]:
    """Users whose turns the table store holds."""
    from qumem_pipeline.storage.layout import DataLayout

    return sorted(DataLayout(data_root).users_in("turns"))


@pytest.mark.parametrize("scheme", ["users", "user_buckets"])
def test_definitions_share_one_scheme_and_one_policy(scheme):
    with partition_scheme(scheme, buckets=4) as m:
        graph = m["assets.definitions"].build_definitions().resolve_asset_graph()
        parts = {graph.get(k).partitions_def for k in graph.get_all_asset_keys()}
        policies = {graph.get(k).backfill_policy.max_partitions_per_run for k in graph.get_all_asset_keys()}
    assert len(parts) == 1 and len(policies) == 1
    (pdef,) = parts
    if scheme == "users":
        assert isinstance(pdef, dg.DynamicPartitionsDefinition) and pdef.name == "users"
    else:
        assert isinstance(pdef, dg.StaticPartitionsDefinition)
        assert pdef.get_partition_keys() == ["b000", "b001", "b002", "b003"]


@pytest.mark.parametrize("scheme", ["users", "user_buckets"])
def test_qumem_ingest_and_forget_in_each_scheme(tmp_path, monkeypatch, scheme, capsys):
    archive = tmp_path / "archive"
    _archive(archive, BASE)
    for key in ("QUMEM_ARCHIVE", "QUMEM_DATA_ROOT", "QUMEM_WAREHOUSE", "QUMEM_ARCHIVE_FORMAT", "QUMEM_STRICT"):
        monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv(key, "") if key != "QUMEM_WAREHOUSE" else None  # restored after main() sets them
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    data = tmp_path / "data"
    with partition_scheme(scheme, buckets=4):
        from qumem_pipeline.cli import main

        assert main(["ingest", "--archive", str(archive), "--data-root", str(data), "--users-per-run", "2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["users"] == 3 and out["warehouse"]["turns"] == 12
        assert _turn_files(data) == ["alice", "bob", "chen"]
        with dg.DagsterInstance.get() as instance:
            runs = [instance.get_run_by_id(r) for r in out["runs"]]
            assert _registered(instance, scheme, data) == ["alice", "bob", "chen"]  # the registry
            if scheme == "users":
                assert [(r.tags[RANGE_START], r.tags[RANGE_END]) for r in runs] == [("alice", "bob"), ("chen", "chen")]
            else:
                assert [(r.tags[RANGE_START], r.tags[RANGE_END], r.tags["qumem/run_users_count"]) for r in runs] == [
                    ("b001", "b002", "2"), ("b002", "b002", "1")]
                assert instance.get_materialized_partitions(dg.AssetKey("turns")) == {"b001", "b002"}
            assert all(r.tags["qumem/launcher_pid"] for r in runs)

        assert main(["forget", "bob", "--data-root", str(data)]) == 0
        assert _turn_files(data) == ["alice", "chen"]
        with dg.DagsterInstance.get() as instance:
            assert _registered(instance, scheme, data) == ["alice", "chen"]
        # a later run neither re-registers nor rebuilds bob (forgotten), in either scheme
        assert main(["ingest", "--archive", str(archive), "--data-root", str(data), "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["users"] == 2 and out["warehouse"]["turns"] == 8 and _turn_files(data) == ["alice", "chen"]


def test_bucket_backfill_range_takes_every_registered_user_of_its_buckets(tmp_path):
    """What a UI backfill launches under BackfillPolicy.multi_run: a key range, no user list."""
    archive = tmp_path / "archive"
    _archive(archive, dict(BASE, dan=["New here.", "Welcome."]))
    from resources import PipelineConfig

    with partition_scheme("user_buckets", buckets=4) as m, local_instance(tmp_path / "home") as instance:
        turns, p = m["assets.ingest"].turns, m["assets.partitions"]
        pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
        p.register_users(instance, ["alice", "bob", "chen", "dan"], pipeline)
        assert instance.get_dynamic_partitions("users") == []  # the bucket scheme's registry is the data root's
        result = dg.materialize([turns], instance=instance, resources={"pipeline": pipeline},
                                tags={RANGE_START: "b001", RANGE_END: "b001"})
        assert result.success
        mat = result.get_asset_materialization_events()[0].materialization
        assert sorted(mat.metadata["fingerprints"].value) == ["alice", "dan"]  # the users of b001
        # the archive sync reads each new file once, for every user it holds; the run publishes its own users
        assert _turn_files(tmp_path / "data") == ["alice", "bob", "chen", "dan"]
        # a run naming its users takes only those, even over a wider key range
        tags = {RANGE_START: "b001", RANGE_END: "b002", **p.store_run_users(instance, ["chen"], pipeline)}
        result = dg.materialize([turns], instance=instance, resources={"pipeline": pipeline}, tags=tags)
        assert sorted(result.get_asset_materialization_events()[0].materialization.metadata["fingerprints"].value) == ["chen"]
        assert _turn_files(tmp_path / "data") == ["alice", "bob", "chen", "dan"]


def test_bucket_nightly_rebuilds_changed_and_unfinished_users_only(tmp_path):
    from datetime import datetime

    from resources import PipelineConfig

    archive = tmp_path / "archive"
    _archive(archive, BASE)
    fail = {"on": False}
    with partition_scheme("user_buckets", buckets=4) as m, local_instance(tmp_path / "home") as instance:
        turns, p = m["assets.ingest"].turns, m["assets.partitions"]

        @dg.asset(partitions_def=p.users_partitions, deps=[turns], backfill_policy=turns.backfill_policy)
        def turn_counts(context: dg.AssetExecutionContext) -> None:
            if fail["on"]:
                raise RuntimeError("downstream stage crashed")

        pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
        job = dg.define_asset_job("turns_and_counts", selection=[turns, turn_counts], partitions_def=p.users_partitions)
        schedule = m["assets.schedules"].build_nightly_schedule(job=job, users_per_run=50, final_asset="turn_counts")
        defs = dg.Definitions(assets=[turns, turn_counts], jobs=[job], schedules=[schedule],
                              resources={"pipeline": pipeline})

        def evaluate():
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=datetime.fromisoformat(TICK),
                                           resources={"pipeline": pipeline},
                                           repository_def=defs.get_repository_def()) as ctx:
                return schedule.evaluate_tick(ctx)

        def execute(req):
            return defs.resolve_job_def("turns_and_counts").execute_in_process(
                instance=instance, tags=dict(req.tags), raise_on_error=False)

        def planned(req) -> int:
            return int(req.tags["qumem/run_users_count"])

        run_archive_sync(instance, pipeline)  # the ticks only plan: the sync is its own run
        first = evaluate()
        assert [planned(r) for r in first.run_requests] == [3] and p.registered_users(instance, pipeline) == ["alice", "bob", "chen"]
        assert execute(first.run_requests[0]).success
        assert evaluate().run_requests == []  # unchanged: nothing

        _archive(archive, dict(BASE, bob=BASE["bob"] + ["He is better now.", "Great."]))
        run_archive_sync(instance, pipeline)
        changed = evaluate()
        assert [planned(r) for r in changed.run_requests] == [1]
        assert changed.run_requests[0].partition_key == "b002"  # bob's bucket; chen (b002) not rebuilt
        fail["on"] = True
        assert not execute(changed.run_requests[0]).success  # turns landed for bob, turn_counts did not

        retry = evaluate()  # bob's content is recorded, but his run stopped part-way: rebuilt again
        assert [planned(r) for r in retry.run_requests] == [1]
        assert retry.run_requests[0].tags["qumem/run_users"] == changed.run_requests[0].tags["qumem/run_users"]
        fail["on"] = False
        assert execute(retry.run_requests[0]).success
        assert evaluate().run_requests == []
