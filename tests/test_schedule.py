"""Nightly incremental schedule: real schedule evaluations against real `turns` materializations.

Runs are kept to the `turns` asset (no models) so the event log is real and the test stays fast.
The tick only plans from the fingerprints table: the archive sync is a run of the `archive_sync`
job (requested by `archive_sync_schedule`), executed here through Dagster before the ticks.
"""

import importlib
from datetime import datetime, timezone

import dagster as dg
import pytest

from assets.ingest import turns
from assets.partitions import users_partitions
from assets.schedules import build_nightly_schedule, recorded_fingerprints
from qumem_pipeline.ingest.incremental import (
    contiguous_ranges,
    plan_rebuild,
    recorded_form,
    unfinished,
)
from resources import PipelineConfig
from tests.conftest import conversation, local_instance, write_jsonl
from tests.ticks import SYNC_JOB, run_archive_sync

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
TICK = datetime(2026, 11, 30, 2, 0, tzinfo=timezone.utc)

turns_job = dg.define_asset_job("turns_only", selection=[turns], partitions_def=users_partitions)


# --- pure decisions -------------------------------------------------------------------------------

def test_plan_rebuild_sorts_users_into_new_changed_unchanged():
    current = {"a": "1" * 64, "b": "2" * 64, "c": "3" * 64, "d": "4" * 64, "e": "5" * 64}
    registered = ["a", "b", "c", "d", "gone"]
    recorded = {"a": recorded_form("1" * 64), "b": recorded_form("9" * 64), "gone": "x"}  # c, d never materialized
    plan = plan_rebuild(current, registered, recorded)
    assert plan.new == ["e"]
    assert plan.changed == ["b", "c", "d"]
    assert plan.unchanged == ["a"]
    assert plan.removed == ["gone"]  # left the archive: rebuilt once, as empty
    assert plan.to_rebuild == {"b", "c", "d", "e", "gone"}


def test_contiguous_ranges_hold_only_selected_users_and_respect_the_limit():
    order = ["u1", "u2", "u3", "u4", "u5", "u6", "u7", "u8"]
    selected = {"u1", "u2", "u3", "u5", "u7", "u8"}
    assert contiguous_ranges(order, selected, 2) == [["u1", "u2"], ["u3"], ["u5"], ["u7", "u8"]]
    assert contiguous_ranges(order, selected, 10) == [["u1", "u2", "u3"], ["u5"], ["u7", "u8"]]
    assert contiguous_ranges(order, set(order), 3) == [order[0:3], order[3:6], order[6:8]]
    assert contiguous_ranges(order, set(), 3) == []


def test_unfinished_users_are_rebuilt_even_when_unchanged():
    turns_ids = {"a": 10, "b": 11, "c": 12}
    final_ids = {"a": 20, "b": 5}  # b's final asset predates its turns; c never got one
    assert unfinished(turns_ids, final_ids) == {"b", "c"}
    fp = "f" * 64
    plan = plan_rebuild({"a": fp, "b": fp}, ["a", "b"], {"a": recorded_form(fp), "b": recorded_form(fp)}, {"b"})
    assert plan.changed == ["b"] and plan.unchanged == ["a"]


def test_contiguous_ranges_reject_bad_input():
    with pytest.raises(ValueError, match="max_per_run"):
        contiguous_ranges(["a"], {"a"}, 0)
    with pytest.raises(ValueError, match="not in the partition order"):
        contiguous_ranges(["a"], {"a", "zz"}, 5)


# --- real schedule evaluations ---------------------------------------------------------------------

def _archive(path, users: dict[str, list[str]]):
    rows = [r for u, texts in users.items() for r in conversation(u, f"{u}-c1", texts)]
    write_jsonl(path / "a.jsonl", rows)


def _defs(schedule, pipeline) -> dg.Definitions:
    return dg.Definitions(assets=[turns], jobs=[turns_job], schedules=[schedule], resources={"pipeline": pipeline})


def _evaluate(schedule, instance, pipeline):
    # A schedule context opens an instance from the ref it is given; leaving it open would leave that
    # instance's state storage as Dagster's current one for every later test, so close it.
    with dg.build_schedule_context(
        instance=instance, scheduled_execution_time=TICK, resources={"pipeline": pipeline},
        repository_def=_defs(schedule, pipeline).get_repository_def(),
    ) as ctx:
        return schedule.evaluate_tick(ctx)


def _users_of(request) -> tuple[str, str]:
    if request.partition_key:
        return request.partition_key, request.partition_key
    return request.tags[RANGE_START], request.tags[RANGE_END]


def _execute(instance, request, schedule, pipeline):
    tags = dict(request.tags)  # the resolved request: dagster/partition or the range tags
    result = _defs(schedule, pipeline).resolve_job_def("turns_only").execute_in_process(instance=instance, tags=tags)
    assert result.success


@pytest.fixture
def instance(tmp_path):
    """A persistent (SQLite) instance, as build_schedule_context requires."""
    with local_instance(tmp_path / "dagster_home") as inst:
        yield inst


def test_schedule_requests_only_new_and_changed_users(tmp_path, instance):
    archive = tmp_path / "archive"
    base = {"alice": ["I like tea.", "Noted.", "Green tea mostly.", "OK."],
            "bob": ["My dog is sick.", "Sorry.", "The vet says rest.", "Good."],
            "chen": ["I play piano.", "Nice!", "Scales are hard.", "Keep going."]}
    _archive(archive, base)
    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
    schedule = build_nightly_schedule(job=turns_job, users_per_run=50, final_asset="turns")

    # Before any archive sync the tick has nothing to plan from, and says so (no user counts as gone).
    assert "no archive sync" in _evaluate(schedule, instance, pipeline).skip_message
    run_archive_sync(instance, pipeline)
    # First night: everyone is new -> registered, one range run of all three.
    first = _evaluate(schedule, instance, pipeline)
    assert [_users_of(r) for r in first.run_requests] == [("alice", "chen")]
    assert instance.get_dynamic_partitions("users") == ["alice", "bob", "chen"]
    _execute(instance, first.run_requests[0], schedule, pipeline)
    assert set(recorded_fingerprints(instance, ["alice", "bob", "chen"])) == {"alice", "bob", "chen"}

    # Unchanged archive: no runs at all.
    second = _evaluate(schedule, instance, pipeline)
    assert second.run_requests == [] and "3 users unchanged" in second.skip_message

    # Bob's rows change and dan arrives: exactly those two, as two runs (chen sits between them).
    changed = dict(base, bob=base["bob"] + ["He is better now.", "Great news."], dan=["New here.", "Welcome."])
    _archive(archive, changed)
    # The tick reads no archive file: the change is not in its plan until the sync run read it.
    assert _evaluate(schedule, instance, pipeline).run_requests == []
    run_archive_sync(instance, pipeline)
    third = _evaluate(schedule, instance, pipeline)
    assert [_users_of(r) for r in third.run_requests] == [("bob", "bob"), ("dan", "dan")]
    assert instance.get_dynamic_partitions("users") == ["alice", "bob", "chen", "dan"]
    assert len({r.run_key for r in third.run_requests}) == 2
    for r in third.run_requests:
        _execute(instance, r, schedule, pipeline)

    # Built: the next night is a no-op again.
    assert _evaluate(schedule, instance, pipeline).run_requests == []


def test_schedule_ranges_respect_users_per_run(tmp_path, instance):
    archive = tmp_path / "archive"
    users = {f"u{i}": [f"Hello from user {i}.", "Hi."] for i in range(5)}
    _archive(archive, users)
    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
    schedule = build_nightly_schedule(job=turns_job, users_per_run=2, final_asset="turns")
    run_archive_sync(instance, pipeline)
    res = _evaluate(schedule, instance, pipeline)
    assert [_users_of(r) for r in res.run_requests] == [("u0", "u1"), ("u2", "u3"), ("u4", "u4")]


def test_definitions_register_the_stopped_nightly_schedule(monkeypatch):
    import assets.definitions as d
    import assets.schedules as s

    monkeypatch.setenv("QUMEM_NIGHTLY_CRON", "30 3 * * *")
    importlib.reload(s)
    importlib.reload(d)
    try:
        sched = d.build_definitions().get_schedule_def("nightly_incremental_rebuild")
        assert sched.cron_schedule == "30 3 * * *" and sched.execution_timezone == "UTC"
        assert sched.default_status == dg.DefaultScheduleStatus.STOPPED
        assert sched.job_name == "main_job"
        sync = d.build_definitions().get_schedule_def("archive_sync_schedule")  # its companion: the sync run first
        assert sync.job_name == SYNC_JOB and sync.default_status == dg.DefaultScheduleStatus.STOPPED
        assert sync.cron_schedule == "0 1 * * *"
    finally:
        monkeypatch.delenv("QUMEM_NIGHTLY_CRON")
        importlib.reload(s)
        importlib.reload(d)
    assert d.build_definitions().get_schedule_def("nightly_incremental_rebuild").cron_schedule == "0 2 * * *"


# --- a run that fails part-way is finished the next night -------------------------------------------

FAIL_DOWNSTREAM = {"on": True}


@dg.asset(partitions_def=users_partitions, deps=[turns], backfill_policy=turns.backfill_policy)
def turn_counts(context: dg.AssetExecutionContext) -> None:
    """A downstream step that fails on demand, standing in for a later stage crashing mid-run."""
    if FAIL_DOWNSTREAM["on"]:
        raise RuntimeError("downstream stage crashed")


def test_schedule_finishes_users_whose_run_failed_after_turns(tmp_path, instance):
    archive = tmp_path / "archive"
    _archive(archive, {"alice": ["I like tea.", "Noted."], "bob": ["My dog is sick.", "Sorry."]})
    pipeline = PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(archive))
    job = dg.define_asset_job("turns_and_counts", selection=[turns, turn_counts])
    schedule = build_nightly_schedule(job=job, users_per_run=50, final_asset="turn_counts")
    defs = dg.Definitions(assets=[turns, turn_counts], jobs=[job], schedules=[schedule], resources={"pipeline": pipeline})

    def evaluate():
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=TICK,
                                       resources={"pipeline": pipeline}, repository_def=defs.get_repository_def()) as ctx:
            return schedule.evaluate_tick(ctx)

    def execute(request):
        return defs.resolve_job_def("turns_and_counts").execute_in_process(
            instance=instance, tags=dict(request.tags), raise_on_error=False)

    run_archive_sync(instance, pipeline)
    first = evaluate()
    assert [_users_of(r) for r in first.run_requests] == [("alice", "bob")]
    FAIL_DOWNSTREAM["on"] = True
    assert not execute(first.run_requests[0]).success
    assert set(recorded_fingerprints(instance, ["alice", "bob"])) == {"alice", "bob"}  # turns did land

    retry = evaluate()  # content unchanged, but the downstream step never finished
    assert [_users_of(r) for r in retry.run_requests] == [("alice", "bob")]
    FAIL_DOWNSTREAM["on"] = False
    assert execute(retry.run_requests[0]).success
    assert evaluate().run_requests == []
