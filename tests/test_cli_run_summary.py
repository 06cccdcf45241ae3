"""What `qumem run` tells its user (issue 28, item 3): progress lines for every stage (done/total, rate,
ETA, and a heartbeat inside long batches such as A3's), a summary of what was made that matches the
warehouse, `qumem show USER_ID`, and a failed run that ends with one readable line while its
traceback goes to the log file.

The CLI runs as a real child process (crash_harness.run_pipeline) with the fake OpenAI-compatible server
(a real local HTTP server) as the LLM; one module-scoped run feeds the summary and `show` tests."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from fake_openai_server import RunningFakeServer
from tests.conftest import conversation, write_jsonl
from tests.crash_harness import REPO_ROOT, run_pipeline

STATE = {"facts": [{"statement": "The user now swims instead of running.", "memory_ids": ["M1"]}],
         "preference_trajectory": [], "insights": []}
SCRIPT = {"model": "fake-model", "rules": [
    {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "sport", "why": "plan"}]}}]},
    {"match": "retrieval-planning agent", "responses": [{"json": {"queries": [{"query": "sport", "stores": ["fact"]}]}}]},
    {"match": "user-state inference agent", "responses": [{"json": STATE}]},
    {"match": "persona profile", "responses": [{"json": {"aspect": "sport", "summary": "Swims."}}]},
], "default": [{"echo_memory": True}]}
USERS = ("ana", "ben")
WIDE = {"COLUMNS": "400"}  # rich tables without wrapping, so texts can be found whole


def _archive(work: Path) -> None:
    rows = []
    for i, u in enumerate(USERS):
        rows += conversation(u, f"{u}-c1", [f"I ran marathons for years ({u}).", "Impressive.",
                                            f"My knee forced me to switch to swimming ({u}).", "Good call."],
                             start=f"2024-03-0{i + 1}T10:00:00Z")
        rows += conversation(u, f"{u}-c2", [f"Now I swim 3 km every morning ({u}).", "Great."],
                             start=f"2024-06-0{i + 1}T10:00:00Z")
    rows.append({"user_id": "ana", "conversation_id": "ana-c1", "role": "robot", "text": "a bad row"})
    write_jsonl(work / "archive" / "archive.jsonl", rows)
    write_jsonl(work / "archive" / "queries.jsonl", [
        {"query_id": f"q-{u}", "user_id": u, "query": "Plan my workouts for next week.", "as_of": "2024-12-01T00:00:00Z"}
        for u in USERS])


def _qumem(work: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update({"PYTHONPATH": str(REPO_ROOT), "DAGSTER_HOME": str(work / "home"), **WIDE})
    return subprocess.run([sys.executable, "-m", "qumem_pipeline.cli", *args, "--data-root", str(work / "data")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("summary")
    _archive(work)
    os.environ.update(WIDE)  # inherited by run_pipeline's child
    try:
        with RunningFakeServer(SCRIPT, work / "srv") as srv:
            t0 = time.perf_counter()
            r = run_pipeline(work, srv.base_url, timeout=600)
            wall = time.perf_counter() - t0
    finally:
        for k in WIDE:
            os.environ.pop(k, None)
    assert r.returncode == 0, r.stderr[-3000:]
    con = duckdb.connect(str(work / "data" / "warehouse.duckdb"), read_only=True)
    yield {"work": work, "out": r.stdout, "err": r.stderr, "con": con, "wall": wall}
    con.close()


def _row(out: str, label: str, table: str | None = None) -> list[str]:
    """The cells of the first row that starts with `label` (columns are 2+ spaces apart), in the table
    titled `table` when given."""
    if table is not None:
        out = out[out.index(table):]
    for line in out.splitlines():
        cells = [c for c in re.split(r"\s{2,}", line.strip()) if c]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_every_stage_logs_done_total_rate_and_eta(cli_run):
    err = cli_run["err"]
    for where, label in [("ingest", "archive files read"), ("episodes", "continuity pairs classified"),
                         ("memories", "LLM calls (checkpointed)"), ("memory_embeddings", "memories embedded"),
                         ("memory_indexes", "user indexes built"), ("persona_profiles", "PERSONA_MERGE calls"),
                         ("memory_graph", "memory graphs built"), ("query_states", "A1 calls"),
                         ("query_states", "A2 calls"), ("query_states", "A3 calls"),
                         ("warehouse", "warehouse tables loaded")]:
        pat = rf"\d\d:\d\d:\d\d {where}: {re.escape(label)}[^:]*: (\d+)/(\d+) \([\d.]+/s, ETA [^)]*\)"
        found = re.findall(pat, err)
        assert found, f"no progress line of {where} / {label} in stderr:\n{err[-4000:]}"
        done, total = map(int, found[-1])
        assert done == total > 0, (where, label, found)


def test_summary_counts_match_the_warehouse(cli_run):
    out, con = cli_run["out"], cli_run["con"]

    def n(sql: str) -> int:
        return con.execute(sql).fetchone()[0]

    assert _row(out, "users")[1] == "2"
    assert _row(out, "turns")[1] == str(n("SELECT count(*) FROM turns"))
    assert _row(out, "quarantined rows")[1] == str(n("SELECT count(*) FROM quarantine WHERE user_id = 'ana'")) == "1"
    assert _row(out, "episodes")[1] == str(n("SELECT count(*) FROM episodes"))
    memories = _row(out, "memories")
    assert memories[1] == str(n("SELECT count(*) FROM memories")) and int(memories[1]) > 0
    by_type = dict(con.execute("SELECT type, count(*) FROM memories GROUP BY 1").fetchall())
    assert memories[2] == ", ".join(f"{t} {by_type.get(t, 0)}" for t in ("fact", "preference", "insight"))
    assert _row(out, "query states")[1] == str(n("SELECT count(*) FROM query_states")) == "2"
    # LLM calls and tokens by stage: the ledger's own figures, every call paid by this run
    ledger = {s: (c, p, k) for s, c, p, k in con.execute(
        "SELECT stage, count(*), sum(prompt_tokens), sum(completion_tokens) FROM llm_ledger GROUP BY 1").fetchall()}
    assert set(ledger) == {"decompose", "persona_merge", "a1", "a2", "a3"}
    for stage, (calls, prompt, completion) in ledger.items():
        assert _row(out, stage, "LLM calls and tokens")[1:5] == [str(calls), str(calls), f"{prompt:,}", f"{completion:,}"]
    assert _row(out, "total", "LLM calls and tokens")[1] == str(sum(c for c, _, _ in ledger.values()))
    # the same figures as JSON, without the samples' user text
    data = json.loads((cli_run["work"] / "data" / "run_summary.json").read_text())
    assert data["counts"]["memories"] == int(memories[1]) and data["counts"]["query_states"] == 2
    assert {s["stage"]: s["calls"] for s in data["llm"]["by_stage"]} == {s: v[0] for s, v in ledger.items()}
    assert "samples" not in data and "marathons" not in json.dumps(data)


def test_summary_shows_wall_time_locations_samples_and_the_quality_note(cli_run):
    out, con, work = cli_run["out"], cli_run["con"], cli_run["work"]
    data = json.loads((work / "data" / "run_summary.json").read_text())
    steps = ["turns", "episodes", "memories", "memory_embeddings", "memory_indexes", "persona_profiles",
             "memory_graph", "query_states", "warehouse"]
    assert list(data["wall_s_by_stage"]) == steps
    assert all(re.fullmatch(r"[\d.]+s|\d+m\d\ds", _row(out, s, "Wall time by stage")[1]) for s in steps)
    assert 0 < sum(data["wall_s_by_stage"].values()) < data["wall_s"] <= cli_run["wall"]
    assert _row(out, "warehouse (DuckDB)")[1] == str(work / "data" / "warehouse.duckdb")
    log = Path(_row(out, "full log")[1])
    assert log.is_file() and log.parent == work / "home" / "logs"
    # one sample memory and one state with its citations per user
    for u in USERS:
        first = con.execute("SELECT content FROM memories WHERE user_id = ? AND type = 'fact' "
                            "ORDER BY position, memory_id LIMIT 1", [u]).fetchone()[0]
        assert f"[fact] {first}" in out
    assert out.count("Q: Plan my workouts for next week.") == 2
    assert out.count("fact: The user now swims instead of running.") == 2
    assert "  cites [" in out and "cites no memory" not in out
    assert "Quality: memories and states come from fake-model (openai)" in out


def test_qumem_show_prints_the_users_memories_and_states(cli_run):
    work, con = cli_run["work"], cli_run["con"]
    r = _qumem(work, "show", "ben")
    assert r.returncode == 0, r.stderr[-3000:]
    mems = [c for (c,) in con.execute("SELECT content FROM memories WHERE user_id = 'ben'").fetchall()]
    assert mems and all(m in r.stdout for m in mems)
    assert not any(c in r.stdout for (c,) in con.execute("SELECT content FROM memories WHERE user_id = 'ana'").fetchall())
    assert "q-ben: Plan my workouts for next week." in r.stdout and "The user now swims instead of running." in r.stdout
    unknown = _qumem(work, "show", "nobody")
    assert unknown.returncode == 1 and "unknown user 'nobody'" in unknown.stderr


def test_a_failed_run_ends_with_one_line_naming_the_check_and_its_figures(tmp_path):
    work = tmp_path
    good = conversation("zed", "c1", ["I like tea.", "Noted.", "And green tea most.", "Got it."])
    bad = [{"user_id": "zed", "conversation_id": "c1", "role": "robot", "text": f"bad {i}"} for i in range(3)]
    write_jsonl(work / "archive" / "archive.jsonl", good + bad)
    (work / "archive" / "queries.jsonl").write_text("", encoding="utf-8")
    with RunningFakeServer(SCRIPT, work / "srv") as srv:
        r = run_pipeline(work, srv.base_url, timeout=600)
        assert srv.requests() == []  # stopped before any LLM stage
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("qumem: main_job FAILED: run 1/1 ")
    assert "blocking check turns:quarantine_under_ceiling failed: 3/7 rows quarantined (42.9%; ceiling 20%)" in last
    assert "by field: role 3" in last and f"quarantine table {work / 'data' / 'quarantine'}" in last
    log = Path(last.rsplit("full log and traceback: ", 1)[1])
    assert log.is_file() and "DagsterAssetCheckFailedError" in log.read_text()
    assert "Traceback" not in r.stderr and "Stack Trace" not in r.stderr
    assert not (work / "data" / "run_summary.json").exists()


def test_a_long_llm_batch_still_reports_every_heartbeat(tmp_path):
    """A3's batch through the real checkpointed wrapper and OpenAI client against a slow server: before
    any call has finished, the heartbeat writes done/total, rate and ETA; never longer than it without a line."""
    from assets.progress import ProgressLogger, llm_call_progress
    from qumem_pipeline.llm.factory import make_backend
    from qumem_pipeline.llm.retry import generate_with_retry
    from qumem_pipeline.memories.call_ledger import A3, CheckpointedLLM, call_tags
    from qumem_pipeline.llm.base import ChatRequest
    from qumem_pipeline.query.strategies.agents import A3_SCHEMA, A3_SYSTEM

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, msg):
            self.lines.append((time.monotonic(), msg))

    slow = {"model": "fake-model", "default": [{"json": STATE, "token_delay": 0.12}]}  # ~2 s a call
    log = Log()
    with RunningFakeServer(slow, tmp_path / "srv") as srv:
        backend = make_backend("openai", base_url=srv.base_url, model="fake-model")
        calls = CheckpointedLLM(backend, None, code_version="test")
        progress = ProgressLogger(log, "user states for 2 queries", heartbeat_s=0.4)
        calls.progress = llm_call_progress(progress)
        reqs = [ChatRequest(f"q{i}/a3", [{"role": "system", "content": A3_SYSTEM}, {"role": "user", "content": f"q{i}"}],
                            A3_SCHEMA, 256, "user_state", metadata=call_tags("u", A3, f"q{i}")) for i in range(2)]
        t0 = time.monotonic()
        with progress:
            results = generate_with_retry(calls, reqs)
        t1 = time.monotonic()
        backend.close()
    assert all(r.ok for r in results) and t1 - t0 > 1.0
    msgs = [m for _, m in log.lines]
    assert any(re.fullmatch(r"A3 calls: 0/2 \(0\.0/s, ETA \?\)", m) for m in msgs), msgs
    assert msgs[-1].startswith("A3 calls: 2/2 (") and msgs[-1].endswith("ETA 0s)")
    stamps = [t0] + [t for t, _ in log.lines]
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 0.4 + 1.2  # the beat checks every ≤1 s


def test_the_quality_note_is_honest_about_the_embedded_model():
    from qumem_pipeline.summary import quality_note

    note = quality_note([{"backend": "local", "model": "SmolLM2-135M-Instruct-Q4_1"}])
    assert "SmolLM2-135M" in note and "weak" in note
    assert "QUMEM_LLM_KIND=openai QUMEM_LLM_BASE_URL=http://HOST:8000/v1 .venv/bin/qumem run" in note
    other = quality_note([{"backend": "openai", "model": "Qwen2.5-Coder-1.5B"}])
    assert "SmolLM2" not in other and "Qwen2.5-Coder-1.5B (openai)" in other
