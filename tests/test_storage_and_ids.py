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


def test_atomic_replace_and_cleanup(tmp_path):
    layout = DataLayout(tmp_path)
    layout.write_user_table("turns", "alice", pl.DataFrame({"user_id": ["alice"], "x": [1]}))
    layout.write_user_table("turns", "alice", pl.DataFrame({"user_id": ["alice", "alice"], "x": [2, 3]}))
    assert layout.read_user_table("turns", "alice")["x"].to_list() == [2, 3]
    assert [p.name for p in (tmp_path / "turns" / "user_id=alice").iterdir()] == ["part-0.parquet"]
    # A temp file left by a killed writer is cleaned up and never read as data.
    stray = tmp_path / "turns" / "user_id=alice" / ".tmp-dead.parquet"
    stray.write_bytes(b"partial")
    assert layout.read_table("turns")["x"].to_list() == [2, 3]
    assert layout.clean_temp_files() == 1 and not stray.exists()


def test_failed_write_leaves_old_file(tmp_path):
    layout = DataLayout(tmp_path)
    layout.write_user_table("turns", "alice", pl.DataFrame({"user_id": ["alice"], "x": [1]}))

    # A frame Parquet cannot encode (an Object column) fails inside the real writer.
    unwritable = pl.DataFrame({"user_id": ["alice"], "x": [object()]}, schema={"user_id": pl.String, "x": pl.Object})
    with pytest.raises(Exception):
        layout.write_user_table("turns", "alice", unwritable)
    assert layout.read_user_table("turns", "alice")["x"].to_list() == [1]
    assert len(os.listdir(tmp_path / "turns" / "user_id=alice")) == 1


def test_delete_user_every_table(tmp_path):
    layout = DataLayout(tmp_path)
    for table in ("turns", "quarantine", "episodes"):
        for u in ("alice", "bob"):
            layout.write_user_table(table, u, pl.DataFrame({"user_id": [u]}))
    (tmp_path / "indexes" / "user_id=alice").mkdir(parents=True)
    (tmp_path / "indexes" / "user_id=alice" / "fact.faiss").write_bytes(b"idx")
    removed = layout.delete_user("alice")
    assert len(removed) == 4
    assert layout.users_in("turns") == ["bob"] and layout.users_in("episodes") == ["bob"]
    assert not (tmp_path / "indexes" / "user_id=alice").exists()
