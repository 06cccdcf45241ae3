"""Shared by tests/test_killed_runs.py and bench/faults.py: run `qumem run` as a real child process
(LLM = the fake OpenAI server), optionally killed at a named fault point, and fingerprint every
output so a recovered run can be compared with an uninterrupted one.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl

from qumem_pipeline.storage.layout import TMP_PREFIX, DataLayout
from qumem_pipeline.storage.table_store import STORE_COLUMNS

REPO_ROOT = Path(__file__).resolve().parent.parent
# Columns that say when a row was made or how long a call took: they differ between any two runs.
VOLATILE_COLUMNS = {"created_at", "latency_s", "ledger", "mtime_ns"}  # `ledger` (checkpoints) is JSON holding latency_s; mtime_ns: the ingest manifest's file times
USERS = ("ava", "bo", "cy")

TOPICS = [
    ["I adopted a rescue greyhound last week.", "Congratulations!", "He sleeps on the sofa all day.", "Lucky dog."],
    ["I need a vegetarian lasagna recipe for Sunday.", "Here is one.", "I cannot eat mushrooms though.", "Swap in spinach."],
    ["My laptop battery dies after an hour.", "Check the battery health.", "It says 61 percent capacity.", "Replace it."],
]


def write_archive(directory: Path) -> Path:
    """Three users, three topics each (so the classifier makes several episodes per user)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for ui, u in enumerate(USERS):
        for ci, texts in enumerate(TOPICS):
            for i, t in enumerate(texts):
                rows.append({"user_id": u, "conversation_id": f"{u}-c{ci}", "session_id": f"{u}-c{ci}",
                             "role": "user" if i % 2 == 0 else "assistant", "speaker": u if i % 2 == 0 else "assistant",
                             "text": f"{t} ({u})", "timestamp": f"2024-0{ci + 1}-1{ui}T10:0{i}:00Z",
                             "source_ref": f"{u}-c{ci}-{i}"})
    path = directory / "archive.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (directory / "queries.jsonl").write_text("", encoding="utf-8")  # no personalization queries
    return path


def run_pipeline(work: Path, base_url: str, kill_at: str | None = None, timeout: float = 300,
                 data_root: str | None = None, strategy: str = "qumem") -> subprocess.CompletedProcess:
    """`qumem run` over the archive in `work`, data under `work/data` (or `data_root`, e.g. s3://),
    Dagster home `work/home`. `strategy`: qumem by default, the one whose three agents the callers'
    fake servers script (the product default runs in tests/test_dagster_pipeline.py and test_adamem_assets.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update({
        "PYTHONPATH": str(REPO_ROOT), "DAGSTER_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "QUMEM_LLM_KIND": "openai", "QUMEM_LLM_BASE_URL": base_url,
        # the fake server's model: named, so the stage versions do not depend on the server's port
        "QUMEM_LLM_MODEL": "fake-model",
        "QUMEM_QUERIES": str(work / "archive" / "queries.jsonl"),
        "QUMEM_DEVICE": "cpu", "QUMEM_QUERY_STRATEGY": strategy,
    })
    if os.environ.get("QUMEM_CACHE_DIR"):
        env["QUMEM_CACHE_DIR"] = os.environ["QUMEM_CACHE_DIR"]
    if kill_at:
        env["QUMEM_FAULT_KILL_AT"] = kill_at
    cmd = [sys.executable, "-m", "qumem_pipeline.cli", "run", "--archive", str(work / "archive" / "archive.jsonl"),
           "--data-root", data_root or str(work / "data")]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def _rows_digest(rows: list[dict], work: str) -> str:
    # `source_file` holds the archive's absolute path: compared relative to each run's work dir
    lines = sorted(json.dumps(r, sort_keys=True, default=str).replace(work, "<work>") for r in rows)
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def snapshot(data_root: Path) -> dict[str, str]:
    """Content hash of every output under `<work>/data`: each table's current rows per user (volatile
    columns dropped, order-free; FAISS indexes are rows of `indexes`, compared byte for byte), the
    set of users present per table, and each warehouse table's rows."""
    work = str(data_root.parent)
    out: dict[str, str] = {}
    layout = DataLayout(data_root)
    for t in layout.tables():
        df = layout.store.read(t)
        df = df.drop([c for c in df.columns if c in VOLATILE_COLUMNS or c in STORE_COLUMNS and c != "user_key"])
        out[f"table:{t}"] = _rows_digest(df.to_dicts(), work)
    wh = data_root / "warehouse.duckdb"
    if wh.exists():
        with duckdb.connect(str(wh), read_only=True) as con:
            tables = [r[0] for r in con.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema='main' ORDER BY 1").fetchall()]
            for t in tables:
                cur = con.execute(f'SELECT * FROM "{t}"')
                cols = [d[0] for d in cur.description]
                rows = [{c: v for c, v in zip(cols, r) if c not in VOLATILE_COLUMNS} for r in cur.fetchall()]
                out[f"warehouse:{t}"] = _rows_digest(rows, work)
    return out


def temp_files(data_root: Path) -> list[str]:
    return sorted(p.relative_to(data_root).as_posix() for p in data_root.rglob(f"{TMP_PREFIX}*"))


def table_rows(data_root: Path) -> int:
    """Rows over every table of the store (the figure `rows lost` is measured in)."""
    layout = DataLayout(data_root)
    return sum(layout.read_table(t).height if layout.read_table(t) is not None else 0 for t in layout.tables())
