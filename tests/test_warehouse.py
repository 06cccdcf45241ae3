import duckdb
import polars as pl

from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.warehouse import Warehouse


def _write(layout, user, texts):
    layout.write_user_table("turns", user, pl.DataFrame({"user_id": [user] * len(texts), "text": texts}))


def test_incremental_load_converges_and_isolates_users(tmp_path):
    layout, wh = DataLayout(tmp_path / "data"), Warehouse(tmp_path / "wh.duckdb")
    _write(layout, "alice", ["a1", "a2"])
    _write(layout, "bob", ["b1"])
    assert wh.load_users(layout, ["alice", "bob"], ["turns"]) == {"turns": 3}
    _write(layout, "alice", ["a3"])  # alice changed; bob did not
    wh.load_users(layout, ["alice"], ["turns"])
    wh.load_users(layout, ["alice"], ["turns"])  # a rerun changes nothing
    with duckdb.connect(str(wh.path), read_only=True) as con:
        rows = sorted(con.execute("SELECT user_id, text FROM turns").fetchall())
    assert rows == [("alice", "a3"), ("bob", "b1")]


def test_new_column_is_added(tmp_path):
    layout, wh = DataLayout(tmp_path / "data"), Warehouse(tmp_path / "wh.duckdb")
    _write(layout, "alice", ["a"])
    wh.load_users(layout, ["alice"], ["turns"])
    layout.write_user_table("turns", "bob", pl.DataFrame({"user_id": ["bob"], "text": ["b"], "extra": [1]}))
    wh.load_users(layout, ["bob"], ["turns"])
    assert wh.counts()["turns"] == 2
    with duckdb.connect(str(wh.path), read_only=True) as con:
        rows = con.execute("SELECT user_id, text, extra FROM turns ORDER BY user_id").fetchall()
    assert rows == [("alice", "a", None), ("bob", "b", 1)]  # the column arrives; alice's older row gets NULL


def test_delete_user_leaves_no_bytes_on_disk(tmp_path):
    layout, wh = DataLayout(tmp_path / "data"), Warehouse(tmp_path / "wh.duckdb")
    canary = "CANARY-7f3a9c-never-to-be-seen-again"
    _write(layout, "alice", [canary] * 50)
    _write(layout, "bob", ["keep me"])
    wh.load_users(layout, ["alice", "bob"], ["turns"])
    assert canary.encode() in wh.path.read_bytes()
    assert wh.delete_user("alice") == {"turns": 50}
    assert canary.encode() not in wh.path.read_bytes()
    assert wh.users() == ["bob"]


def test_export_parquet(tmp_path):
    layout, wh = DataLayout(tmp_path / "data"), Warehouse(tmp_path / "wh.duckdb")
    _write(layout, "alice", ["a"])
    wh.load_users(layout, ["alice"], ["turns"])
    written = wh.export_parquet(tmp_path / "out")
    assert pl.read_parquet(written["turns"])["text"].to_list() == ["a"]
    assert not list((tmp_path / "out").glob(".tmp-*"))
