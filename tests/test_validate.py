"""Every quarantine reason, exercised; valid rows of the same file always arrive."""

import json
from datetime import datetime, timezone

import polars as pl
import pytest

from qumem_pipeline.ingest.importers.canonical import import_canonical
from qumem_pipeline.ingest.validate import StrictValidationError, validate
from tests.conftest import conversation, write_jsonl

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def base(**kw):
    row = {"user_id": "alice", "conversation_id": "c1", "role": "user", "text": "hello", "timestamp": "2024-01-01T00:00:00Z"}
    row.update(kw)
    return row


@pytest.fixture
def bad_file(tmp_path):
    rows = [
        base(source_ref="ok-1"),
        base(source_ref="ok-2", role="assistant", text="hi there"),
        base(source_ref="m-missing-text", text=""),
        base(source_ref="m-null-text", text=None),
        base(source_ref="m-role", role="robot"),
        base(source_ref="m-ts", timestamp="yesterday-ish"),
        base(source_ref="m-future", timestamp="2999-01-01T00:00:00Z"),
        base(source_ref="ok-1", text="a duplicate of the first row's id"),
        base(source_ref="m-big", text="x" * 1001),
        base(user_id="../x", source_ref="m-uid"),
        base(user_id="a'; drop table turns; --", source_ref="m-uid2"),
        base(conversation_id=None, source_ref="m-conv"),
        b'{"user_id": "alice", "conversation_id": "c1", "role": "user", "text": "caf\xe9 latin-1"}',
        b'{"user_id": "alice", "conversation_id": "c1", "role": "us',
        b'[1, 2, 3]',
        json.dumps(base(source_ref="m-type", text={"nested": 1})).encode(),
        base(source_ref="ok-3", text="still valid after the bad ones"),
        base(user_id="bob", source_ref="b-1", turn_index=5),
        base(user_id="bob", source_ref="b-2", turn_index=5),
    ]
    return write_jsonl(tmp_path / "bad.jsonl", rows)


def test_every_reason_quarantined_and_valid_rows_arrive(bad_file):
    res = validate(import_canonical(bad_file), max_text_chars=1000, now=NOW)
    q = {r["source_row"]: (r["field"], r["reason"]) for r in res.quarantine.iter_rows(named=True)}
    assert q[3] == ("text", "missing text")
    assert q[4] == ("text", "missing text")
    assert q[5][0] == "role" and "robot" in q[5][1]
    assert q[6][0] == "timestamp" and "unparseable" in q[6][1]
    assert q[7][0] == "timestamp" and "future" in q[7][1]
    assert q[8][0] == "source_ref" and "duplicate turn id" in q[8][1]
    assert q[9][0] == "text" and "oversize" in q[9][1] and "1001" in q[9][1]
    assert q[10][0] == "user_id" and q[11][0] == "user_id"
    assert q[12][0] == "conversation_id"
    assert q[13][0] == "(line)" and "UTF-8" in q[13][1]
    assert q[14][0] == "(line)" and "invalid JSON" in q[14][1]
    assert q[15][0] == "(line)" and "JSON object" in q[15][1]
    assert q[16][0] == "text" and "expected a string" in q[16][1]
    assert q[19][0] == "turn_index" and "duplicate" in q[19][1]
    # The non-UTF-8 line is still attributed to its user and kept readable.
    non_utf8 = res.quarantine.filter(pl.col("source_row") == 13).row(0, named=True)
    assert non_utf8["user_id"] == "alice" and "\\xe9" in non_utf8["raw"]
    # Valid rows, including those after the bad ones, all arrive; nothing is lost.
    assert sorted(res.turns["source_ref"].to_list()) == ["b-1", "ok-1", "ok-2", "ok-3"]
    assert res.turns.height + res.quarantine.height == 19
    assert res.counts()["quarantined"] == 15


def test_strict_mode_fails_naming_row_and_field(bad_file):
    with pytest.raises(StrictValidationError, match=r"bad\.jsonl:\d+ field \w+"):
        validate(import_canonical(bad_file), max_text_chars=1000, strict=True, now=NOW)


def test_turn_index_dense_per_user_in_history_order(tmp_path):
    rows = conversation("alice", "c1", ["a", "b", "c"]) + conversation("bob", "c2", ["x", "y"])
    rows[0], rows[2] = rows[2], rows[0]  # explicit turn_index must win over file order
    for i, r in enumerate(rows):
        r["turn_index"] = {"c1-0": 0, "c1-1": 1, "c1-2": 2, "c2-0": 10, "c2-1": 20}[r["source_ref"]]
    res = validate(import_canonical(write_jsonl(tmp_path / "t.jsonl", rows)), now=NOW)
    alice = res.turns.filter(pl.col("user_id") == "alice")
    assert alice["turn_index"].to_list() == [0, 1, 2]
    assert alice["text"].to_list() == ["a", "b", "c"]
    assert res.turns.filter(pl.col("user_id") == "bob")["turn_index"].to_list() == [0, 1]


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("2024-05-01T12:30:00Z", datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)),
        ("2024-05-01T14:30:00+02:00", datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)),
        ("2024-05-01 12:30:00", datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)),
        ("2024-05-01", datetime(2024, 5, 1, tzinfo=timezone.utc)),
        ("1714566600", datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)),
        ("1714566600.5", datetime(2024, 5, 1, 12, 30, 0, 500000, tzinfo=timezone.utc)),
    ],
)
def test_timestamp_formats(tmp_path, raw, expected):
    res = validate(import_canonical(write_jsonl(tmp_path / "t.jsonl", [base(timestamp=raw)])), now=NOW)
    assert res.quarantine.height == 0
    assert res.turns["timestamp"][0] == expected


def test_parquet_input_and_bad_cast(tmp_path):
    df = pl.DataFrame(
        {
            "user_id": ["alice", "alice"],
            "conversation_id": ["c", "c"],
            "role": ["user", "assistant"],
            "text": ["hi", "hello"],
            "turn_index": ["0", "not-a-number"],
            "timestamp": [datetime(2024, 1, 1), datetime(2024, 1, 2)],
        }
    )
    p = tmp_path / "a.parquet"
    df.write_parquet(p)
    res = validate(import_canonical(p), now=NOW)
    assert res.turns.height == 1 and res.turns["text"][0] == "hi"
    assert res.quarantine.height == 1
    row = res.quarantine.row(0, named=True)
    assert row["field"] == "turn_index" and row["source_row"] == 2


def test_directory_and_glob(small_archive):
    by_dir = validate(import_canonical(small_archive), now=NOW)
    by_glob = validate(import_canonical(str(small_archive / "*.jsonl")), now=NOW)
    assert by_dir.turns.height == by_glob.turns.height == 12
    assert sorted(by_dir.turns["user_id"].unique().to_list()) == ["alice", "bob", "chen"]
