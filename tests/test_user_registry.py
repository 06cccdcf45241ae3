"""The bucket scheme's user registry and run user lists in the data root (Delta tables of the table
store: qumem_pipeline/storage/user_registry.py), at a size that fits CI (20,000 users): idempotent
registration, two processes registering at once without losing each other's users, a bucket read
that opens only that bucket's files, a run's users found by its digest, and forget erasing both."""

import multiprocessing as mp

import polars as pl

from qumem_pipeline.contracts.buckets import user_bucket
from qumem_pipeline.storage.user_registry import REGISTRY_TABLE, RUN_USERS_TABLE, UserRegistry, users_digest

N = 20_000
USERS = [f"user{i:06d}" for i in range(N)]


def _register(root: str, users: list[str], start) -> None:
    start.wait()
    UserRegistry(root).register(users)


def test_registration_is_idempotent_and_records_fingerprints(tmp_path):
    reg = UserRegistry(str(tmp_path / "data"))
    fps = {u: f"fp-{u}" for u in USERS}
    assert reg.register(USERS[:15_000], fps) == USERS[:15_000]
    assert reg.register(USERS[:15_000], fps) == []  # already there: nothing appended
    version = reg.store.version(REGISTRY_TABLE)
    assert reg.register(USERS, fps) == USERS[15_000:]
    assert reg.store.version(REGISTRY_TABLE) == version + 1  # one commit for 5,000 users
    state = reg.state()
    assert state.height == N and state["user_id"].to_list() == USERS
    assert state["registered_fingerprint"].to_list() == [fps[u] for u in USERS]
    assert state["fingerprint"].null_count() == N  # never materialized yet

    reg.record_materialized({"user000001": "aa", "user000002": "bb"}, "run-1")
    got = reg.state().filter(pl.col("fingerprint").is_not_null())
    assert got.select("user_id", "fingerprint", "run_id").rows() == [("user000001", "aa", "run-1"),
                                                                      ("user000002", "bb", "run-1")]
    assert got["registered_fingerprint"].to_list() == ["fp-user000001", "fp-user000002"]  # kept
    assert reg.state().height == N


def test_two_processes_registering_at_once_lose_nothing(tmp_path):
    root = str(tmp_path / "data")
    UserRegistry(root).register(USERS[:10])  # the table exists: both appends race on one snapshot
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    # overlapping halves: 6,000..14,000 are registered by both
    procs = [ctx.Process(target=_register, args=(root, USERS[:14_000], start)),
             ctx.Process(target=_register, args=(root, USERS[6_000:], start))]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    reg = UserRegistry(root)
    assert reg.users() == USERS  # every user of both, each once
    raw = reg.store.read(REGISTRY_TABLE, columns=["user_id"])
    assert raw.height >= N  # users both added may have two rows; reads collapse them
    assert reg.register(USERS) == []
    reg.record_materialized({u: "x" for u in USERS[6_000:6_010]}, "run-2")  # a materialization rewrites them as one
    raw = reg.store.read(REGISTRY_TABLE, USERS[6_000:6_010], columns=["user_id"])
    assert sorted(raw["user_id"].to_list()) == USERS[6_000:6_010]


def test_a_bucket_read_opens_only_that_buckets_files(tmp_path):
    reg = UserRegistry(str(tmp_path / "data"))
    for i in range(0, N, 5_000):  # several commits: several files per bucket
        reg.register(USERS[i:i + 5_000])
    n = reg.n_buckets
    bucket = user_bucket(USERS[0], n)
    acts = pl.DataFrame(reg.store._open(REGISTRY_TABLE).get_add_actions(flatten=True))
    in_bucket = acts.filter(pl.col("partition.user_bucket") == bucket).height
    assert in_bucket >= 4 and acts.height > in_bucket
    reg.store.files_read.clear()
    mine = reg.users({bucket})
    assert mine == [u for u in USERS if user_bucket(u, n) == bucket]
    assert reg.store.files_read[REGISTRY_TABLE] == in_bucket  # no other bucket's file opened


def test_run_users_by_digest_from_the_runs_buckets(tmp_path):
    reg = UserRegistry(str(tmp_path / "data"))
    reg.register(USERS)
    runs = [USERS[0:1000], USERS[1000:1500]]
    digests = reg.store_run_users(runs)
    assert digests == [users_digest(r) for r in runs]
    n = reg.n_buckets
    first = runs[0]
    buckets = {user_bucket(u, n) for u in first[:50]}
    reg.store.files_read.clear()
    got = reg.run_users(digests[0], buckets)
    assert got == sorted(u for u in first if user_bucket(u, n) in buckets)
    assert reg.store.files_read[RUN_USERS_TABLE] <= len(buckets)  # one append: one file per bucket
    assert reg.run_users(digests[1], range(n)) == runs[1]
    assert reg.run_users("0" * 32, range(n)) == []


def test_forget_erases_the_user_from_the_registry_and_run_lists(tmp_path):
    from qumem_pipeline.storage.forget import forget_user

    root = str(tmp_path / "data")
    reg = UserRegistry(root)
    reg.register(USERS[:2000])
    (digest,) = reg.store_run_users([USERS[:100]])
    reg.record_materialized({u: "fp" for u in USERS[:100]}, "run-3")
    report = forget_user(root, None, "user000042")
    assert {REGISTRY_TABLE, RUN_USERS_TABLE} <= set(report["tables"])
    reg = UserRegistry(root)
    assert "user000042" not in reg.users() and len(reg.users()) == 1999
    assert reg.run_users(digest, range(reg.n_buckets)) == [u for u in USERS[:100] if u != "user000042"]
    assert reg.register(["user000042"]) == ["user000042"]  # the store's commit guard drops it
    assert "user000042" not in reg.users()


def _lists_planned_at(reg: UserRegistry, runs: list[list[str]], planned_at) -> list[str]:
    """Append run lists as if planned at `planned_at` (store_run_users stamps now)."""
    digests = [users_digest(r) for r in runs]
    df = pl.DataFrame([(d, u) for d, r in zip(digests, runs) for u in r], schema={"digest": pl.String, "user_id": pl.String},
                      orient="row").with_columns(planned_at=pl.lit(planned_at, pl.Datetime("us", "UTC")))
    reg.store.append(RUN_USERS_TABLE, df)
    return digests


def test_old_run_lists_are_pruned_except_unfinished_ones(tmp_path):
    from datetime import datetime, timedelta, timezone

    reg = UserRegistry(str(tmp_path / "data"))
    now = datetime.now(timezone.utc)
    old = _lists_planned_at(reg, [USERS[:300], USERS[300:400], USERS[400:450]], now - timedelta(days=40))
    (recent,) = reg.store_run_users([USERS[450:500]])
    every = range(reg.n_buckets)
    assert reg.prune_run_users(now - timedelta(days=30), keep={old[1]}) == 300 + 50
    fresh = UserRegistry(str(tmp_path / "data"))
    assert fresh.run_users(old[0], every) == [] and fresh.run_users(old[2], every) == []
    assert fresh.run_users(old[1], every) == USERS[300:400]  # an unfinished run's list stays
    assert fresh.run_users(recent, every) == USERS[450:500]
    assert fresh.prune_run_users(now - timedelta(days=30)) == 100  # nothing kept now
    assert fresh.run_users(recent, every) == USERS[450:500]


def test_maintenance_job_prunes_run_lists_of_finished_runs_only(tmp_path, monkeypatch):
    """The table maintenance job's prune: lists over the retention go, except the list of a run the
    instance still has in progress; a run whose list was pruned fails naming its digest."""
    import importlib
    from datetime import datetime, timedelta, timezone

    import dagster as dg

    from assets.partitions import RUN_USERS_TAG

    root = tmp_path / "data"
    monkeypatch.setenv("QUMEM_DATA_ROOT", str(root))
    reg = UserRegistry(str(root))
    done, running = _lists_planned_at(reg, [USERS[:20], USERS[20:40]], datetime.now(timezone.utc) - timedelta(days=31))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_run(dg.DagsterRun(job_name="main_job", run_id="a" * 36, tags={RUN_USERS_TAG: running},
                                   status=dg.DagsterRunStatus.STARTED))
    instance.add_run(dg.DagsterRun(job_name="main_job", run_id="b" * 36, tags={RUN_USERS_TAG: done},
                                   status=dg.DagsterRunStatus.SUCCESS))
    import assets.definitions as d

    job = importlib.reload(d).build_definitions().resolve_job_def("table_maintenance_job")
    r = job.execute_in_process(instance=instance)
    assert r.success
    (out,) = [e for e in r.events_for_node("maintain_tables_op") if e.is_successful_output]
    assert out.step_output_data.metadata["run_users_pruned"].value == 20
    every = range(reg.n_buckets)
    fresh = UserRegistry(str(root))
    assert fresh.run_users(done, every) == [] and fresh.run_users(running, every) == USERS[20:40]

    # a run that still names the pruned list fails, naming it, instead of running for no user
    from resources import PipelineConfig
    from tests.schemes import partition_scheme

    with partition_scheme("user_buckets") as mods:
        p = mods["assets.partitions"]

        @dg.asset(partitions_def=p.partitions_for("user_buckets"))
        def probe(context: dg.AssetExecutionContext) -> list[str]:
            return p.users_for_run(context)

        pipeline = PipelineConfig(data_root=str(root), archive_path=str(tmp_path / "archive"))
        key = p.partition_key_of(USERS[0])
        kept = dg.materialize([probe], partition_key=p.partition_key_of(USERS[20]), instance=instance,
                              resources={"pipeline": pipeline}, tags={RUN_USERS_TAG: running})
        assert kept.output_for_node("probe") == sorted(u for u in USERS[20:40] if p.partition_key_of(u) == p.partition_key_of(USERS[20]))
        gone = dg.materialize([probe], partition_key=key, instance=instance, resources={"pipeline": pipeline},
                              tags={RUN_USERS_TAG: done}, raise_on_error=False)
        assert not gone.success
        (failure,) = [e for e in gone.all_events if e.is_step_failure]
        assert done in failure.step_failure_data.error.message and "run_users_retention_days" in failure.step_failure_data.error.message
