"""Per-file incremental ingest: each archive file read once; changed files' rows replaced, gone
files' rows deleted, and the tables always equal what a one-shot read of the current archive
gives (the whole-file path is the oracle), turn_index included."""

import builtins
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pytest

from qumem_pipeline.ingest import stream, sync
from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive, user_fingerprints
from qumem_pipeline.ingest.discovery import discover
from qumem_pipeline.ingest.sync import sync_archive
from qumem_pipeline.storage.forget import ForgetRegistry
from qumem_pipeline.storage.layout import DataLayout
from tests.conftest import conversation, write_jsonl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "archive"
Q_ORDER = ["source_file", "source_row", "field", "reason", "raw"]


@pytest.fixture
def archive(tmp_path):
    d = tmp_path / "archive"
    shutil.copytree(EXAMPLE, d, ignore=shutil.ignore_patterns("*.md"))
    return d


def assert_tables_equal_one_shot(layout, path, forgotten=None, compare_raw=True):
    oracle = load_archive(ArchiveConfig(str(path)), forgotten=forgotten)
    turns = layout.read_table("turns")
    cols = oracle.turns.columns
    got = turns.select(cols).sort("user_id", "turn_index") if turns is not None else oracle.turns.clear()
    assert got.equals(oracle.turns.sort("user_id", "turn_index"))
    q = layout.read_table("quarantine")
    keys = Q_ORDER if compare_raw else Q_ORDER[:-1]
    got_q = q.select(keys).sort(keys, nulls_last=True) if q is not None else oracle.quarantine.select(keys).clear()
    assert got_q.equals(oracle.quarantine.select(keys).sort(keys, nulls_last=True))
    # fingerprints come from the tables and equal the in-memory ones
    assert sync.stored_fingerprints(layout, forgotten) == user_fingerprints(oracle.turns)
    return oracle


class NoArchiveReads:
    """Fail any Python-level open of a file under the archive (and count the reader's opens)."""

    def __init__(self, monkeypatch, root: Path):
        root = str(root.resolve())

        def guard(real):
            def guarded(file, *a, **kw):
                if isinstance(file, (str, os.PathLike)) and str(Path(file).resolve()).startswith(root):
                    raise AssertionError(f"archive file opened: {file}")
                return real(file, *a, **kw)
            return guarded

        monkeypatch.setattr(builtins, "open", guard(builtins.open))
        for name in ("read_ndjson", "read_parquet", "scan_ndjson", "scan_parquet"):
            monkeypatch.setattr(pl, name, guard(getattr(pl, name)))


def test_rerun_over_unchanged_archive_reads_no_archive_file(archive, tmp_path, monkeypatch):
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    first = sync_archive(cfg, layout)
    assert first.files_read == 3
    before = {t: layout.read_table(t) for t in ("turns", "quarantine", "fingerprints")}
    stream.READS.clear()
    with monkeypatch.context() as m:
        NoArchiveReads(m, archive)
        again = sync_archive(cfg, layout)
        found = discover(cfg, {}, layout=layout)  # the sensor / schedule path
    assert (again.files_read, again.users_rebuilt, again.unchanged) == (0, 0, 3)
    assert not stream.READS
    assert len(found.fingerprints) == 4
    for t, df in before.items():
        assert layout.read_table(t).equals(df)


def test_touched_file_is_hashed_once_and_not_reingested(archive, tmp_path):
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    f = archive / "2024-q2.jsonl"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 5_000_000_000))
    stream.READS.clear()
    r = sync_archive(cfg, layout)
    assert (r.files_read, r.users_rebuilt, r.unchanged) == (0, 0, 3)
    assert dict(stream.READS) == {str(f): 1}  # the hash, nothing else
    stream.READS.clear()
    sync_archive(cfg, layout)
    assert not stream.READS  # the new mtime was recorded


def test_changed_file_rows_replaced_only_that_file_read(archive, tmp_path):
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    f = archive / "2024-q2.jsonl"
    lines = f.read_bytes().split(b"\n")
    f.write_bytes(b"\n".join(lines[:3] + [ln.replace(b'"text": "', b'"text": "EDITED ') for ln in lines[3:6]] + lines[7:]))
    stream.READS.clear()
    r = sync_archive(cfg, layout)
    assert r.changed == ["2024-q2.jsonl"] and r.files_read == 1
    assert set(stream.READS) == {str(f)}
    assert_tables_equal_one_shot(layout, archive)
    assert layout.read_table("turns")["text"].str.starts_with("EDITED").sum() >= 1


def test_removed_file_rows_deleted_without_reading_anything(archive, tmp_path, monkeypatch):
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    (archive / "2024-q3.jsonl").unlink()
    with monkeypatch.context() as m:
        NoArchiveReads(m, archive)
        r = sync_archive(cfg, layout)
    assert r.gone == ["2024-q3.jsonl"] and r.files_read == 0 and r.users_rebuilt >= 1
    turns = layout.read_table("turns")
    assert "2024-q3.jsonl" not in turns["source_file_id"].to_list()
    assert not layout.read_table("quarantine")["source_file"].str.ends_with("2024-q3.jsonl").any()
    assert_tables_equal_one_shot(layout, archive)
    assert "2024-q3.jsonl" not in set(sync.read_manifest(layout))


def _rows(user, conv, start_ts, texts, ref0=0):
    rows = conversation(user, conv, texts)
    for i, r in enumerate(rows):
        r["timestamp"] = f"2024-{start_ts}T10:{i:02d}:00Z"
        r["source_ref"] = f"{conv}-m{ref0 + i}"
    return rows


def test_later_file_appends_and_earlier_turn_index_stays(tmp_path):
    """The rule: history order is the whole-archive order (validate._finalise_turns) with files in
    path order; a later file's later turns append, so no earlier turn_index moves."""
    d = tmp_path / "archive"
    write_jsonl(d / "a.jsonl", _rows("alice", "c1", "01-01", ["a0", "a1", "a2"]) + _rows("bob", "b1", "01-01", ["b0", "b1"]))
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    before = dict(layout.read_table("turns").select(pl.concat_str("user_id", "text"), "turn_index").iter_rows())
    # a later file continues alice's conversation and starts a new one; bob is not in it
    write_jsonl(d / "b.jsonl", _rows("alice", "c1", "02-01", ["a3", "a4"], ref0=3) + _rows("alice", "c2", "03-01", ["a5"]))
    stream.READS.clear()
    r = sync_archive(cfg, layout)
    assert r.new == ["b.jsonl"] and set(stream.READS) == {str(d / "b.jsonl")}
    assert r.users_rebuilt == 1  # bob untouched
    turns = layout.read_table("turns")
    after = dict(turns.select(pl.concat_str("user_id", "text"), "turn_index").iter_rows())
    assert all(after[k] == v for k, v in before.items())  # every earlier turn keeps its index
    alice = turns.filter(pl.col("user_id") == "alice").sort("turn_index")
    assert alice["text"].to_list() == ["a0", "a1", "a2", "a3", "a4", "a5"]
    assert alice["source_file_id"].to_list() == ["a.jsonl"] * 3 + ["b.jsonl"] * 3
    assert_tables_equal_one_shot(layout, d)


@pytest.mark.parametrize("order", ["interleaved", "earlier_file_later"])
def test_turn_index_across_files_equals_one_shot_read(tmp_path, order):
    """Whatever the history-order rule says (explicit turn_index, time, file order), the
    incremental tables number turns exactly as one read of the whole archive does, including
    when a later file holds turns stamped between or before earlier ones."""
    d = tmp_path / "archive"
    a = _rows("alice", "c1", "01-01", ["x0", "x1", "x2", "x3"])
    b = _rows("alice", "c1", "01-01", ["y0", "y1"], ref0=10)
    if order == "interleaved":
        for i, r in enumerate(b):
            r["timestamp"] = f"2024-01-01T10:{i * 2 + 1:02d}:30Z"
    else:
        for i, r in enumerate(b):
            r["timestamp"] = f"2023-12-31T10:{i:02d}:00Z"
    b.append({"user_id": "alice", "conversation_id": "c9", "role": "user", "text": "no time", "source_ref": "n"})
    write_jsonl(d / "a.jsonl", a)
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    write_jsonl(d / "b.jsonl", b)
    sync_archive(cfg, layout)
    assert_tables_equal_one_shot(layout, d)
    fresh = DataLayout(tmp_path / "fresh")
    sync_archive(cfg, fresh)  # both files at once
    cols = ["user_id", "turn_index", "text", "source_file_id"]
    assert layout.read_table("turns").select(cols).sort(cols[:2]).equals(fresh.read_table("turns").select(cols).sort(cols[:2]))


def test_duplicate_in_later_file_becomes_valid_when_first_copy_goes(tmp_path):
    d = tmp_path / "archive"
    first = _rows("alice", "c1", "01-01", ["hello", "there"])
    dup = [dict(first[1], text="there (again)")]  # same conversation + source_ref: a later copy
    write_jsonl(d / "a.jsonl", first)
    write_jsonl(d / "b.jsonl", dup + _rows("alice", "c2", "02-01", ["more"]))
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    q = layout.read_table("quarantine")
    assert q["reason"].str.starts_with("duplicate turn id").sum() == 1
    assert_tables_equal_one_shot(layout, d)
    (d / "a.jsonl").unlink()
    r = sync_archive(cfg, layout)
    assert r.files_read == 0
    assert "there (again)" in layout.read_table("turns")["text"].to_list()
    assert_tables_equal_one_shot(layout, d)
    # and back: the first copy returns, the later one is a duplicate again
    write_jsonl(d / "a.jsonl", first)
    sync_archive(cfg, layout)
    assert_tables_equal_one_shot(layout, d, compare_raw=False)  # raw of a re-held row is rebuilt from the table


def test_killed_run_is_finished_by_the_next(archive, tmp_path, monkeypatch):
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    real = sync.replace_users
    calls = {"n": 0}

    def dying(layout_, table, users, df, dense=False):
        calls["n"] += 1
        if calls["n"] == 7:  # second bucket, its first table
            raise KeyboardInterrupt("killed")
        return real(layout_, table, users, df, dense)

    monkeypatch.setattr(sync, "replace_users", dying)
    with pytest.raises(KeyboardInterrupt):
        sync_archive(cfg, layout, bucket_bytes=20_000)  # several buckets
    monkeypatch.setattr(sync, "replace_users", real)
    assert {r["ingest_version"] for r in sync.read_manifest(layout).values()} == {"pending"}
    r = sync_archive(cfg, layout, bucket_bytes=20_000)
    assert r.files_read == 3
    assert_tables_equal_one_shot(layout, archive)


def test_a_failed_table_write_leaves_no_fingerprint_and_no_write_in_flight(archive, tmp_path, monkeypatch):
    """The data tables are written at once on threads: one failing must not let the fingerprints (which
    vouch for the turns) be written, nor leave another table's write running after the sync has raised
    and released the root's lock; the next sync finishes the users."""
    import threading
    import time

    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    real = sync.replace_users
    ended: dict[str, float] = {}
    lock = threading.Lock()

    def flaky(layout_, table, users, df, dense=False):
        if table == "quarantine":
            raise RuntimeError("quarantine write failed")
        if table == "turns":
            time.sleep(0.5)  # still writing when the quarantine write has failed
        out = real(layout_, table, users, df, dense)
        with lock:
            ended[table] = time.monotonic()
        return out

    monkeypatch.setattr(sync, "replace_users", flaky)
    with pytest.raises(RuntimeError, match="quarantine write failed"):
        sync_archive(cfg, layout)
    raised = time.monotonic()
    monkeypatch.setattr(sync, "replace_users", real)
    assert "turns" in ended and ended["turns"] <= raised  # the slow write ended before the sync raised
    assert "fingerprints" not in ended
    fps = layout.read_table("fingerprints")
    assert fps is None or fps.height == 0
    assert {r["ingest_version"] for r in sync.read_manifest(layout).values()} == {"pending"}
    r = sync_archive(cfg, layout)
    assert r.files_read == 3
    assert_tables_equal_one_shot(layout, archive)


def test_forgotten_user_never_ingested(archive, tmp_path):
    data = tmp_path / "data"
    reg = ForgetRegistry(data)
    reg.add("alice")
    layout = DataLayout(data)
    sync_archive(ArchiveConfig(str(archive)), layout, forgotten=reg)
    assert "alice" not in layout.read_table("turns")["user_id"].to_list()
    assert "alice" not in (layout.read_table(sync.FILE_USERS_TABLE)["user_id"].to_list())
    assert_tables_equal_one_shot(layout, archive, forgotten=reg)


def test_data_root_written_before_the_manifest_is_reingested_cleanly(archive, tmp_path):
    """A root written by the whole-archive path (no provenance columns, no manifest): the first
    sync reads every file and replaces those rows."""
    from qumem_pipeline.ingest.archive import write_unattributed_quarantine, write_users

    layout = DataLayout(tmp_path / "data")
    res = load_archive(ArchiveConfig(str(archive)))
    write_users(layout, res, sorted(res.turns["user_id"].unique().to_list()))
    write_unattributed_quarantine(layout, res)
    r = sync_archive(ArchiveConfig(str(archive)), layout)
    assert r.files_read == 3
    assert_tables_equal_one_shot(layout, archive)


def _time_first_finalise(good: pl.DataFrame) -> pl.DataFrame:
    """The as-of rule of issue 16 (explicit turn_index, then timestamp, then file order), written
    out here so the incremental path is shown to follow whichever order validate defines."""
    from qumem_pipeline.ingest import validate as v

    ordered = good.sort(["user_id", "turn_index", "_ts", "source_file", "source_row", "_pos"], nulls_last=True)
    return ordered.select(
        user_id=pl.col("user_id"), conversation_id=pl.col("conversation_id"),
        session_id=pl.coalesce(pl.col("session_id"), pl.col("conversation_id")),
        turn_index=(pl.int_range(pl.len()).over("user_id")).cast(pl.Int64),
        role=pl.col("role"), speaker=pl.col("speaker"), text=pl.col("text"), timestamp=pl.col("_ts"),
        source_ref=pl.col("source_ref"), source_file=pl.col("source_file"), code_version=pl.lit(v.stage_version("turns")),
        *[pl.col(c).alias(c[len(v.KEEP_PREFIX):]) for c in good.columns if c.startswith(v.KEEP_PREFIX)],
    ).cast(dict(v.TURN_POLARS_SCHEMA))


def test_time_first_order_across_files_incremental_equals_one_shot(tmp_path, monkeypatch):
    from qumem_pipeline.ingest import validate as v

    monkeypatch.setattr(v, "_finalise_turns", _time_first_finalise)
    d = tmp_path / "archive"
    a = _rows("alice", "c1", "01-01", ["x0", "x1", "x2"])
    write_jsonl(d / "b.jsonl", a)  # the later path holds the earlier turns
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    before = dict(layout.read_table("turns").select("text", "turn_index").iter_rows())
    later = _rows("alice", "c1", "02-01", ["y0", "y1"], ref0=5)
    write_jsonl(d / "a.jsonl", later)  # sorts first by path, but its turns are later in time
    sync_archive(cfg, layout)
    turns = layout.read_table("turns").sort("turn_index")
    assert turns["text"].to_list() == ["x0", "x1", "x2", "y0", "y1"]  # time first: appended
    assert all(dict(turns.select("text", "turn_index").iter_rows())[k] == i for k, i in before.items())
    assert_tables_equal_one_shot(layout, d)


def test_small_new_file_touching_long_histories_merges_in_groups(archive, tmp_path, monkeypatch):
    """One bucket of new rows, but the users' stored histories are cut into groups under the
    merge budget; the result is the one-shot result."""
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    users = sorted(layout.users_in("turns"))
    write_jsonl(archive / "2024-q4.jsonl", [r for u in users for r in _rows(u, f"{u}-late", "11-01", ["late 1", "late 2"])])
    seen = []
    real = sync._Sync._rebuild
    monkeypatch.setattr(sync._Sync, "_rebuild", lambda self, us, st, q: (seen.append(list(us)), real(self, us, st, q)))
    r = sync_archive(cfg, layout, bucket_bytes=sync._STORED_ROW_BYTES * 60)  # ~60 stored rows per group
    assert r.files_read == 1 and r.users_rebuilt == len(users)
    assert len(seen) > 1 and sorted(u for g in seen for u in g) == users
    assert_tables_equal_one_shot(layout, archive)


def test_failing_blocking_check_commits_nothing_and_the_next_sync_redoes(archive, tmp_path):
    cfg = ArchiveConfig(str(archive))
    layout = DataLayout(tmp_path / "data")

    def too_many_bad_rows(turns, quarantine):
        if quarantine.height > 0.01 * (turns.height + quarantine.height):
            raise ValueError(f"quarantine ceiling: {quarantine.height} bad rows")

    with pytest.raises(ValueError, match="quarantine ceiling"):
        sync_archive(cfg, layout, before_commit=too_many_bad_rows)
    assert layout.read_table("turns") is None and layout.read_table("fingerprints") is None
    r = sync_archive(cfg, layout)
    assert r.files_read == 3  # still pending: read again
    assert_tables_equal_one_shot(layout, archive)


def test_spill_groups_whole_store_buckets_one_file_per_partition(archive, tmp_path):
    """A spilled first sync merges whole store partitions per group: each partition of each table
    gets one data file, whatever the number of groups."""
    from deltalake import DeltaTable

    layout = DataLayout(tmp_path / "data", n_buckets=4)
    seen = []
    real = sync._Sync._rebuild

    def spy(self, us, st, q):
        seen.append(list(us))
        return real(self, us, st, q)

    sync._Sync._rebuild = spy
    try:
        size = sum(f.stat().st_size for f in archive.glob("*.jsonl"))
        r = sync_archive(ArchiveConfig(str(archive)), layout, bucket_bytes=size // 2)  # spilled, no bucket split
    finally:
        sync._Sync._rebuild = real
    assert len(seen) > 1 and r.users_rebuilt == sum(map(len, seen))
    for table in ("turns", "fingerprints", sync.FILE_USERS_TABLE):
        parts = [Path(f).parent.name for f in DeltaTable(layout.table_dir(table)).file_uris()]
        assert len(parts) == len(set(parts)), table  # one file per partition
    assert_tables_equal_one_shot(layout, archive)


def test_spilled_parts_leave_out_derived_columns_and_the_tables_keep_every_provenance_column(archive, tmp_path):
    """A spilled sync stores no column it can derive (the provenance copies, the file's id, the
    file's own path) and puts them back as the parts are taken: its tables equal, column for column
    and provenance included, those of the same sync held in memory."""
    from qumem_pipeline.ingest import staging

    spilled_columns = []
    real = staging.read_spilled

    def spy(path):
        df = real(path)
        spilled_columns.append(set(df.columns))
        return df

    staging.read_spilled = spy
    try:
        size = sum(f.stat().st_size for f in archive.glob("*.jsonl"))
        spilled = DataLayout(tmp_path / "spilled", n_buckets=4)
        r_spilled = sync_archive(ArchiveConfig(str(archive)), spilled, bucket_bytes=size // 3)
    finally:
        staging.read_spilled = real
    held = DataLayout(tmp_path / "held", n_buckets=4)
    r_held = sync_archive(ArchiveConfig(str(archive)), held)
    assert spilled_columns, "the small budget must spill"
    assert r_spilled.spilled_bytes > 0 and r_held.spilled_bytes == 0  # the scratch a sync wrote, reported
    derived = set(sync._Sync._DERIVED) | {"source_file"}
    assert all(not (cols & derived) and "_pos" in cols for cols in spilled_columns)
    for table in ("turns", "fingerprints", sync.FILE_USERS_TABLE):
        a = spilled.read_table(table)
        b = held.read_table(table)
        key = ["user_id", "turn_index"] if table == "turns" else sorted(a.columns)
        assert a.sort(key).equals(b.sort(key)), table
    turns = spilled.read_table("turns")
    assert set(turns["source_file"].unique()) == {str(p) for p in archive.glob("*.jsonl")}
    assert turns.select("source_file_id", "source_row", "source_pos").null_count().sum_horizontal().item() == 0


def test_later_turns_are_appended_without_rewriting_stored_files(tmp_path):
    """A new file that only adds later turns: the users' stored turn files stay in the table
    (an append commit), and the tables still equal a one-shot read."""
    from deltalake import DeltaTable

    d = tmp_path / "archive"
    write_jsonl(d / "a.jsonl", _rows("alice", "c1", "01-01", ["a0", "a1", "a2"]) + _rows("bob", "b1", "01-01", ["b0"]))
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    before = set(DeltaTable(layout.table_dir("turns")).file_uris())
    write_jsonl(d / "b.jsonl", _rows("alice", "c1", "02-01", ["a3"], ref0=3) + _rows("carol", "k1", "02-01", ["k0"]))
    sync_archive(cfg, layout)
    dt = DeltaTable(layout.table_dir("turns"))
    assert before <= set(dt.file_uris())  # nothing of the stored history was rewritten
    assert dt.history(1)[0]["operation"] in ("WRITE", "CREATE TABLE")
    assert_tables_equal_one_shot(layout, d)
    # a file that inserts a turn *before* stored ones (same time, earlier path) replaces: indices shift
    write_jsonl(d / "0.jsonl", _rows("alice", "c0", "01-01", ["z0"]))
    sync_archive(cfg, layout)
    alice = layout.read_table("turns", ["alice"]).sort("turn_index")
    assert alice["text"].to_list()[:2] == ["z0", "a0"]
    assert_tables_equal_one_shot(layout, d)


def _file_pairs(layout) -> set[tuple[str, str]]:
    df = layout.read_table(sync.FILE_USERS_TABLE)
    pairs = list(df.select("user_id", "file_id").iter_rows())
    assert len(pairs) == len(set(pairs)), "a (user, file) pair is listed twice"
    return set(pairs)


def test_new_files_only_append_file_lists_without_reading_them(tmp_path):
    """A sync that reads new files only (the nightly case) never reads the stored per-user file
    lists, and they still equal a one-shot ingest's: later turns, a user's first file, a duplicate
    of a stored turn and a bad row all in the new file."""
    d = tmp_path / "archive"
    write_jsonl(d / "a.jsonl", _rows("alice", "c1", "01-01", ["a0", "a1"]) + _rows("bob", "b1", "01-01", ["b0"]))
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    later = (_rows("alice", "c1", "02-01", ["a2"], ref0=2) + _rows("carol", "k1", "02-01", ["k0"])
             + _rows("bob", "b1", "01-01", ["b0"])  # a copy of bob's stored turn: a duplicate, listed for b.jsonl
             + [{"user_id": "dave", "conversation_id": "x", "role": "user"}])  # no text: quarantined
    write_jsonl(d / "b.jsonl", later)
    reads = []
    real = DataLayout.read_table

    def spy(self, table, *a, **k):
        reads.append(table)
        return real(self, table, *a, **k)

    DataLayout.read_table = spy
    try:
        r = sync_archive(cfg, layout)
    finally:
        DataLayout.read_table = real
    assert r.files_read == 1 and sync.FILE_USERS_TABLE not in reads and "turns" in reads
    assert_tables_equal_one_shot(layout, d)
    fresh = DataLayout(tmp_path / "fresh")
    sync_archive(cfg, fresh)
    got = _file_pairs(layout)
    assert got == _file_pairs(fresh)
    assert {u for u, _ in got} >= {"alice", "bob", "carol", "dave"}
    # a changed file takes the full path again (stored lists read, pairs of the old bytes gone)
    write_jsonl(d / "b.jsonl", _rows("alice", "c1", "02-01", ["a2"], ref0=2))
    sync_archive(cfg, layout)
    assert_tables_equal_one_shot(layout, d)
    fresh2 = DataLayout(tmp_path / "fresh2")
    sync_archive(cfg, fresh2)
    assert _file_pairs(layout) == _file_pairs(fresh2)


def test_unattributed_bad_rows_stand_through_new_files_and_leave_with_their_file(tmp_path):
    """Bad rows with no usable user id live under their own key. A sync of new files with none of
    them leaves the stored ones as they are without reading them (the nightly case); a new file's own
    go in beside them, and a gone file's leave with it: always what a one-shot read gives."""
    d = tmp_path / "archive"
    no_user = {"conversation_id": "x", "role": "user", "text": "who am I"}
    write_jsonl(d / "a.jsonl", _rows("alice", "c1", "01-01", ["a0"]) + [no_user])
    cfg = ArchiveConfig(str(d))
    layout = DataLayout(tmp_path / "data")
    sync_archive(cfg, layout)
    assert_tables_equal_one_shot(layout, d)
    write_jsonl(d / "b.jsonl", _rows("alice", "c1", "02-01", ["a1"], ref0=1))
    reads = []
    real = DataLayout.read_user_table

    def spy(self, table, user, *a, **k):
        reads.append((table, user))
        return real(self, table, user, *a, **k)

    DataLayout.read_user_table = spy
    try:
        sync_archive(cfg, layout)
    finally:
        DataLayout.read_user_table = real
    assert ("quarantine", sync.UNATTRIBUTED) not in reads
    assert_tables_equal_one_shot(layout, d)
    write_jsonl(d / "c.jsonl", [{**no_user, "user_id": ""}])
    sync_archive(cfg, layout)
    q = layout.read_table("quarantine")
    assert q.filter(pl.col("source_file").str.ends_with("a.jsonl")).height == 1
    assert q.filter(pl.col("source_file").str.ends_with("c.jsonl")).height == 1
    assert_tables_equal_one_shot(layout, d)
    (d / "a.jsonl").unlink()
    sync_archive(cfg, layout)
    assert_tables_equal_one_shot(layout, d)
    assert layout.read_table("quarantine").filter(pl.col("source_file").str.ends_with("a.jsonl")).height == 0
