"""The store's add-only write path (storage/file_commit.py) on real Delta tables: which writes take
it, that its files are what delta-rs and its readers expect (partition layout, statistics,
row-group pruning, later deletes and rewrites by delta-rs), and that a writer killed between its
files and its commit leaves the previous version whole."""

import polars as pl
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from qumem_pipeline.contracts.buckets import user_bucket
from qumem_pipeline.storage import file_commit, table_store
from qumem_pipeline.storage.table_store import TableStore


def _rows(users, n=3, tag="v1"):
    return pl.DataFrame({"user_id": [u for u in users for _ in range(n)],
                         "text": [f"{u}-{tag}-{i}" for u in users for i in range(n)],
                         "turn_index": [i for _ in users for i in range(n)],
                         "ts": pl.Series([1_700_000_000_000_000 + i for _ in users for i in range(n)]).cast(
                             pl.Datetime("us", "UTC"))})


def _ops(path) -> list[str]:
    return [h["operation"] for h in DeltaTable(str(path)).history()]


def test_writes_that_remove_nothing_take_the_add_only_path(tmp_path, monkeypatch):
    calls = []
    real = file_commit.write_files
    monkeypatch.setattr(table_store, "write_files", lambda *a, **k: calls.append(1) or real(*a, **k))
    store = TableStore(tmp_path, n_buckets=4)
    a = [f"a{i}" for i in range(10)]
    store.replace_keyed("t", a, _rows(a))                      # new table: add-only
    b = [f"b{i}" for i in range(10)]
    store.replace_keyed("t", b, _rows(b))                      # new users, above every file's key range
    store.append("t", _rows(["a1"], tag="more"))                # an append
    assert len(calls) == 3
    store.replace_keyed("t", ["a3"], _rows(["a3"], tag="v2"))   # stored rows to take out: delta-rs
    assert len(calls) == 3
    assert _ops(tmp_path / "t")[0] == "WRITE" and _ops(tmp_path / "t")[-1] == "CREATE TABLE"
    got = store.read("t")
    want = pl.concat([_rows(a).filter(pl.col("user_id") != "a3"), _rows(b), _rows(["a1"], tag="more"),
                      _rows(["a3"], tag="v2")])
    cols = ["user_id", "text", "turn_index", "ts"]
    assert got.select(cols).sort(cols).equals(want.sort(cols))
    assert store.read("t", ["a3"])["text"].to_list() == ["a3-v2-0", "a3-v2-1", "a3-v2-2"]


def test_add_only_files_follow_the_layout_and_prune(tmp_path, monkeypatch):
    monkeypatch.setattr(table_store, "ROW_GROUP_ROWS", 6)
    store = TableStore(tmp_path, n_buckets=2)
    users = [f"user{i:02d}" for i in range(40)]
    store.replace_keyed("turns", users, _rows(users[::-1]))
    dt = DeltaTable(str(tmp_path / "turns"))
    acts = pl.DataFrame(dt.get_add_actions(flatten=True))
    assert acts.height == 2 and sorted(acts["partition.user_bucket"].to_list()) == [0, 1]
    for path, b, lo, hi in acts.select("path", "partition.user_bucket", "min.user_key", "max.user_key").iter_rows():
        assert path.startswith(f"user_bucket={b}/")
        f = pq.ParquetFile(tmp_path / "turns" / path)
        keys = f.read(columns=["user_key"])["user_key"].to_pylist()
        assert "user_bucket" not in f.schema_arrow.names              # the partition column lives in the log
        assert keys == sorted(keys) and (lo, hi) == (keys[0], keys[-1])
        assert {user_bucket(u, 2) for u in keys} == {b}
        assert f.metadata.num_row_groups > 1
    assert store.read("turns", ["user07"])["text"].to_list() == ["user07-v1-0", "user07-v1-1", "user07-v1-2"]
    # delta-rs' own operations read and rewrite these files
    assert store.delete("turns", ["user07"]) == 3
    store.compact("turns")
    assert store.read("turns").height == 39 * 3


def test_killed_between_files_and_commit_leaves_the_previous_version(tmp_path, monkeypatch):
    store = TableStore(tmp_path, n_buckets=4)
    store.replace_keyed("t", ["a"], _rows(["a"]))
    before = store.version("t")

    def crash(*a, **k):
        raise KeyboardInterrupt("killed before the commit")

    monkeypatch.setattr(table_store, "commit_append", crash)
    with pytest.raises(KeyboardInterrupt):
        store.append("t", _rows(["b"]))
    monkeypatch.undo()
    fresh = TableStore(tmp_path)
    assert fresh.version("t") == before and fresh.read("t")["user_id"].unique().to_list() == ["a"]
    on_disk = {p.relative_to(tmp_path / "t").as_posix() for p in (tmp_path / "t").rglob("*.parquet")}
    assert len(on_disk) == len(fresh.files("t")) + 1                   # one unreferenced file
    removed = fresh.vacuum("t", retention_hours=0, orphans_grace_hours=0)
    assert len(removed) == 1 and fresh.read("t").height == 3


def test_only_flat_signed_types_take_the_add_only_path():
    assert file_commit.fast_path_ok(pl.Schema({"a": pl.String, "b": pl.Int64, "c": pl.Datetime("us", "UTC"),
                                               "d": pl.Boolean, "e": pl.Float32}))
    for t in (pl.List(pl.Int64), pl.Array(pl.Float32, 2), pl.UInt32, pl.Datetime("us"), pl.Struct({"x": pl.Int8})):
        assert not file_commit.fast_path_ok(pl.Schema({"a": pl.String, "x": t}))


def test_a_concurrent_writer_of_the_same_users_loses_to_the_later_replace(tmp_path, monkeypatch):
    """A blind append cannot conflict: when another writer adds rows of the same (new) users
    between this writer's check and its commit, this writer's replace goes through delta-rs after
    its commit, so the users end with exactly the later writer's rows (as delta-rs' own conflict
    retry would leave them)."""
    TableStore(tmp_path, n_buckets=4).replace_keyed("t", ["a"], _rows(["a"]))
    real = table_store.commit_append
    state = {"raced": False}

    def racing_commit(dt, adds, **kw):
        if not state["raced"]:
            state["raced"] = True
            TableStore(tmp_path).replace_keyed("t", ["x"], _rows(["x"], tag="other"))  # the other writer
        return real(dt, adds, **kw)

    monkeypatch.setattr(table_store, "commit_append", racing_commit)
    TableStore(tmp_path).replace_keyed("t", ["x"], _rows(["x"], tag="mine"))
    assert state["raced"]
    got = TableStore(tmp_path).read("t", ["x"])
    assert got["text"].to_list() == ["x-mine-0", "x-mine-1", "x-mine-2"]
