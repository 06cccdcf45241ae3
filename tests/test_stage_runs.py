"""A stage's core function runs without Dagster (the asset only reads its partition, calls it, publishes
through the gate and returns its metadata): missing upstream rows are a `StageFailed` naming what to
materialize, and a run's checks gate its own write."""

import polars as pl
import pytest

from qumem_pipeline.contracts.stage_run import StageFailed
from qumem_pipeline.memories.stage import run_memories
from qumem_pipeline.query.stage import run_query_states
from qumem_pipeline.runtime.progress import ProgressLine
from qumem_pipeline.storage.layout import DataLayout


def test_memories_without_upstream_rows_names_what_to_materialize(tmp_path):
    with pytest.raises(StageFailed, match="materialize `turns` and `episodes` first"):
        run_memories(DataLayout(tmp_path), ["ana"], backend=None, max_tokens=64, log=lambda m: None,
                     progress=ProgressLine(lambda m: None, "calls"))


def test_query_states_without_a_queries_file_clears_the_users_states(tmp_path):
    layout = DataLayout(tmp_path)
    layout.replace_users("query_states", ["ana", "ben"], pl.DataFrame({"user_id": ["ana", "ben"], "query_id": ["q1", "q2"]}))
    run = run_query_states(layout, ["ana"], queries_path=None, strategy_name="qumem", retrieval_k=5, respond=False,
                           backend=None, embedder=None, log=lambda m: None, progress_for=lambda label: None)
    assert all(o.passed for o in run.outcomes.values()) and run.metadata["queries"] == 0
    assert layout.read_table("query_states", ["ana", "ben"])["user_id"].to_list() == ["ana", "ben"]  # nothing yet
    run.publish()
    left = layout.read_table("query_states", ["ana", "ben"])
    assert left["user_id"].to_list() == ["ben"]  # the run's user cleared, the other kept
