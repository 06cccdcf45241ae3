from datetime import datetime, timezone

import polars as pl

from qumem_pipeline.query.queries import as_of_position, read_queries, to_queries
from tests.conftest import REPO_ROOT, write_jsonl


def test_example_queries_valid():
    valid, bad = read_queries(REPO_ROOT / "examples" / "queries.jsonl")
    assert valid.height >= 8 and bad.height == 0
    assert valid["as_of"].dtype == pl.Datetime("us", "UTC")


def test_bad_queries_quarantined_with_field(tmp_path):
    p = write_jsonl(tmp_path / "q.jsonl", [
        {"query_id": "ok", "user_id": "alice", "query": "hi", "as_of": "2024-01-01T00:00:00Z"},
        {"query_id": "ok", "user_id": "alice", "query": "dup"},
        {"query_id": "u", "user_id": "../x", "query": "hi"},
        {"query_id": "e", "user_id": "alice", "query": " "},
        {"query_id": "t", "user_id": "alice", "query": "hi", "as_of": "whenever"},
        {"query_id": "n", "user_id": "alice", "query": "hi", "as_of_turn": -3},
        b'{"query_id": "broken"',
        {"query_id": "ok2", "user_id": "bob", "query": "still fine", "as_of_turn": 4},
    ])
    valid, bad = read_queries(p)
    assert valid["query_id"].to_list() == ["ok", "ok2"]
    assert dict(zip(bad["source_row"].to_list(), bad["field"].to_list())) == {
        2: "query_id", 3: "user_id", 4: "query", 5: "as_of", 6: "as_of_turn", 7: "(line)"}


def test_as_of_position():
    ts = [datetime(2024, 1, d, tzinfo=timezone.utc) for d in (1, 2, 3)]
    turns = pl.DataFrame({"turn_index": [0, 1, 2, 3], "timestamp": [ts[0], None, ts[1], ts[2]]},
                         schema_overrides={"timestamp": pl.Datetime("us", "UTC")})
    assert as_of_position(turns, datetime(2024, 1, 1, 12, tzinfo=timezone.utc), None) == 0  # untimed turn 1: not yet known
    assert as_of_position(turns, datetime(2024, 1, 2, 12, tzinfo=timezone.utc), None) == 2
    assert as_of_position(turns, datetime(2023, 1, 1, tzinfo=timezone.utc), None) == -1
    assert as_of_position(turns, None, None) == 3
    assert as_of_position(turns, ts[0], 2) == 2
    valid = pl.DataFrame({"query_id": ["q"], "user_id": ["u"], "query": ["x"], "as_of": [ts[1]], "as_of_turn": [None], "task_context": [None]},
                         schema_overrides={"as_of_turn": pl.Int64, "task_context": pl.String})
    assert to_queries(valid, {"u": turns})[0].as_of_position == 2
