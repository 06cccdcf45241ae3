"""The example archive: structure, users, and the planted bad lines (see examples/archive/README.md).

Reads the files with plain Python so it does not depend on any importer; the parse-level bad lines
(not JSON, not UTF-8, not an object) are checked here, the rest are left to validation's tests.
"""

import json
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

import pytest

from qumem_pipeline.contracts.ids import is_valid_user_id

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ARCHIVE = EXAMPLES / "archive"
FILES = ["2024-q1.jsonl", "2024-q2.jsonl", "2024-q3.jsonl"]
LINES = {"2024-q1.jsonl": 101, "2024-q2.jsonl": 60, "2024-q3.jsonl": 45}
USERS = {"alice": 60, "bob": 42, "chen": 44, "dana": 50}
KEYS = {"user_id", "conversation_id", "session_id", "turn_index", "role", "speaker", "text", "timestamp", "source_ref"}

# (file, line) -> what is planted there (README table)
PARSE_LEVEL = {
    ("2024-q1.jsonl", 45): "not an object",
    ("2024-q3.jsonl", 5): "invalid JSON",
    ("2024-q3.jsonl", 37): "invalid UTF-8",
}
ROW_LEVEL = {
    ("2024-q1.jsonl", 7): "role",
    ("2024-q1.jsonl", 28): "text",  # missing
    ("2024-q2.jsonl", 5): "user_id",
    ("2024-q2.jsonl", 18): "text",  # whitespace only
    ("2024-q2.jsonl", 33): "duplicate",
    ("2024-q2.jsonl", 52): "timestamp",
    ("2024-q3.jsonl", 12): "oversize",
}


def _read(name):
    """[(line number, bytes, parsed object or an exception)] for every non-blank line."""
    out = []
    for n, line in enumerate((ARCHIVE / name).read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            obj = e
        out.append((n, line, obj))
    return out


@pytest.fixture(scope="module")
def lines():
    return {name: _read(name) for name in FILES}


def test_files_and_line_counts(lines):
    assert sorted(p.name for p in ARCHIVE.glob("*.jsonl")) == FILES
    for name in FILES:
        assert len(lines[name]) == LINES[name]
        assert (ARCHIVE / name).read_bytes().endswith(b"\n")


def test_parse_level_bad_lines(lines):
    found = {}
    for name, rows in lines.items():
        for n, raw, obj in rows:
            if isinstance(obj, UnicodeDecodeError):
                found[(name, n)] = "invalid UTF-8"
            elif isinstance(obj, json.JSONDecodeError):
                found[(name, n)] = "invalid JSON"
            elif not isinstance(obj, dict):
                found[(name, n)] = "not an object"
    assert found == PARSE_LEVEL
    raw = dict(((name, n), r) for name, rows in lines.items() for n, r, _ in rows)
    assert b"caf\xe9 " in raw[("2024-q3.jsonl", 37)]
    assert raw[("2024-q3.jsonl", 5)].startswith(b'{"user_id": "dana"')


def _records(lines):
    for name, rows in lines.items():
        for n, _, obj in rows:
            if isinstance(obj, dict):
                yield name, n, obj


def test_row_level_bad_rows_are_where_the_readme_says(lines):
    recs = {(name, n): obj for name, n, obj in _records(lines)}
    assert recs[("2024-q1.jsonl", 7)]["role"] == "robot"
    assert "text" not in recs[("2024-q1.jsonl", 28)]
    assert recs[("2024-q2.jsonl", 5)]["user_id"] == "../etc"
    assert not is_valid_user_id(recs[("2024-q2.jsonl", 5)]["user_id"])
    assert recs[("2024-q2.jsonl", 18)]["text"].strip() == ""
    assert recs[("2024-q2.jsonl", 33)] == recs[("2024-q2.jsonl", 29)]
    assert recs[("2024-q2.jsonl", 33)]["turn_index"] == 24
    assert recs[("2024-q2.jsonl", 52)]["timestamp"] == "sometime in June"
    assert len(recs[("2024-q3.jsonl", 12)]["text"]) == 100_100
    # bad rows carry no turn_index (except the duplicate), so valid rows stay dense
    for key in ROW_LEVEL:
        if ROW_LEVEL[key] != "duplicate":
            assert "turn_index" not in recs[key]


def test_valid_rows_users_histories_and_preferences(lines):
    bad = set(ROW_LEVEL) | set(PARSE_LEVEL)
    valid = [(name, n, o) for name, n, o in _records(lines) if (name, n) not in bad]
    assert len(valid) == sum(USERS.values()) == 196
    by_user = defaultdict(list)
    for _, _, o in valid:
        assert set(o) == KEYS
        assert o["role"] in ("user", "assistant")
        assert o["text"].strip() and len(o["text"]) < 5_000
        assert o["timestamp"].endswith("Z")
        datetime.fromisoformat(o["timestamp"].replace("Z", "+00:00"))
        by_user[o["user_id"]].append(o)
    assert {u: len(v) for u, v in by_user.items()} == USERS
    for uid, hist in by_user.items():
        assert is_valid_user_id(uid)
        hist.sort(key=lambda o: o["turn_index"])
        assert [o["turn_index"] for o in hist] == list(range(len(hist)))
        stamps = [o["timestamp"] for o in hist]
        assert stamps == sorted(stamps)
        # strictly alternating user / assistant, starting with the user
        assert [o["role"] for o in hist] == ["user", "assistant"] * (len(hist) // 2)
        sessions = Counter(o["session_id"] for o in hist)
        assert 3 <= len(sessions) <= 5
        months = {o["timestamp"][:7] for o in hist}
        assert len(months) >= 3
        assert len(Counter((o["conversation_id"], o["source_ref"]) for o in hist)) == len(hist)
    text = {u: " ".join(o["text"] for o in h) for u, h in by_user.items()}
    # preference changes are stated with their reason
    assert "vegan" in text["alice"] and "window seat" in text["alice"] and "cholesterol" in text["alice"]
    assert "swimming" in text["bob"] and "tendinopathy" in text["bob"]
    assert "project-based" in text["chen"] and "Montreal" in text["chen"]
    assert "green tea" in text["dana"] and "switching from Python to R" in text["dana"]


def test_every_user_spans_files(lines):
    files_per_user = defaultdict(set)
    for name, _, o in _records(lines):
        files_per_user[o["user_id"]].add(name)
    for uid in USERS:
        assert len(files_per_user[uid]) >= 2


def test_queries():
    qs = [json.loads(line) for line in (EXAMPLES / "queries.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    assert 8 <= len(qs) <= 15
    assert len({q["query_id"] for q in qs}) == len(qs)
    for q in qs:
        assert {"query_id", "user_id", "query", "as_of"} <= set(q)
        assert q["user_id"] in USERS
        datetime.fromisoformat(q["as_of"].replace("Z", "+00:00"))
    # the same query asked before and after a preference change
    pairs = Counter((q["user_id"], q["query"]) for q in qs)
    assert sum(1 for n in pairs.values() if n >= 2) >= 4


def test_readme_documents_every_planted_line():
    readme = (ARCHIVE / "README.md").read_text(encoding="utf-8")
    for name, n in list(PARSE_LEVEL) + list(ROW_LEVEL):
        assert f"`{name}:{n}`" in readme


def test_detect_format_on_archive(tmp_path):
    from qumem_pipeline.ingest.importers import detect_format

    assert detect_format(ARCHIVE) == "jsonl"
    assert detect_format(ARCHIVE / "2024-q1.jsonl") == "jsonl"
    assert detect_format(str(ARCHIVE / "*.jsonl")) == "jsonl"
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    assert detect_format(tmp_path / "t.parquet") == "parquet"
    (tmp_path / "odd.json").write_text('{"hello": 1}', encoding="utf-8")
    with pytest.raises(ValueError):
        detect_format(tmp_path / "odd.json")


def test_archive_through_import_and_validation():
    """End to end with the canonical importer and validator: exactly the planted lines are quarantined."""
    pytest.importorskip("qumem_pipeline.ingest.importers.canonical")
    validate_mod = pytest.importorskip("qumem_pipeline.ingest.validate")
    from qumem_pipeline.ingest.importers import import_archive

    res = import_archive(ARCHIVE)
    assert {(Path(f.source_file).name, f.source_row) for f in res.failures} == set(PARSE_LEVEL)
    v = validate_mod.validate(res)
    q = {(Path(f).name, r) for f, r in v.quarantine.select("source_file", "source_row").iter_rows()}
    assert q == set(PARSE_LEVEL) | set(ROW_LEVEL)
    assert v.turns.height == sum(USERS.values())
    assert dict(v.turns.group_by("user_id").len().iter_rows()) == USERS
