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


def test_unattributed_quarantine_reloads_only_when_its_files_change(tmp_path):
    """Every warehouse step mirrors the quarantine rows without a valid user id; while their Delta
    files are the ones last loaded it does nothing (the reload is a pattern-matched delete over the
    whole table), and a change of those rows, or of another user's rows in the same bucket, is seen."""
    from qumem_pipeline.contracts.buckets import user_bucket
    from qumem_pipeline.contracts.schema import UNATTRIBUTED

    layout, wh = DataLayout(tmp_path / "data"), Warehouse(tmp_path / "wh.duckdb")

    def bad(values):
        return pl.DataFrame({"user_id": values, "field": ["user_id"] * len(values), "reason": ["invalid"] * len(values)})

    layout.write_user_table("quarantine", UNATTRIBUTED, bad(["../a", None]))
    layout.write_user_table("quarantine", "alice", pl.DataFrame({"user_id": ["alice"], "field": ["text"], "reason": ["empty"]}))
    wh.load_users(layout, ["alice"], ["quarantine"])
    assert wh.load_unattributed(layout, UNATTRIBUTED) == 2
    assert wh.load_unattributed(layout, UNATTRIBUTED) is None  # unchanged: skipped
    layout.write_user_table("quarantine", "alice", pl.DataFrame({"user_id": ["alice"], "field": ["role"], "reason": ["bad role"]}))
    assert wh.load_unattributed(layout, UNATTRIBUTED) is None  # alice's files are not the unattributed ones
    layout.write_user_table("quarantine", UNATTRIBUTED, bad(["../b", "x y", None]))
    assert wh.load_unattributed(layout, UNATTRIBUTED) == 3
    with duckdb.connect(str(wh.path), read_only=True) as con:
        got = sorted(con.execute("SELECT coalesce(user_id, '<null>'), reason FROM quarantine").fetchall())
    assert got == [("../b", "invalid"), ("<null>", "invalid"), ("alice", "empty"), ("x y", "invalid")]
    assert "loaded_sources" not in wh.counts()  # the bookkeeping table is not one of the warehouse's tables
    # a deletion of a user whose rows share a file with them rewrites that file: seen as a change
    n = layout.store.buckets_of("quarantine")
    neighbour = next(f"u{i}" for i in range(10_000) if user_bucket(f"u{i}", n) == user_bucket(UNATTRIBUTED, n))
    layout.write_user_table("quarantine", neighbour, pl.DataFrame({"user_id": [neighbour], "field": ["text"], "reason": ["x"]}))
    assert wh.load_unattributed(layout, UNATTRIBUTED) is None  # a new file of the neighbour's only
    layout.store.compact("quarantine")  # one file for the bucket: the unattributed rows beside the neighbour's
    assert wh.load_unattributed(layout, UNATTRIBUTED) == 3
    layout.store.delete("quarantine", [neighbour])
    assert wh.load_unattributed(layout, UNATTRIBUTED) == 3 and wh.load_unattributed(layout, UNATTRIBUTED) is None
    wh.compact()  # the copy keeps the tables, not the bookkeeping: the next step reloads once
    assert wh.load_unattributed(layout, UNATTRIBUTED) == 3 and wh.load_unattributed(layout, UNATTRIBUTED) is None
