"""Kill-point style interleavings of a forget with a running main job (issue 27).

`qumem run` (3 users, main job, LLM = the fake OpenAI server, a real child process) is paused at a
stage boundary by the fault facility (qumem_pipeline/runtime/faults.py, QUMEM_FAULT_PAUSE_AT): after
the archive sync committed the turns, between two decomposition batches of `memories`, and after
`query_states`, the last step before `warehouse` (a forget's data op shares the warehouse pool, so
it waits for a warehouse step rather than landing inside it). While it stands there
`qumem forget bowen` (another process) erases his data; the run is released once the forget's data
part has returned (the forget then waits for the run before it scrubs the instance). On local disk
and on S3 (moto's server on loopback):
- the run exits 0 and ava's and cy's rows (every table, every warehouse table) equal an
  uninterrupted run's (embedding vectors within float noise): a forget never fails or changes
  someone else's run;
- `qumem forget bowen --verify --canary ...` finds his id and canary in no object of the data root,
  no warehouse row or file and no instance table or file;
- the ingest manifest names no file by his id (his own file, `bowen/history.jsonl`, is keyed);
- the next nightly (`qumem run` again over the same archive, which still holds him) brings nothing
  of his back, and the audit is still clean.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

from crash_harness import TOPICS, VOLATILE_COLUMNS
from fake_openai_server import RunningFakeServer
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.ingest.manifest import MANIFEST_TABLE
from qumem_pipeline.runtime.faults import PAUSE_ENV, PAUSE_FILE_ENV, PAUSE_TIMEOUT_ENV, PauseNotReleased, fault_point
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.table_store import STORE_COLUMNS, TableStore

REPO_ROOT = Path(__file__).resolve().parent.parent
CANARY = "CANARY-7d41e0-only-in-bo"
# bo's id is long enough not to occur by chance in binary files: the audit scans SQLite files'
# raw bytes for the id as a token, and a 2-letter id ("bo") is found in b-tree cells (0x62 0x6f)
GONE, OTHERS = "bowen", ("ava", "cy")
# columns that differ between any two runs, or name the run's own work directory; vectors (and the
# FAISS files holding them) are compared apart, within float noise: a batch without bo's memories
# embeds ava's and cy's with other padding, which moves the last bits. `code_version` (a hash of each
# stage's source) is left out: the uninterrupted run is shared by the module, and a working tree edited
# between it and a later test would differ there without any row being wrong.
UNSTABLE = VOLATILE_COLUMNS | {"source_file", "path", "embedding", "faiss", "code_version"}


def write_archive(directory: Path) -> Path:
    """bo's history in a file under a directory named after him (as per-user exports are laid out),
    the canary in one of his turns; ava and cy in one shared file."""
    rows: dict[str, list[dict]] = {}
    for ui, u in enumerate(("ava", GONE, "cy")):
        for ci, texts in enumerate(TOPICS):
            for i, t in enumerate(texts):
                rows.setdefault(u, []).append({
                    "user_id": u, "conversation_id": f"{u}-c{ci}", "session_id": f"{u}-c{ci}",
                    "role": "user" if i % 2 == 0 else "assistant", "speaker": u if i % 2 == 0 else "assistant",
                    "text": f"{t} ({u})", "timestamp": f"2024-0{ci + 1}-1{ui}T10:0{i}:00Z", "source_ref": f"{u}-c{ci}-{i}"})
    rows[GONE].append({**rows[GONE][0], "text": f"my locker code is {CANARY}", "source_ref": "bo-canary",
                       "conversation_id": "bo-c9", "session_id": "bo-c9", "timestamp": "2024-05-01T10:00:00Z"})
    (directory / GONE).mkdir(parents=True, exist_ok=True)
    (directory / GONE / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[GONE]))
    (directory / "shared.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows["ava"] + rows["cy"]))
    return directory


def _env(work: Path, base_url: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update({
        "PYTHONPATH": str(REPO_ROOT), "DAGSTER_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "QUMEM_LLM_KIND": "openai", "QUMEM_LLM_BASE_URL": base_url,
        "QUMEM_LLM_MODEL": "fake-model", "QUMEM_QUERIES": str(work / "queries.jsonl"), "QUMEM_DEVICE": "cpu",
        # one deployment secret for every process of the deployment (an s3:// root requires one)
        "QUMEM_TOMBSTONE_KEY": os.environ["QUMEM_TOMBSTONE_KEY"],
        "QUMEM_FORGET_RUN_WAIT_S": "900",
    })
    if os.environ.get("QUMEM_CACHE_DIR"):
        env["QUMEM_CACHE_DIR"] = os.environ["QUMEM_CACHE_DIR"]
    env.update(extra)
    return env


def _qumem(work: Path, root: str, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "qumem_pipeline.cli", *args, "--data-root", root]
    if args[0] == "run":
        cmd += ["--archive", str(work / "archive")]
    return cmd


class Proc:
    """A `qumem` child process whose output goes to files (read while it runs)."""

    def __init__(self, work: Path, name: str, cmd: list[str], env: dict):
        self.out, self.err = work / f"{name}.out", work / f"{name}.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=o, stderr=e, text=True)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
            raise AssertionError(f"{self.out.stem} still running after {timeout}s:\n{self.stderr()[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _wait_for(what: str, cond, procs: list[Proc], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.out.stem} exited ({p.proc.returncode}) before {what}:\n{p.stderr()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_to_end(work: Path, root: str, base_url: str, name: str) -> Proc:
    p = Proc(work, name, _qumem(work, root, "run"), _env(work, base_url))
    assert p.wait(600) == 0, p.stderr()[-4000:]
    return p


def audit(work: Path, root: str, base_url: str) -> dict:
    p = Proc(work, "audit", _qumem(work, root, "forget", GONE, "--verify", "--canary", CANARY), _env(work, base_url))
    rc = p.wait(300)
    report, _ = json.JSONDecoder().raw_decode(p.stdout())
    assert rc == (1 if report["found"] else 0), p.stderr()[-3000:]
    return report


def user_rows(layout: DataLayout, users) -> dict[str, list]:
    """Every table's rows of `users` (by the store's partition user), unstable columns dropped, order-free."""
    out = {}
    for t in layout.tables():
        df = layout.store.read(t, list(users))
        if df is None or df.height == 0:
            continue
        df = df.drop([c for c in df.columns if c in UNSTABLE or c in STORE_COLUMNS and c != "user_key"])
        out[t] = sorted(map(repr, df.rows()))
    return out


def embeddings(layout: DataLayout, users) -> dict[tuple, np.ndarray]:
    df = layout.read_table("memory_embeddings", list(users))
    return {(r["user_id"], r["memory_id"]): np.asarray(r["embedding"], dtype=np.float32) for r in df.iter_rows(named=True)}


def same_vectors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], atol=1e-4) for k in a)


def warehouse_rows(path: Path, users) -> dict[str, list]:
    out = {}
    with duckdb.connect(str(path), read_only=True) as con:
        for (t,) in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main'").fetchall():
            cur = con.execute(f'SELECT * FROM "{t}" WHERE user_id IN (SELECT unnest(?))', [list(users)])
            cols = [d[0] for d in cur.description]
            out[t] = sorted(repr([v for c, v in zip(cols, r) if c not in UNSTABLE]) for r in cur.fetchall())
    return out


def manifest_naming(layout: DataLayout, user: str) -> list[dict]:
    """Manifest rows whose file id or path names `user` as a directory or a file stem."""
    df = layout.read_user_table(MANIFEST_TABLE, UNATTRIBUTED)
    hits = []
    for r in ([] if df is None else df.iter_rows(named=True)):
        for v in (r["file_id"], r["path"]):
            parts = Path(v or "").parts
            if user in parts or any(p.split(".")[0] == user for p in parts):
                hits.append(r)
                break
    return hits


def users_everywhere(layout: DataLayout) -> set[str]:
    return {u for t in layout.tables() for u in layout.users_in(t)}


# ------------------------------------------------------------------ the pause facility alone

def test_pause_point_is_a_noop_unset_and_waits_for_its_release_file(tmp_path, monkeypatch):
    monkeypatch.delenv(PAUSE_ENV, raising=False)
    fault_point("turns.synced")  # returns
    base = tmp_path / "pause"
    code = ("from qumem_pipeline.runtime.faults import fault_point\n"
            "for i in range(4):\n    print(i, flush=True)\n    fault_point('p')\nprint('end', flush=True)\n")
    env = {**os.environ, PAUSE_ENV: "p:2", PAUSE_FILE_ENV: str(base), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reached = Path(str(base) + ".reached")
    deadline = time.monotonic() + 60
    while not reached.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    assert json.loads(reached.read_text())["point"] == "p" and json.loads(reached.read_text())["hit"] == 2
    time.sleep(0.5)
    assert proc.poll() is None  # standing still at the 2nd hit
    Path(str(base) + ".go").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["0", "1", "2", "3", "end"], err
    monkeypatch.setenv(PAUSE_ENV, "q:1")
    monkeypatch.setenv(PAUSE_FILE_ENV, str(tmp_path / "never"))
    monkeypatch.setenv(PAUSE_TIMEOUT_ENV, "0.2")
    with pytest.raises(PauseNotReleased, match="never released"):
        fault_point("q")


# ------------------------------------------------------------------ forgets at stage boundaries of a run

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, server):
    """One uninterrupted run, no forget: what ava's and cy's rows must be."""
    work = tmp_path_factory.mktemp("uninterrupted")
    write_archive(work / "archive")
    (work / "queries.jsonl").write_text("")
    root = str(work / "data")
    run_to_end(work, root, server.base_url, "run")
    layout = DataLayout(root)
    rows = user_rows(layout, OTHERS)
    assert {"turns", "episodes", "memories", "memory_embeddings", "indexes", "persona_profiles"} <= set(rows)
    assert all(len({r for r in rows["memories"] if f"'{u}'" in r}) > 0 for u in OTHERS)
    assert GONE in layout.users_in("memories")
    return {"tables": rows, "warehouse": warehouse_rows(work / "data" / "warehouse.duckdb", OTHERS),
            "embeddings": embeddings(layout, OTHERS)}


def _memories_of(layout: DataLayout, user: str) -> int:
    df = layout.read_user_table("memories", user)
    return 0 if df is None else df.height


# point:hit, and what must hold while the run stands there (the pause is where it says it is)
POINTS = {
    "turns": ("turns.synced", 1, lambda lay, wh: GONE in lay.users_in("turns") and not lay.store.exists("episodes")),
    "memories": ("decompose.batch", 1, lambda lay, wh: GONE in lay.users_in("episodes")
                 and lay.store.exists("memory_checkpoints") and not lay.store.exists("memories")),
    # the last step before `warehouse` (a forget's data op waits for a warehouse step: they share its pool)
    "warehouse": ("query_states.committed", 1, lambda lay, wh: _memories_of(lay, GONE) > 0
                  and GONE in lay.users_in("persona_profiles") and not wh.exists()),
}


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["local", "s3"])
@pytest.mark.parametrize("stage", list(POINTS))
def test_forget_at_a_stage_boundary_of_a_running_job(tmp_path, request, server, baseline, stage, storage):
    point, hit, paused_state = POINTS[stage]
    work = tmp_path
    write_archive(work / "archive")
    (work / "queries.jsonl").write_text("")
    root = request.getfixturevalue("s3_root") if storage == "s3" else str(work / "data")
    wh_path = work / "warehouse.duckdb" if storage == "s3" else work / "data" / "warehouse.duckdb"
    pause = work / "pause"

    run = Proc(work, "run", _qumem(work, root, "run"),
               _env(work, server.base_url, **{PAUSE_ENV: f"{point}:{hit}", PAUSE_FILE_ENV: str(pause)}))
    forget = None
    try:
        _wait_for(f"the run to pause at {point}", Path(f"{pause}.reached").exists, [run], timeout=420)
        layout = DataLayout(root)
        assert paused_state(layout, wh_path), f"the run is not where {point} says it is"
        assert GONE in users_everywhere(layout)

        forget = Proc(work, "forget", _qumem(work, root, "forget", GONE), _env(work, server.base_url))
        # the forget's data part returns, then it waits for the run (it covers bo) before the instance scrub
        _wait_for("the forget's data erasure", lambda: "data erased; waiting for" in forget.stderr(), [forget])
        assert GONE not in users_everywhere(DataLayout(root))
        assert run.proc.poll() is None  # still paused: the forget landed inside the run
        Path(f"{pause}.go").touch()

        assert run.wait(600) == 0, run.stderr()[-6000:]
        assert f"released at {point}" in run.stderr()
        assert forget.wait(300) == 0, forget.stderr()[-4000:]
        assert f"forgot {GONE}" in forget.stdout()
    finally:
        run.kill()
        if forget is not None:
            forget.kill()

    def check_erased_and_others_whole(when: str) -> None:
        layout = DataLayout(root)
        assert GONE not in users_everywhere(layout), when
        got = user_rows(layout, OTHERS)
        assert got == baseline["tables"], f"{when}: ava's or cy's rows differ from an uninterrupted run's " \
            f"({sorted(t for t in set(got) | set(baseline['tables']) if got.get(t) != baseline['tables'].get(t))})"
        assert same_vectors(embeddings(layout, OTHERS), baseline["embeddings"]), when
        assert warehouse_rows(wh_path, OTHERS) == baseline["warehouse"], when
        with duckdb.connect(str(wh_path), read_only=True) as con:
            assert con.execute("SELECT count(*) FROM turns WHERE user_id = ?", [GONE]).fetchone()[0] == 0
        report = audit(work, root, server.base_url)
        assert not report["found"], json.dumps(report, indent=1)[:4000]
        assert report["data_root"]["objects_scanned"] > 50
        assert [w["exists"] for w in report["warehouses"]] == [True]
        assert report["instance_tables"] == [] and report["instance_files"] == []
        assert manifest_naming(layout, GONE) == [], when
        assert TableStore(root).tombstones().forgotten_among([GONE, *OTHERS]) == {GONE}

    check_erased_and_others_whole("after the forget")

    # the next nightly: the archive still holds bo; a forgotten user stays forgotten
    again = run_to_end(work, root, server.base_url, "nightly")
    assert "2 users in" in again.stdout()
    check_erased_and_others_whole("after the next nightly")


# ------------------------------------------------------------------ the ingest manifest after a forget

def test_a_forgotten_users_file_is_keyed_in_the_manifest_and_stays_keyed(tmp_path):
    """bo's own file (`bowen/history.jsonl`) leaves the manifest's names once he is forgotten (the forget's
    manifest step), while the shared file keeps its path; the next sync still knows the file (not read
    again), a change to it is read and the file stays keyed, and a re-admitted bo's file is named again."""
    from qumem_pipeline.ingest.archive import ArchiveConfig
    from qumem_pipeline.ingest.manifest import is_keyed, read_manifest
    from qumem_pipeline.ingest.sync import key_forgotten_files, sync_archive
    from qumem_pipeline.storage.audit import audit_data_root
    from qumem_pipeline.storage.forget import ForgetRegistry, forget_user

    archive, root = write_archive(tmp_path / "archive"), tmp_path / "data"
    layout, cfg = DataLayout(root), ArchiveConfig(str(tmp_path / "archive"))
    sync_archive(cfg, layout, forgotten=ForgetRegistry(root))
    assert sorted(read_manifest(layout)) == [f"{GONE}/history.jsonl", "shared.jsonl"]
    assert key_forgotten_files(layout) == 0  # nobody forgotten: nothing keyed

    forget_user(root, None, GONE)
    assert manifest_naming(layout, GONE)  # the tables' erasure alone leaves the file named
    assert key_forgotten_files(layout) == 1
    manifest = read_manifest(layout)
    assert "shared.jsonl" in manifest and len(manifest) == 2 and manifest_naming(layout, GONE) == []
    [keyed] = [fid for fid in manifest if fid != "shared.jsonl"]
    assert is_keyed(keyed) and manifest[keyed]["path"] == keyed and manifest[keyed]["rows"] > 0
    assert key_forgotten_files(layout) == 0  # idempotent
    # no older manifest version on disk names the file (checked here, whatever the audit sees in a path)
    store_dir = root / MANIFEST_TABLE
    assert not [p for p in store_dir.rglob("*.parquet") if f"{GONE}/history".encode() in p.read_bytes()
                or f"{GONE}/history" in str(__import__("polars").read_parquet(p).to_dicts())]
    assert audit_data_root(str(root), GONE, [CANARY])["hits"] == []

    report = sync_archive(cfg, layout, forgotten=ForgetRegistry(root))  # unchanged: the keyed row is recognised
    assert report.files_read == 0 and report.gone == [] and report.new == []
    with open(archive / GONE / "history.jsonl", "a") as f:  # bo's source sends more: read, dropped, still keyed
        f.write(json.dumps({"user_id": GONE, "conversation_id": "bo-c10", "session_id": "bo-c10", "role": "user",
                            "speaker": GONE, "text": f"again {CANARY}", "timestamp": "2024-06-01T10:00:00Z",
                            "source_ref": "bo-again"}) + "\n")
    report = sync_archive(cfg, layout, forgotten=ForgetRegistry(root))
    assert report.changed == [f"{GONE}/history.jsonl"] and report.files_read == 1
    assert manifest_naming(layout, GONE) == [] and sorted(read_manifest(layout))[0] == keyed
    assert GONE not in users_everywhere(layout)

    ForgetRegistry(root).remove(GONE)  # re-admitted: his file is read again and named again
    (archive / GONE / "history.jsonl").touch()
    os.utime(archive / GONE / "history.jsonl", ns=(1, 1))
    sync_archive(cfg, layout, forgotten=ForgetRegistry(root))
    assert sorted(read_manifest(layout)) == [f"{GONE}/history.jsonl", "shared.jsonl"]
    assert GONE in layout.users_in("turns")
