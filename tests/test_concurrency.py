"""Two runs at once for overlapping users: no corruption, no duplicates, one DuckDB writer.

Real processes throughout: `qumem ingest` twice at once against one persistent Dagster home and
one data root, compared byte for byte with a single run; and the warehouse lock exercised by two
processes that really collide in DuckDB without it.
"""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
import pytest

from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.warehouse import Warehouse, WarehouseBusy
from tests.conftest import REPO_ROOT, conversation, write_jsonl

pytestmark = pytest.mark.timeout(600)


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _python(code: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def _table_hashes(root: Path) -> dict[str, str]:
    """Every table's current rows (store columns included), order-free."""
    layout = DataLayout(root)
    out = {}
    for t in layout.tables():
        df = layout.store.read(t).drop("user_bucket")
        if "path" in df.columns:  # warehouse_locations: where this root was loaded, named relative to it
            df = df.with_columns(df["path"].str.replace(str(root.absolute()), "<root>", literal=True))
        rows = sorted(map(repr, df.rows()))
        out[t] = hashlib.sha256("\n".join(rows).encode()).hexdigest()
    return out


def _warehouse_rows(path: Path) -> dict[str, list]:
    with duckdb.connect(str(path), read_only=True) as con:
        names = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' ORDER BY 1").fetchall()]
        return {n: sorted(map(repr, con.execute(f'SELECT * EXCLUDE (code_version) FROM "{n}"').fetchall())) for n in names}


@pytest.fixture
def archive(tmp_path) -> Path:
    d = tmp_path / "archive"
    rows = []
    for i in range(6):
        rows += conversation(f"user{i}", f"c{i}", [f"user {i} says hello", "hi", f"user {i} likes tea no. {i}", "ok"])
    rows.append({"user_id": "user1", "conversation_id": "c1", "role": "robot", "text": "quarantined"})
    rows.append({"user_id": "../evil", "conversation_id": "c1", "role": "user", "text": "unattributed"})
    write_jsonl(d / "a.jsonl", rows[: len(rows) // 2])
    write_jsonl(d / "b.jsonl", rows[len(rows) // 2:])
    return d


INGEST = "from qumem_pipeline.cli import main; raise SystemExit(main(['ingest', '--archive', {a!r}, '--data-root', {d!r}]))"


@pytest.mark.slow
def test_two_concurrent_ingest_runs_equal_a_single_run(tmp_path, archive):
    """Launched together on one Dagster home and data root, two ingests leave what one leaves."""
    single, shared = tmp_path / "single", tmp_path / "shared"
    _finish(_python(INGEST.format(a=str(archive), d=str(single / "data")), DAGSTER_HOME=single / "home"))

    procs = [_python(INGEST.format(a=str(archive), d=str(shared / "data")), DAGSTER_HOME=shared / "home") for _ in range(2)]
    outs = [_finish(p) for p in procs]
    assert all("6 users" in o for o in outs), outs

    assert _table_hashes(shared / "data") == _table_hashes(single / "data") != {}
    assert _warehouse_rows(shared / "data" / "warehouse.duckdb") == _warehouse_rows(single / "data" / "warehouse.duckdb")
    wh = _warehouse_rows(shared / "data" / "warehouse.duckdb")
    assert len(wh["turns"]) == 24 and len(set(wh["turns"])) == 24, "no duplicated rows"
    assert not [p for p in (shared / "data").rglob("*") if p.name.startswith(".tmp-")], "temp files left behind"
    # the archive sync is one at a time per data root: the run that syncs second finds the manifest
    # current and writes no turns of its own (concurrent disjoint writers: tests/test_table_store.py)
    # (each run's lease also commits a data-less "fence" to the table: not counted)
    def row_commits(root):
        return [h.get("qumem.operation") for h in DataLayout(root).store._open("turns").history()
                if h.get("qumem.operation") != "fence"]
    assert row_commits(single / "data") == ["replace", "create"]
    assert row_commits(shared / "data") == row_commits(single / "data"), "the second run wrote turns of its own"


HOLD = """
import sys, time
from qumem_pipeline.storage.warehouse import Warehouse
with Warehouse(sys.argv[1]).connect() as con:
    con.execute("CREATE TABLE IF NOT EXISTS t (user_id VARCHAR)")
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_duckdb_really_collides_across_processes(tmp_path):
    """Why the lock exists: without it a second process cannot open the file at all."""
    path = tmp_path / "wh.duckdb"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "3"], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(path))
    finally:
        holder.wait()


def test_warehouse_lock_queues_a_second_writer_and_times_out_clearly(tmp_path):
    path = tmp_path / "wh.duckdb"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "2"], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(WarehouseBusy, match=r"wh\.duckdb is busy: another process has held .*wh\.duckdb\.lock"):
            with Warehouse(path, lock_timeout_s=0.3).connect():
                pass
        with pytest.raises(WarehouseBusy):  # readers wait too: DuckDB refuses them while a writer has the file
            Warehouse(path, lock_timeout_s=0.3).counts()
        t0 = time.monotonic()
        with Warehouse(path, lock_timeout_s=60).connect() as con:  # waits for the holder, then works
            con.execute("INSERT INTO t VALUES ('alice')")
        assert time.monotonic() - t0 > 0.5
    finally:
        holder.wait()
    assert Warehouse(path).counts() == {"t": 1}


LOAD = """
import sys
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.warehouse import Warehouse
layout, wh = DataLayout(sys.argv[1]), Warehouse(sys.argv[2])
users = sys.argv[3].split(",")
for _ in range(int(sys.argv[4])):
    wh.load_users(layout, users, ["turns"])
    wh.compact()
print("done", flush=True)
"""


def test_concurrent_warehouse_loads_and_compactions_serialise(tmp_path):
    """Two processes loading overlapping users and compacting in a loop: both finish, rows once each."""
    layout = DataLayout(tmp_path / "data")
    users = ["alice", "bob", "chen"]
    layout.replace_users("turns", users, pl.DataFrame({"user_id": [u for u in users for _ in range(3)],
                                                       "text": [f"{u}-{i}" for u in users for i in range(3)]}))
    path = tmp_path / "wh.duckdb"
    procs = [subprocess.Popen([sys.executable, "-c", LOAD, str(layout.root), str(path), users, "15"], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for users in ("alice,bob", "bob,chen")]
    for p in procs:
        _finish(p)
    with duckdb.connect(str(path), read_only=True) as con:
        rows = con.execute("SELECT user_id, text FROM turns ORDER BY ALL").fetchall()
    assert rows == [(u, f"{u}-{i}") for u in ("alice", "bob", "chen") for i in range(3)]
    assert not list(tmp_path.glob(".tmp-*"))
