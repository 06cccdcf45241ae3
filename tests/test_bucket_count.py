"""One bucket count per deployment: QUMEM_BUCKETS is the table store's N and the user_buckets partitions';
QUMEM_USER_BUCKETS (its earlier name) is still read and must agree, or start-up stops with one line
naming both."""

import os
import subprocess
import sys

import pytest

from qumem_pipeline.contracts.buckets import BucketCountConflict, configured_buckets
from qumem_pipeline.storage.table_store import TableStore
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("env, n", [
    ({}, None),
    ({"QUMEM_BUCKETS": "16"}, 16),
    ({"QUMEM_USER_BUCKETS": "16"}, 16),  # the earlier name alone still works
    ({"QUMEM_BUCKETS": "16", "QUMEM_USER_BUCKETS": "16"}, 16),
])
def test_one_count_from_either_name(env, n):
    assert configured_buckets(env) == n


@pytest.mark.parametrize("env", [{"QUMEM_BUCKETS": "64", "QUMEM_USER_BUCKETS": "32"},
                                 {"QUMEM_BUCKETS": "sixty"}, {"QUMEM_BUCKETS": "0"}])
def test_a_disagreeing_or_bad_count_is_refused(env):
    with pytest.raises(BucketCountConflict) as e:
        configured_buckets(env)
    assert "QUMEM_BUCKETS" in str(e.value) and "\n" not in str(e.value)
    if "QUMEM_USER_BUCKETS" in env:
        assert "QUMEM_USER_BUCKETS=32" in str(e.value) and "QUMEM_BUCKETS=64" in str(e.value)


def test_the_table_store_and_the_partitions_read_the_same_knob(tmp_path, monkeypatch):
    monkeypatch.delenv("QUMEM_USER_BUCKETS", raising=False)
    monkeypatch.setenv("QUMEM_BUCKETS", "8")
    assert TableStore(tmp_path / "data").buckets_of("turns") == 8  # a new table gets the deployment's count
    code = ("import os; os.environ['QUMEM_PARTITION_SCHEME'] = 'user_buckets'; import assets.partitions as p; "
            "print(p.N_BUCKETS, len(p.users_partitions.get_partition_keys()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "QUMEM_BUCKETS": "8"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["8", "8"]


def test_definitions_refuse_to_load_when_the_two_names_disagree():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "QUMEM_BUCKETS": "64", "QUMEM_USER_BUCKETS": "32"}
    r = subprocess.run([sys.executable, "-c", "import assets.definitions"], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "BucketCountConflict" in last and "QUMEM_BUCKETS=64" in last and "QUMEM_USER_BUCKETS=32" in last
