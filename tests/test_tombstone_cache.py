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
