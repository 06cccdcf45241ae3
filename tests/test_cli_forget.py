"""`qumem forget` fails like every other command (issue 51, item 4): one line on stderr naming what
failed and where, the traceback in the log file; a rerun where the store is reachable completes and
`--verify` finds nothing, the log included. And `qumem ingest` refuses, in one line naming the key id,
when a tombstone's key is not held (item 1). Real `qumem` processes on a real data root."""

import os
import subprocess
import sys

import polars as pl

from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.table_store import TableStore
from qumem_pipeline.storage.tombstones import key_id
from qumem_pipeline.storage.warehouse import Warehouse
from tests.conftest import REPO_ROOT, conversation, write_jsonl


def _qumem(tmp_path, *args, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update({"PYTHONPATH": str(REPO_ROOT), "DAGSTER_HOME": str(tmp_path / "home"),
                "QUMEM_TOMBSTONE_KEY": "cli-secret", **env_extra})
    return subprocess.run([sys.executable, "-m", "qumem_pipeline.cli", *args, "--data-root", str(tmp_path / "data")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_failed_forget_is_one_line_and_its_rerun_completes(tmp_path, monkeypatch):
    root, wh = tmp_path / "data", tmp_path / "wh.duckdb"
    TableStore(root).replace("turns", {u: pl.DataFrame({"user_id": [u, u], "turn_index": [0, 1],
                                                        "text": [f"secret-{u}-0", f"secret-{u}-1"]})
                                       for u in ("alice", "bob")})
    monkeypatch.setenv("QUMEM_HOST_ID", "warehouse-host")
    Warehouse(wh).load_users(DataLayout(root), ["alice", "bob"], ["turns"])  # records the warehouse's host

    failed = _qumem(tmp_path, "forget", "alice", "--warehouse", str(wh), QUMEM_HOST_ID="other-host")
    assert failed.returncode == 1
    line = _one_line(failed.stderr)
    assert line.startswith("qumem: forget FAILED: ") and "forget_user_op" in line
    assert "warehouse-host" in line and str(wh) in line and str(root) in line  # what failed and where
    log = line.rsplit("full log and traceback: ", 1)[1]
    text = open(log, encoding="utf-8").read()
    assert "StoreUnreachable" in text and 'File "' in text and "erase_from_warehouses" in text  # the stack trace
    assert "Traceback" not in failed.stdout

    done = _qumem(tmp_path, "forget", "alice", "--warehouse", str(wh), QUMEM_HOST_ID="warehouse-host")
    assert done.returncode == 0, done.stderr
    assert Warehouse(wh).users("turns") == ["bob"]
    verify = _qumem(tmp_path, "forget", "alice", "--verify", "--canary", "secret-alice-0", "--warehouse", str(wh),
                    QUMEM_HOST_ID="warehouse-host")
    assert verify.returncode == 0, verify.stdout[-2000:]  # the CLI's own log files hold no trace of the id


def test_ingest_refuses_in_one_line_when_a_tombstone_key_is_missing(tmp_path):
    archive = tmp_path / "archive"
    write_jsonl(archive / "a.jsonl", conversation("alice", "c1", ["alice secret", "ok"])
                + conversation("bob", "c2", ["bob note", "ok"]))
    first = _qumem(tmp_path, "ingest", "--archive", str(archive), QUMEM_TOMBSTONE_KEY="key-one")
    assert first.returncode == 0, first.stderr[-2000:]
    assert _qumem(tmp_path, "forget", "alice", QUMEM_TOMBSTONE_KEY="key-one").returncode == 0
    write_jsonl(archive / "b.jsonl", conversation("alice", "c3", ["alice is back?", "no"]))
    refused = _qumem(tmp_path, "ingest", "--archive", str(archive), QUMEM_TOMBSTONE_KEY="key-two")
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("qumem: ingest_job FAILED: TombstoneKeyOrphaned") and key_id(b"key-one") in line
    assert "QUMEM_TOMBSTONE_OLD_KEYS" in line and "key-one" not in line.replace(key_id(b"key-one"), "")
    assert TableStore(tmp_path / "data").users_in("turns") == ["bob"]
    again = _qumem(tmp_path, "ingest", "--archive", str(archive), QUMEM_TOMBSTONE_KEY="key-two",
                   QUMEM_TOMBSTONE_OLD_KEYS="key-one")
    assert again.returncode == 0, again.stderr[-2000:]
    assert TableStore(tmp_path / "data").users_in("turns") == ["bob"]
