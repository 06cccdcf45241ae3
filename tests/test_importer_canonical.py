"""Canonical JSONL: the fast path (one polars read) and the line-by-line path give the same table."""

import json
import random

import pytest
from polars.testing import assert_frame_equal

from qumem_pipeline.ingest.importers.canonical import _import_jsonl_lines, import_jsonl_file
from tests.conftest import conversation, write_jsonl


def both_paths(path):
    """(fast path result, line-by-line result) for one file."""
    return import_jsonl_file(path), _import_jsonl_lines(path, path.read_bytes())


def assert_same(fast, slow):
    assert_frame_equal(fast.raw, slow.raw)
    assert fast.failures == slow.failures


def test_plain_file_same_table_and_line_numbers(tmp_path):
    rows = conversation("alice", "c1", ["hi", "there", "again"]) + conversation("bob", "c2", ["x"], turn_index=3)
    fast, slow = both_paths(write_jsonl(tmp_path / "a.jsonl", rows))
    assert_same(fast, slow)
    assert fast.raw["source_row"].to_list() == [1, 2, 3, 4]
    assert fast.raw["source_file"].unique().to_list() == [str(tmp_path / "a.jsonl")]


def test_blank_lines_and_no_final_newline_keep_true_line_numbers(tmp_path):
    rows = [json.dumps(r).encode() for r in conversation("alice", "c1", ["a", "b", "c"])]
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n" + rows[0] + b"\n  \t\r\n" + rows[1] + b"\n\n" + rows[2])  # last line unterminated
    fast, slow = both_paths(path)
    assert_same(fast, slow)
    assert fast.raw["source_row"].to_list() == [2, 4, 6]


def test_non_string_values_in_string_fields_match_the_line_path(tmp_path, monkeypatch):
    """polars would turn these into text silently; the fast path must quarantine/format them as the line path does."""
    rng = random.Random(0)
    floats = [rng.uniform(-1e15, 1e15) for _ in range(20)] + [1.0, 1e5, -0.0, 0.1, 1.5e-7, 1e300, 123.456]
    odd = [{"nested": 1}, [1, "x"], True, False, 7, -3, 2**70] + floats
    rows = []
    for i, v in enumerate(odd):
        field = ("source_ref", "text", "speaker", "session_id")[i % 4]
        rows.append(dict(conversation("alice", "c1", ["ok"])[0], **{field: v}, source_ref=f"r{i}") if field != "source_ref"
                    else dict(conversation("alice", "c1", ["ok"])[0], source_ref=v))
    # Legit strings that merely look like JSON values stay exactly as written.
    rows += [dict(conversation("alice", "c1", [t])[0], source_ref=f"s{i}") for i, t in enumerate(["[laughs] ok", "{curly}", "true", "3.50", "-0", "12345678901234567890"])]
    rows += conversation("alice", "c9", ["plain", "rows"])
    path = write_jsonl(tmp_path / "odd.jsonl", rows)
    slow = _import_jsonl_lines(path, path.read_bytes())

    def whole_file_fallback(*a):
        raise AssertionError("the fast path should re-read only the suspect lines, not fall back")

    monkeypatch.setattr("qumem_pipeline.ingest.importers.canonical._import_jsonl_lines", whole_file_fallback)
    fast = import_jsonl_file(path)
    assert_same(fast, slow)
    reasons = {f.source_row: f.reason for f in fast.failures}
    assert "expected a string, got dict" in reasons[1] and "got list" in reasons[2] and "got bool" in reasons[3]
    texts = fast.raw["text"].to_list()
    assert ["[laughs] ok", "{curly}", "true", "3.50", "-0", "12345678901234567890"] == texts[-8:-2]


def test_duplicate_key_keeps_first_value_on_both_paths(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_bytes(b'{"user_id": "alice", "conversation_id": "c1", "role": "user", "text": "first", "text": "second"}\n')
    fast, slow = both_paths(path)
    assert_same(fast, slow)
    assert fast.raw["text"].to_list() == ["first"]


def test_broken_line_falls_back_and_keeps_good_lines(tmp_path):
    rows = conversation("alice", "c1", ["a", "b"]) + [b'{"user_id": "alice", "text": "trunc']
    res = import_jsonl_file(write_jsonl(tmp_path / "broken.jsonl", rows))
    assert res.raw["text"].to_list() == ["a", "b"]
    assert [(f.source_row, f.field) for f in res.failures] == [(3, "(line)")]


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_empty_files(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    fast, slow = both_paths(path)
    assert fast.raw.height == slow.raw.height == 0 and not fast.failures
