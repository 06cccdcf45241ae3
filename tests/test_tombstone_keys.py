"""Tombstone keys that cannot un-forget a user (issue 51, item 1): a local root's generated key is
carried when `QUMEM_TOMBSTONE_KEY` is set later, a process missing a key some tombstone was made
with refuses to ingest with one line naming the key id, and a forgotten user never comes back on a
later ingest of new turns, whichever way the keys moved (local -> env, env -> local, rotation)."""

import hashlib
from datetime import datetime, timezone

import polars as pl
import pytest

from qumem_pipeline.ingest.archive import ArchiveConfig
from qumem_pipeline.ingest.discovery import discover
from qumem_pipeline.storage.forget import ForgetRegistry, forget_user
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.table_store import TableStore
from qumem_pipeline.storage.tombstones import (LEGACY_KEY_ID, REGISTRY_KEY, REGISTRY_TABLE, SCHEMA,
                                               TombstoneKeyOrphaned, key_id, tombstone_keys)
from tests.conftest import conversation, write_jsonl


@pytest.fixture
def no_keys(monkeypatch):
    """No key in the environment: a local root generates its own (what `qumem forget` on a laptop does)."""
    for var in ("QUMEM_TOMBSTONE_KEY", "QUMEM_TOMBSTONE_OLD_KEYS", "QUMEM_ENV"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _ingest(tmp_path, root, round_no: int) -> list[str]:
    """Add one archive file with new turns for alice and bob, then ingest (the sensor / CLI's data path)."""
    archive = tmp_path / "archive"
    write_jsonl(archive / f"r{round_no}.jsonl",
                conversation("alice", f"a{round_no}", [f"alice secret round {round_no}", "ok"])
                + conversation("bob", f"b{round_no}", [f"bob note round {round_no}", "ok"]))
    layout = DataLayout(root)
    discover(ArchiveConfig(str(archive)), {}, forgotten=ForgetRegistry(root), layout=layout)
    return layout.store.users_in("turns")


def _forget_alice(tmp_path, root):
    assert _ingest(tmp_path, root, 0) == ["alice", "bob"]
    forget_user(root, None, "alice")
    assert TableStore(root).users_in("turns") == ["bob"]


def test_setting_the_env_key_after_a_local_forget_keeps_the_user_out(tmp_path, no_keys):
    """The issue's scenario: forget on a local root (generated key), then QUMEM_TOMBSTONE_KEY set, then
    an ingest of new turns for the user: the user must stay out (the generated key is carried)."""
    root = tmp_path / "data"
    _forget_alice(tmp_path, root)
    local = (root / "_secrets" / "tombstone.key").read_text().strip().encode()
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "production-secret")
    assert _ingest(tmp_path, root, 1) == ["bob"]
    assert tombstone_keys(str(root)) == [b"production-secret", local]
    forget_user(root, None, "bob")  # a forget under the new key
    reg = TableStore(root).read(REGISTRY_TABLE)
    assert set(reg.filter(~reg["user_placeholder"])["key_id"]) == {key_id(local), key_id(b"production-secret")}
    assert _ingest(tmp_path, root, 2) == []


def test_moving_from_the_env_key_to_the_local_key_refuses_until_the_old_key_is_supplied(tmp_path, no_keys):
    root = tmp_path / "data"
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "env-secret")
    _forget_alice(tmp_path, root)
    no_keys.delenv("QUMEM_TOMBSTONE_KEY")  # back to a generated local key: the env key's tombstone is orphaned
    with pytest.raises(TombstoneKeyOrphaned) as e:
        _ingest(tmp_path, root, 1)
    line = str(e.value)
    assert "\n" not in line and key_id(b"env-secret") in line and "QUMEM_TOMBSTONE_OLD_KEYS" in line
    assert "env-secret" not in line  # the id, never the key
    assert TableStore(root).users_in("turns") == ["bob"]  # nothing was written
    no_keys.setenv("QUMEM_TOMBSTONE_OLD_KEYS", "env-secret")
    assert _ingest(tmp_path, root, 1) == ["bob"]


def test_a_rotation_without_the_old_key_refuses_and_with_it_holds(tmp_path, no_keys):
    root = tmp_path / "data"
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "key-2025")
    _forget_alice(tmp_path, root)
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "key-2026")
    with pytest.raises(TombstoneKeyOrphaned, match=key_id(b"key-2025")):
        _ingest(tmp_path, root, 1)
    with pytest.raises(TombstoneKeyOrphaned):  # a forget refuses too (it would write beside an orphan)
        forget_user(root, None, "bob")
    no_keys.setenv("QUMEM_TOMBSTONE_OLD_KEYS", " other-key , key-2025 ")
    assert _ingest(tmp_path, root, 1) == ["bob"]
    # a third key: both old ones listed, both tombstones hold
    forget_user(root, None, "bob")
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "key-2027")
    no_keys.setenv("QUMEM_TOMBSTONE_OLD_KEYS", "key-2026")
    with pytest.raises(TombstoneKeyOrphaned, match=key_id(b"key-2025")):
        _ingest(tmp_path, root, 2)
    no_keys.setenv("QUMEM_TOMBSTONE_OLD_KEYS", "key-2026,key-2025")
    assert _ingest(tmp_path, root, 2) == []


def test_a_readmit_after_a_rotation_brings_the_user_back(tmp_path, no_keys):
    """The readmit is written under the old key too, so the old key's forget does not outvote it."""
    root = tmp_path / "data"
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "old")
    _forget_alice(tmp_path, root)
    no_keys.setenv("QUMEM_TOMBSTONE_KEY", "new")
    no_keys.setenv("QUMEM_TOMBSTONE_OLD_KEYS", "old")
    ForgetRegistry(root).remove("alice")
    assert _ingest(tmp_path, root, 1) == ["alice", "bob"]
    # once every tombstone of the old key is readmitted, the old key is no longer needed
    no_keys.delenv("QUMEM_TOMBSTONE_OLD_KEYS")
    assert TableStore(root).tombstones().forgotten_among(["alice", "bob"]) == set()
    forget_user(root, None, "alice")  # under the new key alone; then erased: nothing pending
    tombs = TableStore(root).tombstones()
    assert tombs.forgotten_among(["alice"]) == {"alice"} and not tombs.erasure_pending()


def test_pre_hmac_rows_hold_under_any_key(tmp_path, no_keys):
    """Rows without a key id are the pre-HMAC registry's plain sha256 (storage/migrate.py): they need
    no key, so no key move orphans them."""
    root = tmp_path / "data"
    now = datetime.now(timezone.utc)
    legacy = pl.DataFrame([{"digest": hashlib.sha256(b"alice").hexdigest(), "key_id": None, "action": None,
                            "at": now, "seq": None}], schema=SCHEMA).with_columns(pl.lit(REGISTRY_KEY).alias("_owner"))
    TableStore(root).append(REGISTRY_TABLE, legacy, key_column="_owner", guarded=False)
    for env in ({}, {"QUMEM_TOMBSTONE_KEY": "a"}, {"QUMEM_TOMBSTONE_KEY": "b", "QUMEM_ENV": "production"}):
        for k, v in env.items():
            no_keys.setenv(k, v)
        assert TableStore(root).tombstones().forgotten_among(["alice", "bob"]) == {"alice"}
        assert _ingest(tmp_path, root, len(env)) == ["bob"]
    reg = TableStore(root).read(REGISTRY_TABLE)
    assert reg.filter(~reg["user_placeholder"])["key_id"].fill_null(LEGACY_KEY_ID).to_list() == [LEGACY_KEY_ID]
