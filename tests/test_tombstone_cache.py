"""Handles on one forget registry share what this process parsed of a registry version, and never
across a registry that was deleted and created again at the same path."""

import shutil

import pytest

from qumem_pipeline.storage import tombstones as tomb
from qumem_pipeline.storage.table_store import TableStore


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch):
    monkeypatch.setattr(tomb, "_PARSED", {})


def _reads_forbidden(handle: tomb.Tombstones, monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the registry was read again for a version this process has parsed")

    monkeypatch.setattr(handle.store, "read", refuse)


def test_a_second_handle_reuses_the_parsed_version_and_reads_a_new_one(tmp_path, monkeypatch):
    root = tmp_path / "data"
    first = TableStore(root).tombstones()
    first.record(["eve"])
    assert first.forgotten_among(["eve", "bob"]) == {"eve"}

    second = TableStore(root).tombstones()
    with monkeypatch.context() as m:
        _reads_forbidden(second, m)
        assert second.forgotten_among(["eve", "bob"]) == {"eve"}

    first.record(["bob"], action=tomb.ERASED)  # a new version: read, not taken from the cache
    assert second.forgotten_among(["eve", "bob"]) == {"eve", "bob"}
    assert second.erased_among(["eve", "bob"]) == {"bob"}


def test_a_registry_created_again_at_the_same_path_is_read_afresh(tmp_path):
    root = tmp_path / "data"
    old = TableStore(root).tombstones()
    old.record(["eve"])
    assert old.forgotten_among(["eve"]) == {"eve"}  # parsed: (root, table id, version 1) cached

    shutil.rmtree(root)
    new = TableStore(root).tombstones()
    new.record(["bob"])  # same path, same version number, another table
    assert new.forgotten_among(["eve", "bob"]) == {"bob"}


def test_a_forget_after_a_readmit_wins_whatever_the_hosts_clocks_say(tmp_path, monkeypatch):
    """Events are ordered by the registry version their host had seen, not by wall clock: a forget
    appended after a readmit was committed wins even when its host's clock is behind."""
    import datetime as dt

    root = tmp_path / "data"
    TableStore(root).tombstones().record(["alice"])
    TableStore(root).tombstones().record(["alice"], action=tomb.READMIT)  # host A: the user came back
    assert not TableStore(root).tombstones().forgotten_among(["alice"])

    class Behind(dt.datetime):  # host B: its clock a minute behind host A's
        @classmethod
        def now(cls, tz=None):
            return dt.datetime.now(tz) - dt.timedelta(minutes=1)

    monkeypatch.setattr(tomb, "datetime", Behind)
    TableStore(root).tombstones().record(["alice"])  # host B forgets them again, after the readmit
    monkeypatch.setattr(tomb, "datetime", dt.datetime)
    assert TableStore(root).tombstones().forgotten_among(["alice"]) == {"alice"}
    # a registry written before `seq` existed (rows without it) still orders by time, before every new row
    store = TableStore(tmp_path / "old")
    import polars as pl

    old = pl.DataFrame({"digest": [store.tombstones().digest("bob")[1]], "key_id": [store.tombstones().digest("bob")[0]],
                        "action": [tomb.FORGET], "at": [dt.datetime.now(dt.timezone.utc)],
                        "_owner": [tomb.REGISTRY_KEY]}, schema_overrides={"at": pl.Datetime("us", "UTC")})
    store.append(tomb.REGISTRY_TABLE, old, key_column="_owner", guarded=False)
    assert TableStore(tmp_path / "old").tombstones().forgotten_among(["bob"]) == {"bob"}
    monkeypatch.setattr(tomb, "datetime", Behind)
    TableStore(tmp_path / "old").tombstones().record(["bob"], action=tomb.READMIT)  # seq'd: after the old row
    monkeypatch.setattr(tomb, "datetime", dt.datetime)
    assert not TableStore(tmp_path / "old").tombstones().forgotten_among(["bob"])
