"""The asset checks fail on planted bad outputs and pass on good ones."""

import polars as pl

from qumem_pipeline.contracts import checks


def test_schema_conforms():
    df = pl.DataFrame({"a": [1], "b": ["x"]})
    assert checks.schema_conforms(df, {"a": pl.Int64, "b": pl.String}, "t").passed
    bad = checks.schema_conforms(df, {"a": pl.String, "c": pl.Int64}, "t")
    assert not bad.passed and "missing column c" in bad.description and bad.metadata["problems"] == 2


def test_quarantine_ceiling():
    assert checks.quarantine_under_ceiling(95, 5, 0.1).passed
    assert not checks.quarantine_under_ceiling(50, 50, 0.1).passed
    assert checks.quarantine_under_ceiling(0, 0, 0.1).passed


def test_episodes_cover_turns():
    turns = {"u": pl.DataFrame({"turn_index": [0, 1, 2]})}
    good = {"u": pl.DataFrame({"turn_ids": [[0, 1], [2]], "n_turns": [2, 1]})}
    assert checks.episodes_cover_turns(turns, good).passed
    gap = {"u": pl.DataFrame({"turn_ids": [[0, 1]], "n_turns": [2]})}
    assert not checks.episodes_cover_turns(turns, gap).passed
    empty = {"u": pl.DataFrame({"turn_ids": [[0, 1, 2], []], "n_turns": [3, 0]}, schema_overrides={"turn_ids": pl.List(pl.Int64)})}
    assert not checks.episodes_cover_turns(turns, empty).passed


def test_evidence_inside_episodes():
    eps = pl.DataFrame({"episode_id": ["e1", "e2"], "turn_ids": [[0, 1], [2, 3]]})
    good = pl.DataFrame({"episode_id": ["e1", "e2"], "evidence_turn_ids": [[1], [2, 3]]})
    assert checks.evidence_inside_episodes(good, eps).passed
    planted = pl.DataFrame({"episode_id": ["e1", "e9", "e2"], "evidence_turn_ids": [[1, 2], [0], []]},
                           schema_overrides={"evidence_turn_ids": pl.List(pl.Int64)})
    out = checks.evidence_inside_episodes(planted, eps)
    assert not out.passed and out.metadata["violations"] == 3


def test_no_future_citations():
    mems = pl.DataFrame({"memory_id": ["m1", "m2"], "position": [3, 9]})
    ok = pl.DataFrame({"query_id": ["q"], "as_of_position": [5], "cited_memory_ids": [["m1"]], "cited_turn_ids": [[2, 3]]})
    assert checks.no_future_citations(ok, mems).passed
    bad = pl.DataFrame({"query_id": ["q"], "as_of_position": [5], "cited_memory_ids": [["m1", "m2"]], "cited_turn_ids": [[3]]})
    assert not checks.no_future_citations(bad, mems).passed
    bad_turn = pl.DataFrame({"query_id": ["q"], "as_of_position": [5], "cited_memory_ids": [["m1"]], "cited_turn_ids": [[7]]})
    assert not checks.no_future_citations(bad_turn, mems).passed
