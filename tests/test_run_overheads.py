"""Per-run orchestration costs that grow with runs or users, cut where they arise (bench/scale.py
measures them): models load once per process, and the steps of one bucket run read the user
registry once, not once per step."""

import dagster as dg

from tests.conftest import local_instance
from tests.schemes import partition_scheme


def test_models_load_once_per_process_across_runs(tmp_path):
    from resources import models
    from resources.models import EmbedderResource

    seen = []

    @dg.asset
    def probe(embedder: EmbedderResource) -> None:
        seen.append(embedder.model)

    job = dg.define_asset_job("probe_job", selection=[probe])
    defs = dg.Definitions(assets=[probe], jobs=[job], resources={"embedder": EmbedderResource(device="cpu")})
    with local_instance(tmp_path / "home") as instance:
        for _ in range(2):
            assert defs.resolve_job_def("probe_job").execute_in_process(instance=instance).success
    assert len(seen) == 2 and seen[0] is seen[1]  # the second run reused the first run's weights
    assert [k for k in models._loaded if k[0] == "embedder" and k[1] == "cpu"] == [("embedder", "cpu")]
    vec = seen[1].encode(["a sentence"])  # and the shared model still works
    assert vec.shape[0] == 1


def test_steps_of_one_bucket_run_read_the_registry_once(tmp_path):
    with partition_scheme("user_buckets", buckets=4) as m:
        parts = m["assets.partitions"]
        users_of = {}

        @dg.asset(partitions_def=parts.users_partitions)
        def first(context: dg.AssetExecutionContext) -> None:
            users_of.setdefault(context.run.run_id, []).append(parts.run_user_ids(context))

        @dg.asset(partitions_def=parts.users_partitions, deps=[first])
        def second(context: dg.AssetExecutionContext) -> None:
            users_of.setdefault(context.run.run_id, []).append(parts.run_user_ids(context))

        job = dg.define_asset_job("two_steps", selection=[first, second])
        defs = dg.Definitions(assets=[first, second], jobs=[job], executor=dg.in_process_executor)
        with local_instance(tmp_path / "home") as instance:
            parts.register_users(instance, ["alice", "bob", "chen", "dan"])
            reads = []
            real = instance.get_dynamic_partitions
            instance.get_dynamic_partitions = lambda name: reads.append(name) or real(name)
            keys = parts.bucket_partition_keys(4)
            tags = {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}
            for _ in range(2):
                assert defs.resolve_job_def("two_steps").execute_in_process(instance=instance, tags=tags).success
    assert reads == ["users", "users"]  # one registry read per run, not per step
    assert len(users_of) == 2
    for per_step in users_of.values():
        assert per_step == [sorted(["alice", "bob", "chen", "dan"])] * 2


def test_planned_bucket_run_checks_only_its_users_registration(tmp_path):
    """A planned bucket run asks the instance about its own users only (no whole-registry read), and
    a planned user forgotten since (unregistered) is left out."""
    with partition_scheme("user_buckets", buckets=4) as m:
        parts = m["assets.partitions"]
        seen = []

        @dg.asset(partitions_def=parts.users_partitions)
        def only(context: dg.AssetExecutionContext) -> None:
            seen.append(parts.run_user_ids(context))

        defs = dg.Definitions(assets=[only], jobs=[dg.define_asset_job("one", selection=[only])],
                              executor=dg.in_process_executor)
        with local_instance(tmp_path / "home") as instance:
            parts.register_users(instance, ["alice", "bob", "chen", "dan", "erin"])
            tags = parts.store_run_users(instance, ["alice", "bob", "dan"])
            instance.delete_dynamic_partition("users", "dan")  # forgotten after planning
            reads = []
            real = instance.get_dynamic_partitions
            instance.get_dynamic_partitions = lambda name: reads.append(name) or real(name)
            keys = parts.bucket_partition_keys(4)
            tags.update({"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]})
            assert defs.resolve_job_def("one").execute_in_process(instance=instance, tags=tags).success
            assert parts.registered_among(instance, ["alice", "dan", "zoe"]) == {"alice"}
    assert reads == []
    assert seen == [["alice", "bob"]]
