"""Ticks only plan (issue 51, item 6): the nightly schedule and the discovery sensor read no archive
file; the archive sync is a run of the `archive_sync` job that the sensor and the companion
`archive_sync_schedule` request. Real schedule and sensor evaluations on a real (SQLite) instance,
the requested runs executed through Dagster with the requests' tags, real Delta tables."""

from datetime import datetime, timezone

import dagster as dg
import pytest

from tests.conftest import conversation, local_instance, write_jsonl
from tests.ticks import SYNC_JOB, rebuild_requests, run_archive_sync, sync_requests

TICK = datetime(2026, 11, 30, 1, 0, tzinfo=timezone.utc)
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def _no_archive_read(monkeypatch):
    """What a tick must not do: sync, or open an archive file to hash it."""
    def sync(*a, **k):
        raise AssertionError("the tick ran the archive sync")

    def hashed(*a, **k):
        raise AssertionError("the tick opened an archive file")

    monkeypatch.setattr("qumem_pipeline.ingest.sync.sync_archive", sync)
    monkeypatch.setattr("qumem_pipeline.ingest.manifest.hash_file", hashed)


@pytest.fixture
def setup(tmp_path):
    from assets.archive_sync import archive_sync_job, build_archive_sync_schedule
    from assets.ingest import turns
    from assets.partitions import users_partitions
    from assets.schedules import build_nightly_schedule
    from assets.sensors import build_discovery_sensor
    from resources import PipelineConfig

    archive = tmp_path / "archive"
    write_jsonl(archive / "a.jsonl", conversation("alice", "c1", ["I like tea.", "Noted."])
                + conversation("bob", "c2", ["My dog is sick.", "Sorry."]))
    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
    job = dg.define_asset_job("turns_only", selection=[turns], partitions_def=users_partitions)
    nightly = build_nightly_schedule(job=job, users_per_run=50, final_asset="turns")
    sync_schedule = build_archive_sync_schedule()
    sensor = build_discovery_sensor(job=job, users_per_run=50)
    defs = dg.Definitions(assets=[turns], jobs=[job, archive_sync_job], schedules=[nightly, sync_schedule],
                          sensors=[sensor], resources={"pipeline": pipeline})
    with local_instance(tmp_path / "home") as instance:
        yield {"archive": archive, "pipeline": pipeline, "defs": defs, "instance": instance, "nightly": nightly,
               "sync_schedule": sync_schedule, "sensor": sensor}


def _evaluate(s, schedule):
    with dg.build_schedule_context(instance=s["instance"], scheduled_execution_time=TICK,
                                   resources={"pipeline": s["pipeline"]},
                                   repository_def=s["defs"].get_repository_def()) as ctx:
        return schedule.evaluate_tick(ctx)


def _sense(s, cursor=None):
    """The tick as the sensor daemon evaluates it (its requests resolved against the targeted jobs)."""
    with dg.build_sensor_context(instance=s["instance"], cursor=cursor, resources={"pipeline": s["pipeline"]},
                                 repository_def=s["defs"].get_repository_def()) as ctx, \
            dg.partition_loading_context(dynamic_partitions_store=s["instance"]):
        return s["sensor"].evaluate_tick(ctx)


def _execute(s, request, job_name="turns_only"):
    return s["defs"].resolve_job_def(job_name).execute_in_process(
        instance=s["instance"], tags=dict(request.tags), raise_on_error=False)


def test_new_archive_content_reaches_the_plan_only_through_the_sync_run(setup, monkeypatch):
    s = setup
    # the companion schedule requests the sync (the archive is ahead of the empty manifest) ...
    with monkeypatch.context() as m:
        _no_archive_read(m)
        requested = _evaluate(s, s["sync_schedule"])
        [sync] = requested.run_requests
        assert sync.job_name == SYNC_JOB and sync.tags["qumem/archive_behind"].startswith("1 new")
        # ... and the nightly tick, with no sync run yet, plans nobody
        assert "no archive sync" in _evaluate(s, s["nightly"]).skip_message
    # the sync is a real Dagster run, with its progress figures as metadata
    result = _execute(s, sync, SYNC_JOB)
    assert result.success and result.dagster_run.job_name == SYNC_JOB
    [out] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    meta = {k: v.value for k, v in out.step_output_data.metadata.items()}
    assert meta["files_read"] == "1/1" and meta["rows_read"] == 4 and meta["users_rebuilt"] == 2
    logged = [e.user_message for e in s["instance"].all_logs(result.run_id)]
    assert any(m.startswith("archive files read: 1/1 (") and "ETA" in m for m in logged)  # done/total, rate, ETA

    with monkeypatch.context() as m:
        _no_archive_read(m)
        assert "in step" in _evaluate(s, s["sync_schedule"]).skip_message  # nothing to sync: no run
        first = _evaluate(s, s["nightly"])
    assert len(first.run_requests) == 1 and _execute(s, first.run_requests[0]).success

    # a new file lands: no tick sees it until the sync run read it
    write_jsonl(s["archive"] / "b.jsonl", conversation("chen", "c3", ["I play piano.", "Nice!"]))
    with monkeypatch.context() as m:
        _no_archive_read(m)
        assert _evaluate(s, s["nightly"]).run_requests == []
        sensed = _sense(s)
        assert rebuild_requests(sensed) == []
        [sync] = sync_requests(sensed)
        # the sensor asks once per archive state: the same request while that run has not finished
        assert [r.run_key for r in sync_requests(_sense(s))] == [sync.run_key]
    assert _execute(s, sync, SYNC_JOB).success
    with monkeypatch.context() as m:
        _no_archive_read(m)
        sensed = _sense(s)
        assert sync_requests(sensed) == []
        [rebuild] = rebuild_requests(sensed)
        assert rebuild.partition_key == "chen" and rebuild.job_name == "turns_only"
        assert [r.partition_key for r in _evaluate(s, s["nightly"]).run_requests] == ["chen"]
    assert _execute(s, rebuild).success
    assert _evaluate(s, s["nightly"]).run_requests == []


def test_a_sync_in_flight_is_not_requested_again_and_a_failed_one_is_retried_then_given_up(setup, monkeypatch):
    from assets.archive_sync import SYNC_ATTEMPTS

    s = setup
    instance = s["instance"]
    [sync] = sync_requests(_sense(s))
    # a run of the job the daemon created and has not finished: the tick waits for it
    run = instance.create_run_for_job(s["defs"].resolve_job_def(SYNC_JOB), tags=dict(sync.tags))  # NOT_STARTED
    assert sync_requests(_sense(s)) == [] and "in flight" in _evaluate(s, s["sync_schedule"]).skip_message
    instance.report_run_failed(run)

    # bad rows over the quarantine ceiling: the sync run fails in one line and commits nothing
    write_jsonl(s["archive"] / "bad.jsonl", [{"user_id": "zed", "conversation_id": "c", "role": "robot",
                                               "text": f"bad {i}"} for i in range(9)])
    keys = []
    for attempt in range(SYNC_ATTEMPTS):
        [sync] = sync_requests(_sense(s))
        keys.append(sync.run_key)
        failed = _execute(s, sync, SYNC_JOB)
        assert not failed.success
        [failure] = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
        assert "archive sync stopped by blocking checks (quarantine_under_ceiling)" in \
            failure.step_failure_data.user_failure_data.description
    assert len(set(keys)) == SYNC_ATTEMPTS  # each retry is a new run key (the daemon dedupes equal ones)
    assert sync_requests(_sense(s)) == []
    assert f"failed {SYNC_ATTEMPTS} times on this archive state" in _evaluate(s, s["sync_schedule"]).skip_message
    # the operator fixes the file: a new archive state, a new sync
    (s["archive"] / "bad.jsonl").unlink()
    [sync] = sync_requests(_sense(s))
    assert _execute(s, sync, SYNC_JOB).success
    [both] = _evaluate(s, s["nightly"]).run_requests  # what the first good sync wrote: alice and bob, one range
    assert (both.tags[RANGE_START], both.tags[RANGE_END]) == ("alice", "bob")
