"""Killed runs: `qumem run` (3 users, main job, LLM = the fake OpenAI server) is killed with exit 137
at a named point (qumem_pipeline/runtime/faults.py), then rerun; every output must equal an uninterrupted
run's (content hashes of each Parquet table, FAISS file and warehouse table), with no partial,
duplicate or temp file left, and no LLM call paid twice (counted on the server side).
"""

import shutil

import pytest

from crash_harness import run_pipeline, snapshot, temp_files, write_archive
from fake_openai_server import RunningFakeServer
from qumem_pipeline.storage.layout import DataLayout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, server):
    work = tmp_path_factory.mktemp("uninterrupted")
    write_archive(work / "archive")
    n0 = len(server.requests())
    r = run_pipeline(work, server.base_url)
    assert r.returncode == 0, r.stderr[-3000:]
    snap = snapshot(work / "data")
    assert "table:indexes" in snap and "warehouse:memories" in snap
    return {"snapshot": snap, "llm_calls": len(server.requests()) - n0}


# point, hit to die at, what the kill must have left behind (proof the kill landed mid-work)
KILLS = [
    ("episodes.classify", 1, lambda d: not (d / "episodes").exists()),
    ("decompose.batch", 1, lambda d: DataLayout(d).read_table("memory_checkpoints") is not None
     and not (d / "memories").exists()),
    ("index.write", 4, lambda d: (d / "memory_embeddings").exists() and not (d / "indexes").exists()),
    ("warehouse.table", 2, lambda d: (d / "warehouse.duckdb").exists()),
]


@pytest.mark.parametrize("point,hit,left_behind", KILLS, ids=[k[0] for k in KILLS])
def test_killed_run_then_rerun_equals_uninterrupted(tmp_path, server, baseline, point, hit, left_behind):
    write_archive(tmp_path / "archive")
    data = tmp_path / "data"
    n0 = len(server.requests())

    killed = run_pipeline(tmp_path, server.base_url, kill_at=f"{point}:{hit}")
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert f"killing process at {point}" in killed.stderr
    assert left_behind(data), f"the kill at {point} left no trace; it did not land mid-work"
    calls_before_kill = len(server.requests()) - n0
    if point == "decompose.batch":
        assert calls_before_kill > 0

    rerun = run_pipeline(tmp_path, server.base_url)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # the dead run was failed and its pool slots freed (else the rerun waits for them forever)
    assert "failed: its process was killed" in rerun.stdout
    assert snapshot(data) == baseline["snapshot"]  # same files, same content, nothing extra
    assert temp_files(data) == []
    ck = DataLayout(data).read_table("memory_checkpoints")  # compacted: one row per call in use
    assert ck["key"].n_unique() == ck.height
    # finished LLM calls were not paid twice: kill + rerun together sent what one clean run sends
    assert len(server.requests()) - n0 == baseline["llm_calls"]
    shutil.rmtree(tmp_path / "home", ignore_errors=True)
