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


def _count_reads(monkeypatch, reads: list):
    """Record every read of the data root's registry and run lists (table name, buckets read)."""
    from qumem_pipeline.storage.table_store import TableStore

    real_read, real_buckets = TableStore.read, TableStore.read_buckets

    def read(self, table, users=None, columns=None):
        reads.append((table, "all" if users is None else "users"))
        return real_read(self, table, users, columns)

    def read_buckets(self, table, buckets, columns=None, where=None):
        buckets = sorted(buckets)
        reads.append((table, tuple(buckets)))
        return real_buckets(self, table, buckets, columns, where)

    monkeypatch.setattr(TableStore, "read", read)
    monkeypatch.setattr(TableStore, "read_buckets", read_buckets)


def test_steps_of_one_bucket_run_read_the_registry_once(tmp_path, monkeypatch):
    from resources import PipelineConfig

    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(tmp_path / "archive"))
    with partition_scheme("user_buckets", buckets=4) as m:
        parts = m["assets.partitions"]
        users_of = {}

        @dg.asset(partitions_def=parts.users_partitions)
        def first(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> None:
            users_of.setdefault(context.run.run_id, []).append(parts.run_user_ids(context))

        @dg.asset(partitions_def=parts.users_partitions, deps=[first])
        def second(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> None:
            users_of.setdefault(context.run.run_id, []).append(parts.run_user_ids(context))

        job = dg.define_asset_job("two_steps", selection=[first, second])
        defs = dg.Definitions(assets=[first, second], jobs=[job], executor=dg.in_process_executor,
                              resources={"pipeline": pipeline})
        with local_instance(tmp_path / "home") as instance:
            parts.register_users(instance, ["alice", "bob", "chen", "dan"], pipeline)
            reads = []
            _count_reads(monkeypatch, reads)
            keys = parts.bucket_partition_keys(4)
            tags = {"dagster/asset_partition_range_start": keys[1], "dagster/asset_partition_range_end": keys[2]}
            for _ in range(2):
                assert defs.resolve_job_def("two_steps").execute_in_process(instance=instance, tags=tags).success
    # one registry read per run, not per step, of the store buckets under partitions b001..b002 only (QUMEM_BUCKETS is
    # the one bucket count: the store has the partitions' 4 buckets)
    registry_reads = [r for r in reads if r[0] == "user_registry"]
    assert registry_reads == [("user_registry", (1, 2))] * 2
    assert len(users_of) == 2
    for per_step in users_of.values():
        assert per_step == [["alice", "bob", "chen", "dan"]] * 2  # alice, dan: b001; bob, chen: b002


def test_planned_bucket_run_reads_only_its_list_from_its_buckets(tmp_path, monkeypatch):
    """A planned bucket run reads its user list (run_users, by digest) from its own buckets' files,
    never the registry; a planned user forgotten since (erased from run_users by forget) is left out."""
    from qumem_pipeline.storage.forget import forget_user
    from resources import PipelineConfig

    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(tmp_path / "archive"))
    with partition_scheme("user_buckets", buckets=4) as m:
        parts = m["assets.partitions"]
        seen = []

        @dg.asset(partitions_def=parts.users_partitions)
        def only(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> None:
            seen.append(parts.run_user_ids(context))

        defs = dg.Definitions(assets=[only], jobs=[dg.define_asset_job("one", selection=[only])],
                              executor=dg.in_process_executor, resources={"pipeline": pipeline})
        with local_instance(tmp_path / "home") as instance:
            parts.register_users(instance, ["alice", "bob", "chen", "dan", "erin"], pipeline)
            tags = parts.store_run_users(instance, ["alice", "bob", "dan"], pipeline)
            assert set(tags) == {parts.RUN_USERS_TAG, parts.RUN_USERS_COUNT_TAG}  # the instance holds a digest only
            forget_user(pipeline.data_root, None, "dan")  # forgotten after planning
            reads = []
            _count_reads(monkeypatch, reads)
            keys = parts.bucket_partition_keys(4)
            tags.update({"dagster/asset_partition_range_start": keys[1], "dagster/asset_partition_range_end": keys[2]})
            assert defs.resolve_job_def("one").execute_in_process(instance=instance, tags=tags).success
            run_reads = list(reads)
            assert parts.registered_among(instance, ["alice", "dan", "zoe"], pipeline) == {"alice"}
    mine = (1, 2)
    assert [r for r in run_reads if r[0] in ("run_users", "user_registry")] == [("run_users", mine)]
    assert seen == [["alice", "bob"]]
