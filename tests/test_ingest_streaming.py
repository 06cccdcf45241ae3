"""The bounded-memory reader: files read in blocks much smaller than themselves give exactly the
rows and quarantine of today's whole-file path (the fuzz corpus compares the same way:
tests/test_fuzz_importers.py)."""

import json
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pytest

from qumem_pipeline.ingest import stream
from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive
from qumem_pipeline.ingest.importers import import_archive
from qumem_pipeline.ingest.sync import sync_archive, validate_streamed
from qumem_pipeline.ingest.validate import StrictValidationError, validate
from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir
from qumem_pipeline.storage.layout import DataLayout

ARCHIVE = Path(__file__).resolve().parent.parent / "examples" / "archive"
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
Q_ORDER = ["source_file", "source_row", "field", "reason", "raw"]


def assert_same_as_whole_file(old, new, drop=()):
    """Turns equal row for row (the old columns); quarantine equal as a set of rows."""
    assert new.turns.select(old.turns.columns).equals(old.turns)
    order = [c for c in Q_ORDER if c not in drop]
    assert new.quarantine.drop(*drop).sort(order, nulls_last=True).equals(old.quarantine.drop(*drop).sort(order, nulls_last=True))


@pytest.mark.parametrize("chunk_bytes", [1, 97, 4096])
def test_example_archive_streamed_in_tiny_blocks_equals_whole_file_path(chunk_bytes):
    old = validate(import_archive(ARCHIVE), now=NOW)
    sizes = []
    orig = stream._jsonl_batches

    def spy(path, chunk, hasher=None):
        for b in orig(path, chunk, hasher):
            sizes.append(b.raw.height + len(b.failures))
            yield b

    stream._jsonl_batches, saved = spy, stream._jsonl_batches
    try:
        new = validate_streamed(str(ARCHIVE), chunk_bytes=chunk_bytes, now=NOW, reader="blocks")
    finally:
        stream._jsonl_batches = saved
    assert_same_as_whole_file(old, new)
    total = sum(f.stat().st_size for f in ARCHIVE.glob("*.jsonl"))
    assert len(sizes) > 3 and chunk_bytes < total  # many blocks, each far smaller than the archive
    if chunk_bytes == 1:
        assert max(sizes) == 1  # a block of one byte holds at most the one line it completes


def test_sync_into_tables_equals_load_archive_and_bounded_buckets(tmp_path):
    """The full sync (tiny blocks, tiny buckets: every user's rows spilled and merged by bucket)."""
    cfg = ArchiveConfig(str(ARCHIVE))
    old = load_archive(cfg)
    layout = DataLayout(tmp_path / "data")
    report = sync_archive(cfg, layout, chunk_bytes=200, bucket_bytes=1000, reader="blocks")
    assert report.files_read == 3 and report.users_rebuilt == 4
    turns = layout.read_table("turns")
    assert turns.height == 196
    assert turns.select(old.turns.columns).sort("user_id", "turn_index").equals(old.turns.sort("user_id", "turn_index"))
    q = layout.read_table("quarantine")
    assert q.height == 10
    assert q.sort(Q_ORDER).equals(old.quarantine.sort(Q_ORDER))
    # provenance: every turn names its file (relative id), row and position
    assert set(turns["source_file_id"].unique()) == {"2024-q1.jsonl", "2024-q2.jsonl", "2024-q3.jsonl"}
    assert turns["source_row"].min() >= 1 and turns["source_pos"].min() >= 0


def test_a_line_longer_than_a_block_is_read_whole(tmp_path):
    ok = {"user_id": "alice", "conversation_id": "c1", "role": "user", "text": "hello"}
    path = tmp_path / "big.jsonl"
    rows = [ok, dict(ok, text="é" * 200_000, source_ref="big"), dict(ok, text="bye", source_ref="b")]
    path.write_bytes(b"\n".join(json.dumps(r, ensure_ascii=False).encode() for r in rows))  # no final newline
    old = validate(import_archive(path), now=NOW)
    for reader in ("auto", "blocks"):
        new = validate_streamed(str(path), chunk_bytes=1 << 10, now=NOW, reader=reader)
        assert_same_as_whole_file(old, new)
    assert new.quarantine.height == 1 and new.quarantine["source_row"][0] == 2


def test_parquet_in_record_batches_equals_whole_file(tmp_path):
    rows = [{"user_id": f"u{i % 3}", "conversation_id": "c", "role": "user" if i % 2 else "assistant",
             "text": f"t{i}" if i != 7 else " ", "turn_index": None if i % 5 else i, "timestamp": "2024-01-01T00:00:00Z"}
            for i in range(40)]
    pl.DataFrame(rows).write_parquet(tmp_path / "a.parquet", row_group_size=8)
    (tmp_path / "b.parquet").write_bytes(b"PAR1 not really")
    old = validate(import_archive(tmp_path), now=NOW)
    new = validate_streamed(str(tmp_path), batch_rows=3, now=NOW)
    assert_same_as_whole_file(old, new, drop=("reason",))  # pyarrow words the broken file's reason differently
    assert "Parquet" in new.quarantine.filter(pl.col("field") == "(file)")["reason"][0]


def test_strict_streaming_fails_naming_file_row_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"user_id": "alice", "conversation_id": "c", "role": "user", "text": "hi"}\n'
                    '{"user_id": "alice", "conversation_id": "c", "role": "robot", "text": "x"}\n')
    with pytest.raises(StrictValidationError, match=r"a\.jsonl:2 field role"):
        validate_streamed(str(path), chunk_bytes=16, strict=True)
    layout = DataLayout(tmp_path / "data")
    with pytest.raises(StrictValidationError, match=r"a\.jsonl:2 field role"):
        sync_archive(ArchiveConfig(str(path), strict=True), layout, chunk_bytes=16)
    assert layout.read_table("turns") is None  # nothing published


def test_locomo_and_chatgpt_files_are_read_whole_per_file():
    locomo = shared_datasets_dir() / "locomo"
    candidates = sorted(locomo.glob("locomo_dev*.json")) if locomo.is_dir() else []
    if not candidates:
        pytest.skip(f"no LoCoMo dev file (locomo_dev*.json) in {locomo} (set {ENV_VAR})")
    path = candidates[0]
    old = validate(import_archive(path, "locomo"), now=NOW)
    new = validate_streamed(str(path), "locomo", now=NOW)
    assert_same_as_whole_file(old, new)


def test_fast_scan_gives_up_part_way_and_blocks_take_over(tmp_path):
    """Clean lines, then a blank line and a broken one: the scan's rows are not the file's lines,
    so its batches are dropped (RESTART) and the block reader's rows replace them, once each."""
    good = [{"user_id": f"u{i % 7}", "conversation_id": "c", "role": "user", "text": f"line {i}", "source_ref": f"r{i}"}
            for i in range(5000)]
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\n".join([json.dumps(r).encode() for r in good] + [b"", json.dumps(good[0] | {"source_ref": "x"}).encode()]) + b"\n")
    kinds = [b if b is stream.RESTART else "batch" for b in stream.read_batches(path, "jsonl")]
    assert stream.RESTART in kinds and kinds.index(stream.RESTART) > 0
    old = validate(import_archive(path), now=NOW)
    new = validate_streamed(str(path), now=NOW)
    assert_same_as_whole_file(old, new)
    assert new.turns.height == 5001 and new.turns["source_file"].n_unique() == 1
    layout = DataLayout(tmp_path / "data")
    sync_archive(ArchiveConfig(str(path)), layout, now=NOW, bucket_bytes=50_000)  # spilled, dropped, redone
    assert layout.read_table("turns").height == 5001
