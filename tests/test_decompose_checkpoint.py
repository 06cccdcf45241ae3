"""Checkpoint store of finished decomposition calls, and the fault-injection hook."""

import subprocess
import sys
from datetime import datetime, timezone

import pytest

from qumem_pipeline.memories.checkpoints import CallOutcome, CheckpointStore, call_key
from qumem_pipeline.runtime.faults import ENV, fault_point
from qumem_pipeline.storage.forget import forget_user

T = datetime(2024, 1, 1, tzinfo=timezone.utc)


def outcome(user: str, ep: str, typ: str = "fact", status: str = "ok") -> CallOutcome:
    key = call_key(user, ep, typ, [{"role": "user", "content": ep}], "pv", "m", 64)
    return CallOutcome(key=key, user_id=user, episode_id=ep, type=typ, status=status,
                       output={"memories": []} if status == "ok" else None,
                       quarantine={"reason": "invalid_json: x"} if status != "ok" else None,
                       ledger=[{"attempt": 1, "status": status, "latency_s": 0.1}], created_at=T)


def test_key_changes_with_prompt_model_and_budget():
    base = call_key("u", "e", "fact", [{"role": "user", "content": "x"}], "pv", "m", 64)
    assert base == call_key("u", "e", "fact", [{"role": "user", "content": "x"}], "pv", "m", 64)
    assert len({base,
                call_key("u", "e", "fact", [{"role": "user", "content": "y"}], "pv", "m", 64),
                call_key("u", "e", "fact", [{"role": "user", "content": "x"}], "pv2", "m", 64),
                call_key("u", "e", "fact", [{"role": "user", "content": "x"}], "pv", "m2", 64),
                call_key("u", "e", "fact", [{"role": "user", "content": "x"}], "pv", "m", 128),
                call_key("u", "e", "insight", [{"role": "user", "content": "x"}], "pv", "m", 64)}) == 6


def test_append_load_compact_roundtrip(tmp_path):
    store = CheckpointStore(tmp_path)
    a, b, c = outcome("u1", "e1"), outcome("u1", "e2", status="quarantined"), outcome("u2", "e1")
    store.append([a, b])
    store.append([c])
    # a killed writer's leftover: a data file no commit references is never read
    (tmp_path / "memory_checkpoints" / "user_bucket=0").mkdir(exist_ok=True)
    (tmp_path / "memory_checkpoints" / "user_bucket=0" / "part-orphan.parquet").write_bytes(b"PAR1 half")
    loaded = CheckpointStore(tmp_path).load(["u1", "u2"])
    assert set(loaded) == {a.key, b.key, c.key}
    assert loaded[b.key].status == "quarantined" and loaded[b.key].quarantine == {"reason": "invalid_json: x"}
    assert loaded[a.key].ledger == a.ledger and loaded[a.key].created_at == T
    store.compact("u1", {a.key})
    assert set(store.load(["u1"])) == {a.key} and set(store.load(["u2"])) == {c.key}
    assert store.layout.read_user_table("memory_checkpoints", "u1").height == 1


def test_unreadable_checkpoint_is_skipped_not_fatal(tmp_path):
    store = CheckpointStore(tmp_path)
    store.append([outcome("u1", "e1")])
    assert len(store.load(["u1"])) == 1
    for f in store.layout.store.files("memory_checkpoints"):  # the committed data file is corrupted
        open(f, "wb").write(b"not parquet")
    fresh = CheckpointStore(tmp_path)
    assert fresh.load(["u1"]) == {} and fresh.unreadable == [fresh.layout.table_dir("memory_checkpoints")]


def test_forget_removes_checkpoints(tmp_path):
    CheckpointStore(tmp_path).append([outcome("u1", "e1"), outcome("u2", "e1")])
    forget_user(tmp_path, tmp_path / "warehouse.duckdb", "u1")
    left = CheckpointStore(tmp_path)
    assert left.load(["u1"]) == {} and len(left.load(["u2"])) == 1
    assert left.layout.users_in("memory_checkpoints") == ["u2"]


def test_fault_point_is_a_noop_when_unset_and_kills_at_the_nth_hit(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    fault_point("decompose.batch")  # returns
    code = "from qumem_pipeline.runtime.faults import fault_point\nfor i in range(5):\n    print(i, flush=True)\n    fault_point('p')\n"
    r = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, ENV: "p:3"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 137 and r.stdout.split() == ["0", "1", "2"] and "killing process at p (hit 3)" in r.stderr
    monkeypatch.setenv(ENV, "p:three")
    with pytest.raises(ValueError, match="QUMEM_FAULT_KILL_AT"):
        fault_point("p")
