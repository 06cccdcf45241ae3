"""Fingerprints: the same values as the defining per-user BLAKE3 (a Python join), identical for discovery and
writes, stable across processes; per-user writes hold exactly each user's turns."""

import subprocess
import sys
from datetime import datetime, timedelta, timezone

import blake3
import polars as pl

from qumem_pipeline.ingest.discovery import discover
from qumem_pipeline.ingest.archive import (
    ArchiveConfig,
    fingerprint_user,
    load_archive,
    user_fingerprints,
    write_users,
)
from qumem_pipeline.storage.layout import DataLayout
from tests.conftest import conversation, write_jsonl

FIELDS = ["conversation_id", "session_id", "role", "speaker", "text", "timestamp", "source_ref"]


EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _field(value) -> str:
    if value is None:
        return "\u2400"
    if isinstance(value, datetime):  # microseconds since the epoch
        return str((value - EPOCH) // timedelta(microseconds=1))
    return str(value)


def reference_fingerprint(turns: pl.DataFrame) -> str:
    """The fingerprint's definition in plain Python (lines joined, BLAKE3), kept here as the oracle."""
    if turns.height == 0:
        return blake3.blake3(b"").hexdigest()
    lines = ["\x1f".join([str(r["turn_index"])] + [_field(r[c]) for c in FIELDS])
             for r in turns.sort("turn_index").iter_rows(named=True)]
    return blake3.blake3("\x1e".join(lines).encode("utf-8")).hexdigest()


def archive(tmp_path):
    rows = []
    for u, n in (("alice", 5), ("bob", 1), ("chen", 3)):
        rows += conversation(u, f"{u}-c1", [f"{u} says {i} — ünïcode ✓" for i in range(n)])
    rows[1]["speaker"] = None  # nulls take part in the fingerprint too
    rows.append({"user_id": "dora", "conversation_id": "d1", "role": "robot", "text": "only a bad row"})
    return write_jsonl(tmp_path / "a.jsonl", rows[::-1])  # reversed: file order is not history order


def test_fingerprints_equal_reference_and_discovery_equals_writes(tmp_path):
    cfg = ArchiveConfig(str(archive(tmp_path)))
    res = load_archive(cfg)
    fps = user_fingerprints(res.turns)
    assert set(fps) == {"alice", "bob", "chen"}
    for u, fp in fps.items():
        assert fp == reference_fingerprint(res.turns.filter(pl.col("user_id") == u))
    # Any row order gives the same value.
    assert user_fingerprints(res.turns.sample(fraction=1.0, shuffle=True, seed=1)) == fps
    layout = DataLayout(tmp_path / "data")
    stats = write_users(layout, res, ["alice", "bob", "chen", "dora"])
    assert {u: s["fingerprint"] for u, s in stats.items() if u != "dora"} == fps
    assert discover(cfg, known={}).fingerprints == fps
    stored = layout.read_table("fingerprints")
    assert dict(stored.select("user_id", "fingerprint").iter_rows()) == {**fps, "dora": blake3.blake3(b"").hexdigest()}
    # Each user's partition holds exactly that user's turns, in history order.
    for u in ("alice", "bob", "chen"):
        written = layout.read_user_table("turns", u)
        expected = res.turns.filter(pl.col("user_id") == u).sort("turn_index")
        assert written.equals(expected)
    assert layout.read_user_table("turns", "dora").height == 0
    assert layout.read_user_table("quarantine", "dora")["field"].to_list() == ["role"]


def test_changed_turn_changes_only_that_users_fingerprint(tmp_path):
    res = load_archive(ArchiveConfig(str(archive(tmp_path))))
    before = user_fingerprints(res.turns)
    edited = res.turns.with_columns(
        text=pl.when((pl.col("user_id") == "chen") & (pl.col("turn_index") == 2)).then(pl.lit("edited")).otherwise(pl.col("text"))
    )
    after = user_fingerprints(edited)
    assert after["chen"] != before["chen"] and {u: after[u] for u in ("alice", "bob")} == {u: before[u] for u in ("alice", "bob")}


def test_fingerprint_stable_across_processes(tmp_path):
    path = archive(tmp_path)
    code = (
        "import json,sys; from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive, user_fingerprints;"
        f"print(json.dumps(user_fingerprints(load_archive(ArchiveConfig({str(path)!r})).turns)))"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)}
    here = user_fingerprints(load_archive(ArchiveConfig(str(path))).turns)
    assert len(outs) == 1 and __import__("json").loads(outs.pop()) == here


def test_single_user_fingerprint_matches_reference_on_unsorted_frame(tmp_path):
    res = load_archive(ArchiveConfig(str(archive(tmp_path))))
    alice = res.turns.filter(pl.col("user_id") == "alice").reverse()
    assert fingerprint_user(alice) == reference_fingerprint(alice)


def test_fingerprints_across_row_blocks_equal_reference(tmp_path, monkeypatch):
    """Users are hashed in blocks of rows; a user larger than a block, and blocks holding several
    users, must give the same values as one user at a time."""
    from qumem_pipeline.ingest import archive as ingest

    res = load_archive(ArchiveConfig(str(archive(tmp_path))))
    expected = {u: reference_fingerprint(res.turns.filter(pl.col("user_id") == u)) for u in ("alice", "bob", "chen")}
    for block in (1, 2, 4, 6, 1 << 17):
        monkeypatch.setattr(ingest, "_FINGERPRINT_BLOCK_ROWS", block)
        assert user_fingerprints(res.turns) == expected, block
        assert {u: s["fingerprint"] for u, s in write_users(DataLayout(tmp_path / f"d{block}"), res, list(expected)).items()} == expected
        # A run writing some users hashes (and records) those users only.
        assert ingest.UserRuns(res.turns).fingerprints(["chen", "alice"]) == {u: expected[u] for u in ("alice", "chen")}
        assert write_users(DataLayout(tmp_path / f"s{block}"), res, ["bob"])["bob"]["fingerprint"] == expected["bob"]
