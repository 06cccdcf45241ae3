"""The deployment's query strategy when QUMEM_QUERY_STRATEGY is unset: AdaMem's with a served model (the
evaluation record's best), QUMem's three agents with the embedded 135M model (docs/evaluation.md#the-default-strategy)."""

import json
from pathlib import Path

import pytest

from qumem_pipeline.query.strategies.registry import STRATEGY_NAMES, default_strategy

TABLES = Path(__file__).resolve().parents[1] / "eval_record" / "tables"
TABLE = TABLES / "locomo_qa_qwen15b_conv26_conv30_all.json"
# every strategy on three and four conversations; then every strategy on all five dev conversations
ALL_SIX = TABLES / "locomo_qa_qwen15b_conv26_conv30_conv41.json"
FOUR = TABLES / "locomo_qa_qwen15b_conv26_conv30_conv41_conv42.json"
LARGEST = TABLES / "locomo_qa_qwen15b_dev5.json"
# the served default answered again with its states' aliases expanded (query/strategies/state_labels.py), beside top-k
EXPANDED = TABLES / "locomo_qa_qwen15b_dev5_adamem_expanded.json"


@pytest.mark.parametrize("kind, env, want", [
    ("local", {}, "qumem"),
    ("local", {"QUMEM_LLM_KIND": "openai"}, "adamem"),
    ("local", {"QUMEM_LLM_KIND": "vllm-managed"}, "adamem"),
    ("local", {"QUMEM_QUERY_STRATEGY": "topk"}, "topk"),
    ("openai", {}, "adamem"),
    ("openai", {"QUMEM_QUERY_STRATEGY": "qumem_hybrid"}, "qumem_hybrid"),
])
def test_resources_pick_the_default_by_llm_backend_unless_told(monkeypatch, kind, env, want):
    from resources import local_resources, production_resources

    for k in ("QUMEM_LLM_KIND", "QUMEM_QUERY_STRATEGY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("QUMEM_DATA_ROOT", "/nonexistent")  # production_resources reads it lazily (EnvVar)
    res = local_resources() if kind == "local" else production_resources()
    assert res["pipeline"].query_strategy == want and want in STRATEGY_NAMES


@pytest.mark.parametrize("table, n_scored", [(TABLE, 233), (ALL_SIX, 385), (FOUR, 584), (LARGEST, 762), (EXPANDED, 762)])
def test_the_served_default_is_level_with_the_best_on_the_committed_record(table, n_scored):
    """The default for served models must not be behind any strategy of the committed tables it is in by an
    interval that excludes 0 (if the record moves, this says the default must move too)."""
    figures = json.loads(table.read_text())["figures"]
    vs = figures["f1_vs_" + default_strategy("openai")]
    assert figures["n_scored"] >= n_scored
    assert all(v["ci95"][0] <= 0 for v in vs.values()), vs  # nobody is ahead of it with an interval above 0
    if table != EXPANDED:  # that table holds the default and top-k over turns only
        assert vs["qumem"]["ci95"][1] < 0  # and it is ahead of QUMem's state with an interval below 0 for qumem
