import os

import polars as pl
import pytest

from qumem_pipeline.contracts.ids import InvalidUserId, is_valid_user_id, validate_user_id
from qumem_pipeline.storage.layout import DataLayout

MALICIOUS = ["../x", "a'; drop table turns; --", "a/b", "", ".hidden", "x\x00y", "аlice", "a" * 129, "..", "a..b", " alice"]


@pytest.mark.parametrize("bad", MALICIOUS)
def test_malicious_user_ids_rejected(bad, tmp_path):
    assert not is_valid_user_id(bad)
    with pytest.raises(InvalidUserId, match="invalid user id"):
        validate_user_id(bad)
    with pytest.raises(InvalidUserId):
        DataLayout(tmp_path).write_user_table("turns", bad, pl.DataFrame({"a": [1]}))
    assert not any(tmp_path.rglob("*"))


@pytest.mark.parametrize("good", ["alice", "conv-26-caroline", "user_01.v2", "A1"])
def test_valid_user_ids(good):
    assert validate_user_id(good) == good


def test_replace_and_read_back(tmp_path):
    layout = DataLayout(tmp_path)
    layout.write_user_table("turns", "alice", pl.DataFrame({"user_id": ["alice"], "x": [1]}))
    layout.write_user_table("turns", "alice", pl.DataFrame({"user_id": ["alice", "alice"], "x": [2, 3]}))
    assert layout.read_user_table("turns", "alice")["x"].to_list() == [2, 3]
    assert layout.read_table("turns")["x"].to_list() == [2, 3]
    # no per-user files: one Delta table, files under bucket partitions
    assert (tmp_path / "turns" / "_delta_log").is_dir() and not list(tmp_path.rglob("user_id=*"))
    assert all("user_bucket=" in f for f in layout.store.files("turns"))
    # written empty != never written
    layout.write_user_table("turns", "bob", pl.DataFrame(schema={"user_id": pl.String, "x": pl.Int64}))
    assert layout.read_user_table("turns", "bob").height == 0 and layout.read_user_table("turns", "bob").columns == ["user_id", "x"]
    assert layout.read_user_table("turns", "chen") is None
    assert layout.users_in("turns") == ["alice", "bob"] and layout.read_table("turns")["x"].to_list() == [2, 3]


def test_failed_write_leaves_old_version(tmp_path):
    layout = DataLayout(tmp_path)
    layout.write_user_table("turns", "alice", pl.DataFrame({"user_id": ["alice"], "x": [1]}))
    version = layout.store.version("turns")

    # A frame Arrow cannot encode (an Object column) fails inside the real writer.
    unwritable = pl.DataFrame({"user_id": ["alice"], "x": [object()]}, schema={"user_id": pl.String, "x": pl.Object})
    with pytest.raises(Exception):
        layout.write_user_table("turns", "alice", unwritable)
    assert layout.read_user_table("turns", "alice")["x"].to_list() == [1]
    assert layout.store.version("turns") == version


def test_delete_user_every_table(tmp_path):
    layout = DataLayout(tmp_path)
    for table in ("turns", "quarantine", "episodes"):
        layout.replace_users(table, ["alice", "bob"], pl.DataFrame({"user_id": ["alice", "bob"]}))
    removed = layout.delete_user("alice")
    assert removed == ["episodes", "quarantine", "turns"]
    assert layout.users_in("turns") == ["bob"] and layout.users_in("episodes") == ["bob"]
    assert layout.read_user_table("turns", "alice") is None
