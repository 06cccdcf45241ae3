"""Discovery sensor: real sensor evaluations against real `turns` runs, in both partition schemes.

New or changed users are packed into range runs of at most users_per_run; the cursor is one
digest (state lives in the instance), and an unchanged archive requests nothing. The tick reads no
archive file: it requests the `archive_sync` run (executed here through Dagster, as the daemon
would launch it) and plans from the fingerprints table once that run changed it.
"""

import re

import dagster as dg
import pytest

from tests.conftest import conversation, local_instance, write_jsonl
from tests.schemes import partition_scheme
from tests.ticks import SYNC_JOB, rebuild_requests, run_archive_sync, sync_requests

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def _archive(path, users: dict[str, list[str]]):
    write_jsonl(path / "a.jsonl", [r for u, texts in users.items() for r in conversation(u, f"{u}-c1", texts)])


BASE = {"alice": ["I like tea.", "Noted.", "Green tea mostly.", "OK."],
        "bob": ["My dog is sick.", "Sorry.", "The vet says rest.", "Good."],
        "chen": ["I play piano.", "Nice!", "Scales are hard.", "Keep going."]}


@pytest.fixture(params=["users", "user_buckets"])
def scheme(request):
    with partition_scheme(request.param, buckets=4) as modules:  # alice: b001, dan: b001, bob+chen: b002
        yield request.param, modules


def _users_of(request, instance, modules, pipeline=None) -> list[str]:
    """The users a requested run will process: what users_for_run resolves from its tags."""
    p = modules["assets.partitions"]
    digest = request.tags.get(p.RUN_USERS_TAG)
    if digest:  # the list is in the data root's run_users table; the tag holds only its digest
        return p.user_registry(pipeline).run_users(digest, range(64))
    order = p.registered_users(instance)
    if request.partition_key:
        return [request.partition_key]
    return order[order.index(request.tags[RANGE_START]): order.index(request.tags[RANGE_END]) + 1]


def _must_not_read(*a, **k):
    raise AssertionError("the tick read the fingerprints table although its files had not changed")


def _must_not_open(*a, **k):
    raise AssertionError("the tick opened an archive file")


def _skipped(res) -> bool:
    """Nothing requested: a bare SkipReason, or a result that only moves the cursor."""
    return isinstance(res, dg.SkipReason) or (isinstance(res, dg.SensorResult) and not res.run_requests
                                              and res.skip_reason is not None)


def test_an_older_bare_digest_cursor_is_still_read():
    from assets.sensors import parse_cursor

    digest = "ab" * 32
    assert parse_cursor(digest) == (None, digest)
    assert parse_cursor(f"f{'0' * 16}:{digest}") == ("0" * 16, digest)
    assert parse_cursor(None) == (None, None)


def test_sensor_packs_new_and_changed_users_into_range_runs(tmp_path, scheme, monkeypatch):
    name, modules = scheme
    turns = modules["assets.ingest"].turns
    partitions = modules["assets.partitions"]
    from resources import PipelineConfig

    archive = tmp_path / "archive"
    _archive(archive, BASE)
    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
    job = dg.define_asset_job("turns_only", selection=[turns], partitions_def=partitions.users_partitions)
    defs = dg.Definitions(assets=[turns], jobs=[job], resources={"pipeline": pipeline})
    sensor = modules["assets.sensors"].build_discovery_sensor(job=job, users_per_run=2)

    with local_instance(tmp_path / "home") as instance:
        def tick(cursor=None):
            res = sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources={"pipeline": pipeline}))
            if isinstance(res, dg.SensorResult):
                for req in res.dynamic_partitions_requests:  # what the sensor daemon applies
                    instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
            return res

        def execute(req):
            tags = dict(req.tags)
            if req.partition_key:
                tags["dagster/partition"] = req.partition_key
            result = defs.resolve_job_def("turns_only").execute_in_process(instance=instance, tags=tags)
            assert result.success
            return {m.partition for m in result.get_asset_materialization_events()}, \
                result.get_asset_materialization_events()[0].materialization.metadata["users"].value

        def registered():
            return partitions.registered_users(instance, pipeline)

        # before any sync: the tick only requests the archive_sync run (the table holds nobody yet)
        before = tick()
        [sync] = sync_requests(before)
        assert rebuild_requests(before) == [] and registered() == []
        run_archive_sync(instance, pipeline, sync)
        first = tick(before.cursor)
        assert sync_requests(first) == []  # the archive is in step with the tables now
        # registered by the tick itself (then checked against the forget registry), not by the daemon
        assert first.dynamic_partitions_requests == []
        if name == "users":
            assert instance.get_dynamic_partitions("users") == ["alice", "bob", "chen"]
        else:  # in the data root's registry
            assert instance.get_dynamic_partitions("users") == []
        assert registered() == ["alice", "bob", "chen"]
        runs = [_users_of(r, instance, modules, pipeline) for r in first.run_requests]
        assert sorted(u for users in runs for u in users) == ["alice", "bob", "chen"]
        assert all(1 <= len(users) <= 2 for users in runs) and len(runs) == 2
        assert re.fullmatch(r"f[0-9a-f]{16}:[0-9a-f]{64}", first.cursor)  # a version and a digest, not per-user state
        # nothing moved since: the tick reads no fingerprint (the table is still at the cursor's version)
        with monkeypatch.context() as m:
            m.setattr("qumem_pipeline.ingest.sync.stored_fingerprints", _must_not_read)
            assert isinstance(tick(first.cursor), dg.SkipReason)
        for r in first.run_requests:
            execute(r)

        with monkeypatch.context() as m:  # the runs synced nothing new: the same files, still no read
            m.setattr("qumem_pipeline.ingest.sync.stored_fingerprints", _must_not_read)
            assert isinstance(tick(first.cursor), dg.SkipReason)
        # the table's files changed but not what they say (rows rewritten as they were): read, compared,
        # nothing requested, and the cursor moves to the files now held
        digest = first.cursor.split(":")[1]
        moved = tick(f"f{'0' * 16}:{digest}")
        assert _skipped(moved) and moved.cursor == first.cursor

        # bob changes, dan arrives: the tick sees it only once the sync run it requests has run
        _archive(archive, dict(BASE, bob=BASE["bob"] + ["He is better now.", "Great."], dan=["New here.", "Welcome."]))
        with monkeypatch.context() as m:  # the tick opens no archive file, and reads no fingerprint (same files)
            m.setattr("qumem_pipeline.ingest.sync.stored_fingerprints", _must_not_read)
            m.setattr("qumem_pipeline.ingest.manifest.hash_file", _must_not_open)
            pending = tick(first.cursor)
        [sync] = sync_requests(pending)
        assert rebuild_requests(pending) == [] and registered() == ["alice", "bob", "chen"]
        run_archive_sync(instance, pipeline, sync)
        third = tick(first.cursor)
        assert third.dynamic_partitions_requests == []
        assert registered() == ["alice", "bob", "chen", "dan"]
        runs = [_users_of(r, instance, modules, pipeline) for r in third.run_requests]
        if name == "users":  # chen sits between bob and dan in the registry order: two ranges
            assert runs == [["bob"], ["dan"]]
        else:  # one run over buckets b001..b002 naming its two users
            assert runs == [["bob", "dan"]]
            assert third.run_requests[0].tags[RANGE_START] == "b001" and third.run_requests[0].tags[RANGE_END] == "b002"
        assert re.fullmatch(r"f[0-9a-f]{16}:[0-9a-f]{64}", third.cursor) and third.cursor != first.cursor
        # re-evaluating before the runs land requests the same run keys (the daemon dedupes them)
        assert [r.run_key for r in tick(first.cursor).run_requests] == [r.run_key for r in third.run_requests]
        processed = 0
        for r in third.run_requests:
            _, users = execute(r)
            processed += users
        assert processed == 2  # the bucket run rebuilt its two users, not the buckets' other users
        assert tick(first.cursor).run_requests == []  # built: nothing left to request
