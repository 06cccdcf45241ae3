"""Object storage for real: moto's standalone S3 server on loopback (tests/conftest.py `moto_server`),
delta-rs writing through its S3 client (conditional-put commits, no locking provider).

- the table store on an `s3://` root, two writer processes on disjoint users both landing;
- the main job (`qumem run`, LLM = the fake OpenAI server) on an `s3://` data root: every table equals
  the same run's tables on local disk, then `qumem forget` leaves the canary in no object of the root;
- the multiprocess executor on that root: steps in separate processes share data only through S3.
"""

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from crash_harness import USERS, run_pipeline, write_archive
from fake_openai_server import RunningFakeServer
from qumem_pipeline.storage.forget import forget_user
from qumem_pipeline.storage.layout import DataLayout
from tests.conftest import REPO_ROOT, s3_objects

pytestmark = pytest.mark.timeout(900)
CANARY = "CANARY-5f3a9c-only-in-bo"
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def objects_holding(objects: dict[str, bytes], needle: str) -> list[str]:
    """Keys whose raw bytes, or decoded Parquet values, contain `needle` (Parquet pages are compressed)."""
    import io

    hits = []
    for key, data in objects.items():
        found = needle.encode() in data
        if not found and key.endswith(".parquet"):
            df = pl.read_parquet(io.BytesIO(data))
            found = any(needle in str(v) for c in df.columns for v in df[c].to_list() if v is not None)
        if found:
            hits.append(key)
    return hits


def test_store_on_s3_replace_read_and_concurrent_writers(s3_root, tmp_path):
    layout = DataLayout(s3_root, n_buckets=2)
    layout.replace_users("turns", ["a", "b"], pl.DataFrame({"user_id": ["a", "b"], "text": ["x", "y"]}))
    layout.replace_users("turns", ["a"], pl.DataFrame({"user_id": ["a"], "text": ["x2"]}))
    assert layout.read_table("turns")["text"].to_list() == ["x2", "y"]
    assert layout.tables() == ["turns"] and layout.users_in("turns") == ["a", "b"]
    from test_table_store import CONCURRENT  # the same two-writer script, now against S3

    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, s3_root, who, str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for who in ("A", "B")]
    time.sleep(2.0)
    go.write_text("go")
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    df = DataLayout(s3_root).read_table("turns")
    assert set(df["user_id"]) == {"a", "b"} | {f"{w}{i}-{j}" for w in "AB" for i in range(12) for j in range(3)}
    assert DataLayout(s3_root).store.version("turns") == 2 + 24  # creation, seed, every commit of both writers


def test_forget_canary_on_s3(s3_root, moto_server, tmp_path):
    layout = DataLayout(s3_root)
    users = ["alice", "bob"]
    layout.replace_users("turns", users, pl.DataFrame({"user_id": users, "text": ["hello", f"my code is {CANARY}"]}))
    layout.replace_users("turns", ["bob"], pl.DataFrame({"user_id": ["bob"], "text": [f"again {CANARY}"]}))
    layout.replace_users("memories", users, pl.DataFrame({"user_id": users, "content": ["likes tea", CANARY]}))
    assert objects_holding(s3_objects(moto_server, s3_root), CANARY), "the canary must be there first"
    forget_user(s3_root, tmp_path / "wh.duckdb", "bob")
    objects = s3_objects(moto_server, s3_root)
    assert objects and objects_holding(objects, CANARY) == []
    assert objects_holding(objects, "bob") == []  # nor the id, in data files or the transaction logs
    assert DataLayout(s3_root).read_table("turns")["text"].to_list() == ["hello"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path_factory.mktemp("srv")) as srv:
        yield srv


def _archive_with_canary(directory: Path) -> None:
    path = write_archive(directory)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows.append({**next(r for r in rows if r["user_id"] == "bo"), "text": f"my locker code is {CANARY}",
                 "source_ref": "bo-canary", "timestamp": "2024-05-01T10:00:00Z"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _tables(layout: DataLayout) -> dict[str, list]:
    """Every table's rows, volatile columns and store columns dropped, order-free."""
    out = {}
    for t in layout.tables():
        df = layout.read_table(t)
        if df is None:
            continue
        # volatile or checkout-specific columns (the archive's absolute path differs between the two runs)
        df = df.drop([c for c in df.columns if c in ("created_at", "latency_s", "ledger", "source_file", "path", "mtime_ns")])
        out[t] = sorted(map(repr, df.rows()))
    return out


@pytest.mark.slow
def test_main_job_on_s3_equals_local_then_forget_leaves_no_canary(tmp_path, s3_root, moto_server, server):
    local, remote = tmp_path / "local", tmp_path / "s3"
    for w in (local, remote):
        _archive_with_canary(w / "archive")
    r = run_pipeline(local, server.base_url)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_pipeline(remote, server.base_url, data_root=s3_root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (remote / "data").exists()  # nothing went to local disk but the warehouse
    assert (remote / "warehouse.duckdb").exists()
    want, got = _tables(DataLayout(local / "data")), _tables(DataLayout(s3_root))
    assert set(got) == set(want) and "indexes" in got and "memories" in got
    assert got == want
    objects = s3_objects(moto_server, s3_root)
    assert objects_holding(objects, CANARY)

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update(PYTHONPATH=str(REPO_ROOT), DAGSTER_HOME=str(remote / "home"),
               QUMEM_TOMBSTONE_KEY=os.environ["QUMEM_TOMBSTONE_KEY"])
    f = subprocess.run([sys.executable, "-m", "qumem_pipeline.cli", "forget", "bo", "--data-root", s3_root],
                       cwd=remote, env=env, capture_output=True, text=True, timeout=300)
    assert f.returncode == 0 and "forgot bo" in f.stdout, f.stderr[-3000:]
    objects = s3_objects(moto_server, s3_root)
    assert objects and objects_holding(objects, CANARY) == []
    layout = DataLayout(s3_root)
    assert all("bo" not in layout.users_in(t) for t in layout.tables())
    assert set(layout.users_in("memories")) == set(USERS) - {"bo"}


def test_multiprocess_executor_on_s3_root(tmp_path, s3_root, small_archive, monkeypatch):
    """turns and warehouse run in two processes; the warehouse step finds turns only through S3."""
    monkeypatch.setenv("QUMEM_DATA_ROOT", s3_root)
    monkeypatch.setenv("QUMEM_ARCHIVE", str(small_archive))
    monkeypatch.setenv("QUMEM_WAREHOUSE", str(tmp_path / "wh.duckdb"))
    monkeypatch.chdir(tmp_path)
    import deploy.multiprocess

    importlib.reload(deploy.multiprocess)
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        instance.add_dynamic_partitions("users", ["alice", "bob", "chen"])
        with dg.execute_job(dg.build_reconstructable_job("deploy.multiprocess", "job", ("ingest_job",)),
                            instance=instance, tags={RANGE_START: "alice", RANGE_END: "chen"}) as result:
            assert result.success
            pids = {e.step_key: e.pid for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_START}
    assert set(pids) == {"turns", "warehouse"} and len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    assert DataLayout(s3_root).users_in("turns") == ["alice", "bob", "chen"]
    from qumem_pipeline.storage.warehouse import Warehouse

    assert Warehouse(tmp_path / "wh.duckdb").counts()["turns"] == 12
    assert not list(tmp_path.glob("data")), "no step wrote to a local data root"
