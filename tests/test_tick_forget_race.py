"""No tick re-adds a forgotten id (issue 51, item 4): a forget that lands while a discovery-sensor or
nightly-schedule tick is between reading the archive and registering its users leaves no partition,
no registry row and no run request naming the user, in both partition schemes. Real sensor and
schedule evaluations on a real (SQLite) instance, real Delta tables, the real forget. The ticks only
plan from the fingerprints table, so the archive sync runs first, as the real `archive_sync` run."""

from datetime import datetime, timezone

import dagster as dg
import pytest

from tests.conftest import conversation, local_instance, write_jsonl
from tests.schemes import partition_scheme
from tests.ticks import rebuild_requests, run_archive_sync

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


@pytest.fixture(params=["users", "user_buckets"])
def scheme(request):
    with partition_scheme(request.param, buckets=4) as modules:
        yield request.param, modules


def _named_users(request, instance, modules, pipeline) -> list[str]:
    p = modules["assets.partitions"]
    digest = request.tags.get(p.RUN_USERS_TAG)
    if digest:
        return p.user_registry(pipeline).run_users(digest, range(64))
    if request.partition_key:
        return [request.partition_key]
    order = p.registered_users(instance)
    start, end = request.tags[RANGE_START], request.tags[RANGE_END]
    assert start in order and end in order, f"a run request names an unregistered key: {start}..{end}"
    return order[order.index(start): order.index(end) + 1]


@pytest.mark.parametrize("tick_kind", ["sensor", "schedule"])
def test_a_forget_during_a_tick_is_not_undone_by_it(tmp_path, scheme, tick_kind, monkeypatch):
    name, modules = scheme
    from assets.erasure import scrub_instance
    from qumem_pipeline.storage.forget import forget_user
    from resources import PipelineConfig

    archive, root = tmp_path / "archive", tmp_path / "data"
    write_jsonl(archive / "a.jsonl", conversation("alice", "c1", ["alice secret", "ok"])
                + conversation("bob", "c2", ["bob note", "ok"]) + conversation("chen", "c3", ["chen note", "ok"]))
    pipeline = PipelineConfig(data_root=str(root), archive_path=str(archive))
    partitions = modules["assets.partitions"]
    module = modules[f"assets.{'sensors' if tick_kind == 'sensor' else 'schedules'}"]
    real_discover = module.discover

    with local_instance(tmp_path / "home") as instance:
        run_archive_sync(instance, pipeline)

        def discover_then_forget(*a, **kw):
            """The tick has read the fingerprints (alice in them); now a whole forget lands, instance part included."""
            found = real_discover(*a, **kw)
            assert "alice" in found.fingerprints
            forget_user(root, None, "alice")
            if instance.has_dynamic_partition(partitions.USER_REGISTRY, "alice"):
                instance.delete_dynamic_partition(partitions.USER_REGISTRY, "alice")
            scrub_instance(instance, "alice")
            return found

        monkeypatch.setattr(module, "discover", discover_then_forget)
        if tick_kind == "sensor":
            sensor = module.build_discovery_sensor(job=modules["assets.definitions"].main_job, users_per_run=50)
            res = sensor(dg.build_sensor_context(instance=instance, resources={"pipeline": pipeline}))
            for req in res.dynamic_partitions_requests:  # what the daemon would apply after the tick
                instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        else:
            job = dg.define_asset_job("turns_only", selection=[modules["assets.ingest"].turns],
                                      partitions_def=partitions.users_partitions)
            schedule = module.build_nightly_schedule(job=job, users_per_run=50, final_asset="turns")
            defs = dg.Definitions(assets=[modules["assets.ingest"].turns], jobs=[job], schedules=[schedule],
                                  resources={"pipeline": pipeline})
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=datetime.now(timezone.utc),
                                           resources={"pipeline": pipeline},
                                           repository_def=defs.get_repository_def()) as ctx:
                res = schedule.evaluate_tick(ctx)
        requests = rebuild_requests(res)
        assert "alice" not in instance.get_dynamic_partitions(partitions.USER_REGISTRY)
        assert "alice" not in partitions.registered_users(instance, pipeline)
        named = sorted(u for r in requests for u in _named_users(r, instance, modules, pipeline))
        assert named == ["bob", "chen"]
        assert not any("alice" in str(v) for r in requests for v in (r.run_key, *r.tags.values()))
