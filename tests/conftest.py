import json
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pytest

from qumem_pipeline.runtime.processes import MOTO_S3_ENV, moto_s3

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One torch thread per test process: the suite's many small forwards spend two threads' time waking each other
# (measured on the idle 2-core box, fresh clone: the default tier 1,405 s with two threads, 644 s with one).
os.environ.setdefault("QUMEM_LLM_THREADS", "1")
# The deployment secret that keys forget tombstones (object-store roots refuse to forget without one).
os.environ.setdefault("QUMEM_TOMBSTONE_KEY", "qumem-tests-tombstone-secret")
# CLI evaluations read and grow eval_record/ by default; tests' fake models must not write there
# (tests/test_eval_record.py names the record it uses).
os.environ.setdefault("QUMEM_EVAL_RECORD", "off")

REPO_ROOT = Path(__file__).resolve().parent.parent

# A short episode (turns 4-6) shared by the real-model LLM tests.
SWIM_EPISODE = {
    "user_id": "alice",
    "episode_id": "alice-e0",
    "turns": [
        {"turn_index": 4, "role": "user", "speaker": "Alice", "text": "I just joined a swimming club near my office.",
         "timestamp": datetime(2024, 1, 1, 9, 0, tzinfo=timezone.utc)},
        {"turn_index": 5, "role": "assistant", "speaker": None, "text": "Nice! What made you pick it?",
         "timestamp": datetime(2024, 1, 1, 9, 1, tzinfo=timezone.utc)},
        {"turn_index": 6, "role": "user", "speaker": "Alice",
         "text": "The coaches are supportive and nobody pushes you to compete. I avoid stressful gyms.",
         "timestamp": datetime(2024, 1, 1, 9, 2, tzinfo=timezone.utc)},
    ],
}


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows may be dicts (serialised) or raw bytes (written as-is, for broken lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else json.dumps(r).encode("utf-8"))
            f.write(b"\n")
    return path


def conversation(user: str, conv: str, texts: list[str], start: str = "2024-03-01T10:00:00Z", **extra) -> list[dict]:
    """Alternating user/assistant turns with increasing source refs."""
    rows = []
    for i, t in enumerate(texts):
        rows.append(
            {
                "user_id": user,
                "conversation_id": conv,
                "session_id": conv,
                "role": "user" if i % 2 == 0 else "assistant",
                "speaker": user if i % 2 == 0 else "assistant",
                "text": t,
                "timestamp": start,
                "source_ref": f"{conv}-{i}",
                **extra,
            }
        )
    return rows


@pytest.fixture
def small_archive(tmp_path: Path) -> Path:
    """Three users, a few turns each, in two files."""
    d = tmp_path / "archive"
    write_jsonl(
        d / "a.jsonl",
        conversation("alice", "c1", ["I'm planning a trip to Lisbon.", "Great choice!", "I prefer window seats.", "Noted."])
        + conversation("bob", "c2", ["My dog is sick.", "Sorry to hear.", "The vet says rest.", "Good."]),
    )
    write_jsonl(
        d / "b.jsonl",
        conversation("chen", "c3", ["I started learning piano.", "Nice!", "Scales are hard.", "Keep going."], start="2024-04-01T09:00:00Z"),
    )
    return d


@pytest.fixture
def dagster_env(tmp_path: Path, monkeypatch):
    """Point the resources at a temporary data root; returns (data_root, set_archive)."""
    data_root = tmp_path / "data"
    monkeypatch.setenv("QUMEM_DATA_ROOT", str(data_root))
    monkeypatch.delenv("QUMEM_WAREHOUSE", raising=False)
    monkeypatch.delenv("QUMEM_ARCHIVE_FORMAT", raising=False)

    def set_archive(path: Path) -> None:
        monkeypatch.setenv("QUMEM_ARCHIVE", str(path))

    return data_root, set_archive


@contextmanager
def local_instance(home: Path):
    """A persistent (SQLite) Dagster instance in `home`, disposed afterwards; no process-global state."""
    import dagster as dg

    home.mkdir(parents=True, exist_ok=True)
    inst = dg.DagsterInstance.local_temp(str(home))
    try:
        yield inst
    finally:
        inst.dispose()


# ------------------------------------------------------------------ S3 on loopback (moto's real server)
S3_BUCKET = "qumem-test"
S3_ENV = MOTO_S3_ENV


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """moto's standalone S3 server (`moto[server]`, pinned) as a child process on a free loopback
    port with the tests' bucket, stopped at teardown. Yields the endpoint URL."""
    pytest.importorskip("moto.server")
    with open(tmp_path_factory.mktemp("moto") / "moto.log", "wb") as log, moto_s3(log, buckets=(S3_BUCKET,)) as endpoint:
        yield endpoint


@pytest.fixture
def s3_root(moto_server, monkeypatch, request):
    """A fresh `s3://` data root on the moto server; the AWS_* variables delta-rs and pyarrow read are
    set for this process and inherited by its children."""
    import uuid

    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": moto_server}.items():
        monkeypatch.setenv(k, v)
    return f"s3://{S3_BUCKET}/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


def s3_objects(endpoint: str, root: str) -> dict[str, bytes]:
    """Every object under an s3:// root, key -> bytes."""
    import boto3

    bucket, _, prefix = root[len("s3://"):].partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


# --- test tiers ---------------------------------------------------------------------------------
# README's test command runs the `default` tier (the whole product, in about ten minutes on two
# cores); the `system` tier holds the heavy system tests — a real browser on the Dagster UI, a real
# vLLM server, killed and faulted runs, the benches' smoke runs, PostgreSQL, two-host recovery —
# and `.ci/run` runs it after the default tier, so CI drops nothing. A file named on the command
# line always runs whatever its tier.
SYSTEM_TIER = frozenset({
    "test_ui_browser.py",
    "test_llm_vllm.py",
    "test_killed_runs.py",
    "test_bench_smoke.py",
    "test_postgres_instance.py",
    "test_recovery.py",
    "test_erasure_interleavings.py",
    "test_eval_stop.py",
    "test_cli_forget.py",
    "test_second_reader.py",
    "test_personamem_record.py",
})


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("default", "system", "all"), default="default",
                     help="default: everything but the system tier; system: only it; all: both")


def pytest_configure(config):
    config.addinivalue_line("markers", "system: heavy system test, run by `pytest --tier system` (CI runs both tiers)")


def _named_files(config) -> set[str]:
    return {Path(a.split("::")[0]).name for a in config.args if a.split("::")[0].endswith(".py")}


def pytest_collection_modifyitems(config, items):
    tier, named = config.getoption("--tier"), _named_files(config)
    keep, drop = [], []
    for item in items:
        system = item.path.name in SYSTEM_TIER
        if system:
            item.add_marker(pytest.mark.system)
        wanted = tier == "all" or item.path.name in named or (tier == "system") == system
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
