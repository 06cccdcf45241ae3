"""Production keeps the quarantine contract: bad rows are quarantined and the run goes on, unless they exceed
the configured ceiling (the blocking check) or the run asks for strict mode (env, CLI, or run config)."""

import importlib

import dagster as dg
import polars as pl
import pytest

from tests.conftest import conversation, write_jsonl

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def _archive(root, n_bad: int):
    good = conversation("alice", "c1", ["I like tea.", "Noted.", "And green tea most.", "Got it."])
    bad = [{"user_id": "alice", "conversation_id": "c1", "role": "robot", "text": f"bad {i}"} for i in range(n_bad)]
    return write_jsonl(root / "archive" / "a.jsonl", good + bad)


@pytest.fixture
def production(tmp_path, monkeypatch):
    monkeypatch.setenv("QUMEM_ENV", "production")
    monkeypatch.setenv("QUMEM_DATA_ROOT", str(tmp_path / "data"))
    for k in ("QUMEM_STRICT", "QUMEM_MAX_QUARANTINE_FRACTION", "QUMEM_WAREHOUSE", "QUMEM_ARCHIVE_FORMAT"):
        monkeypatch.delenv(k, raising=False)

    def run(n_bad: int, run_config: dict | None = None):
        monkeypatch.setenv("QUMEM_ARCHIVE", str(_archive(tmp_path, n_bad)))
        import assets.definitions as d

        importlib.reload(d)
        defs = d.build_definitions()
        instance = dg.DagsterInstance.ephemeral()
        instance.add_dynamic_partitions("users", ["alice"])
        result = defs.resolve_job_def("ingest_job").execute_in_process(
            instance=instance, tags={RANGE_START: "alice", RANGE_END: "alice"}, run_config=run_config or {},
            raise_on_error=False)
        return defs, result

    return tmp_path / "data", run


def _quarantined(data_root) -> list[str]:
    from qumem_pipeline.storage.layout import DataLayout

    q = DataLayout(data_root).read_user_table("quarantine", "alice")
    return sorted(q["field"].to_list()) if q is not None else []


def test_production_quarantines_a_bad_row_and_carries_on(production):
    data_root, run = production
    defs, result = run(n_bad=1)
    assert defs.resources["pipeline"].strict is False
    assert result.success
    assert _quarantined(data_root) == ["role"]
    from qumem_pipeline.storage.layout import DataLayout

    assert DataLayout(data_root).read_user_table("turns", "alice").height == 4
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"schema_conforms": True, "quarantine_under_ceiling": True,
                      "personalization_evidence_turns_exist": True}
    assert {m.asset_key.to_user_string() for m in result.get_asset_materialization_events()} == {"turns", "warehouse"}


def test_production_fails_over_the_configured_ceiling(production, monkeypatch):
    data_root, run = production
    monkeypatch.setenv("QUMEM_MAX_QUARANTINE_FRACTION", "0.1")  # 1 bad of 5 rows = 20% > 10%
    defs, result = run(n_bad=1)
    assert defs.resources["pipeline"].max_quarantine_fraction == 0.1
    assert not result.success
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["quarantine_under_ceiling"] is False
    # the blocking check stops the run before the warehouse is loaded
    assert {m.asset_key.to_user_string() for m in result.get_asset_materialization_events()} == {"turns"}


@pytest.mark.parametrize("how", ["env", "run_config"])
def test_strict_is_a_per_run_choice(production, monkeypatch, how):
    data_root, run = production
    if how == "env":  # what `qumem run --strict` sets
        monkeypatch.setenv("QUMEM_STRICT", "1")
        _, result = run(n_bad=1)
    else:
        # a resource's run config replaces its whole config: required fields name their env sources
        config = {"strict": True, "data_root": {"env": "QUMEM_DATA_ROOT"}, "archive_path": {"env": "QUMEM_ARCHIVE"}}
        _, result = run(n_bad=1, run_config={"resources": {"pipeline": {"config": config}}})
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "role" in str(failure.event_specific_data.error)
    assert _quarantined(data_root) == []
    # and the next run, without it, quarantines again
    monkeypatch.delenv("QUMEM_STRICT", raising=False)
    _, again = run(n_bad=1)
    assert again.success and _quarantined(data_root) == ["role"]


def test_ceiling_must_be_a_fraction(production, monkeypatch):
    from resources import resources_for

    monkeypatch.setenv("QUMEM_MAX_QUARANTINE_FRACTION", "20%")
    with pytest.raises(ValueError, match="QUMEM_MAX_QUARANTINE_FRACTION"):
        resources_for("production")
