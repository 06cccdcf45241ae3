"""A recording `qumem eval locomo --qa` run stopped by a real SIGTERM (a deadline's `timeout`, a scheduler):
the process ends without waiting for the calls in flight, reports what was answered, writes its run
manifest to the record, and keeps every call that finished. System tier (a subprocess and a real signal)."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_openai_server import RunningFakeServer
from test_eval_qa import STATE, _script, toy  # noqa: F401 - `toy` is a fixture

REPO = Path(__file__).resolve().parents[1]
HANG_S = 120  # QUMem's A3 never answers within the test: the stop must not wait for it


def _ledger_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_stops_a_recording_run_and_keeps_what_it_answered(toy, tmp_path):  # noqa: F811
    _, path, mem_dir = toy
    script = _script()
    for rule in script["rules"]:
        if rule["match"] == "user-state inference agent":
            rule["responses"] = [{"hang": HANG_S, "json": STATE}]
    rec, out = tmp_path / "rec", tmp_path / "run" / "qa.json"
    ledger = out.parent / "qa.ledger.jsonl"
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        env = {**os.environ, "QUMEM_LLM_BASE_URL": srv.base_url, "QUMEM_LLM_MODEL": "fake-qa",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "qumem_pipeline.eval.locomo.qa", str(path), "--memories", str(mem_dir),
               "--out", str(out), "--record", str(rec), "--llm-kind", "openai", "--chunk", "2", "--json",
               "--strategies", "none,topk_turns,qumem"]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            # QUMem's A2 answered: its A3 calls are next, and they hang
            while not any(r.get("strategy") == "qumem" and "plan" in (r.get("type") or "") for r in _ledger_rows(ledger)):
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "QUMem's planning calls never reached the ledger"
                time.sleep(0.2)
            time.sleep(1.0)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert time.monotonic() - sent < HANG_S / 2  # it did not wait for the hanging calls
    report = json.loads(stdout.strip().splitlines()[-1])
    assert "interrupted" in report["skipped"] and "SIGTERM" in report["skipped"]["interrupted"]
    assert report["qa"]["topk_turns"]["n"] == 4 and report["qa"]["qumem"]["n"] == 0
    run = json.loads((rec / "runs" / report["record"]["manifest"]).read_text())
    assert sorted(run["answered"]) == ["none", "topk_turns"]
    # every call that finished is in the record: QUMem's A1 and A2 of the stopped chunk included
    stages = [json.loads(gzip.decompress(p.read_bytes()))["stage"] for p in (rec / "calls").rglob("*.json.gz")]
    finished = [r for r in _ledger_rows(ledger) if r["status"] == "ok"]
    assert len(stages) == len(finished) and any("plan" in s for s in stages)
