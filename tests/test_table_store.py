"""The Delta table store on real Delta tables: layout, pruning, schema rule, single-commit replace
under a SIGKILL mid-write, concurrent writers in separate processes, maintenance, and the blocking
check gate (a failing check commits nothing)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from deltalake import DeltaTable

from qumem_pipeline.contracts.buckets import user_bucket
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.table_store import BucketMismatchError, SchemaEvolutionError, TableStore
from tests.conftest import REPO_ROOT, conversation, write_jsonl

pytestmark = pytest.mark.timeout(600)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_WAIT_POLICY="PASSIVE")


def _rows(users, n=3, tag="v1"):
    return pl.DataFrame({"user_id": [u for u in users for _ in range(n)],
                         "text": [f"{u}-{tag}-{i}" for u in users for i in range(n)],
                         "turn_index": [i for _ in users for i in range(n)]})


def test_layout_buckets_sorting_and_recorded_bucket_count(tmp_path):
    store = TableStore(tmp_path, n_buckets=8)
    users = [f"user{i:02d}" for i in range(40)]
    store.replace_keyed("turns", users, _rows(users[::-1]))  # rows arrive in reverse user order
    dt = DeltaTable(str(tmp_path / "turns"))
    assert dt.metadata().partition_columns == ["user_bucket"]
    # the table is created empty (no rows: a forget's epoch can fence it), then one commit for 40 users
    assert [h["operation"] for h in dt.history()] == ["WRITE", "CREATE TABLE"]
    files = dt.file_uris()
    assert len(files) == len({user_bucket(u, 8) for u in users}) <= 8  # one file per touched bucket, never per user
    for f in files:  # rows sorted by user inside every file, every row in its own bucket
        df = pl.read_parquet(f)
        assert df["user_key"].to_list() == sorted(df["user_key"].to_list())
        bucket = int(Path(f).parent.name.split("=")[1])
        assert {user_bucket(u, 8) for u in df["user_key"]} == {bucket}
    # the bucket count is fixed for the table's life
    assert TableStore(tmp_path).buckets_of("turns") == 8
    with pytest.raises(BucketMismatchError, match="8 user buckets.*configured with 64"):
        TableStore(tmp_path, n_buckets=64).read("turns", ["user01"])


def test_read_prunes_to_the_users_bucket(tmp_path):
    store = TableStore(tmp_path, n_buckets=16)
    users = [f"u{i}" for i in range(30)]
    store.replace_keyed("turns", users, _rows(users))
    target = "u7"
    mine = user_bucket(target, 16)
    # Break every file of every other bucket: a read of u7 still works, so it opened none of them.
    for f in store.files("turns"):
        if f"user_bucket={mine}/" not in f:
            Path(f).write_bytes(b"not parquet")
    got = store.read("turns", [target])
    assert got["text"].to_list() == [f"{target}-v1-{i}" for i in range(3)]
    with pytest.raises(Exception):
        store.read("turns")  # the full scan does hit the broken files


def test_schema_rule_new_nullable_columns_added_else_clear_error(tmp_path):
    layout = DataLayout(tmp_path)
    layout.replace_users("episodes", ["a", "b"], _rows(["a", "b"]))
    layout.replace_users("episodes", ["b"], _rows(["b"], tag="v2").with_columns(score=pl.lit(0.5)))
    a, b = layout.read_user_table("episodes", "a"), layout.read_user_table("episodes", "b")
    assert a["score"].to_list() == [None] * 3 and b["score"].to_list() == [0.5] * 3
    # a later write without the new column fills it with nulls, it does not drop it
    layout.replace_users("episodes", ["b"], _rows(["b"], tag="v3"))
    assert layout.read_user_table("episodes", "b")["score"].to_list() == [None] * 3
    with pytest.raises(SchemaEvolutionError, match=r"column 'turn_index' is Int64 in the store but String"):
        layout.replace_users("episodes", ["a"], _rows(["a"]).with_columns(pl.col("turn_index").cast(pl.String)))
    assert layout.read_user_table("episodes", "a")["text"].to_list() == ["a-v1-0", "a-v1-1", "a-v1-2"]
    # logical dtypes Delta cannot hold (fixed-size arrays, unsigned ints) come back as written
    emb = pl.DataFrame({"user_id": ["a"], "e": pl.Series([[1.0, 2.0]], dtype=pl.Array(pl.Float32, 2)),
                        "n": pl.Series([3], dtype=pl.UInt32)})
    layout.replace_users("emb", ["a"], emb)
    assert layout.read_user_table("emb", "a").equals(emb)


def test_replace_users_is_one_commit_and_sparse_tables_drop_users(tmp_path):
    layout = DataLayout(tmp_path)
    layout.replace_users("quarantine", ["a", "b", "c"], _rows(["a", "b"]))
    assert layout.users_in("quarantine") == ["a", "b", "c"]  # c recorded present-and-empty
    assert layout.read_user_table("quarantine", "c").height == 0
    layout.replace_or_remove_users("quarantine", ["a", "b", "c"], _rows(["b"], tag="v2"))
    assert layout.users_in("quarantine") == ["b"]
    assert layout.read_table("quarantine")["text"].to_list() == ["b-v2-0", "b-v2-1", "b-v2-2"]
    # two commits: the first creates the table with its files (nothing to remove: the add-only
    # path), the second replaces through delta-rs (rows to take out)
    ops = [h["operation"] for h in DeltaTable(str(tmp_path / "quarantine")).history()]
    assert ops == ["WRITE", "WRITE", "CREATE TABLE"]  # created empty, then the rows
    assert layout.store.write_paths == {"add_only": 1, "delta_rs": 1}  # skipped, not raced: no second open
    with pytest.raises(ValueError, match="outside this replace"):
        layout.replace_users("quarantine", ["a"], _rows(["a", "zed"]))


def test_add_only_replace_that_races_another_writer_keeps_one_copy(tmp_path, monkeypatch):
    """Another writer commits the same users between our check and our add-only commit: both copies
    land, the post-commit check sees the other's file (RACED) and the rows are replaced through
    delta-rs, so the users end with this write's rows, once."""
    from qumem_pipeline.storage import table_store

    layout = DataLayout(tmp_path)
    layout.replace_users("quarantine", ["z"], _rows(["z"]))  # the table exists: the add-only append path
    real, fired = table_store.write_files, []

    def racing_write_files(*args, **kwargs):
        adds = real(*args, **kwargs)
        if not fired:  # once: the other writer's whole replace lands before our commit
            fired.append(True)
            other = DataLayout(tmp_path)
            other.replace_users("quarantine", ["a", "b"], _rows(["a", "b"], tag="other"))
            assert other.store.write_paths == {"add_only": 1}
        return adds

    monkeypatch.setattr(table_store, "write_files", racing_write_files)
    layout.replace_users("quarantine", ["a", "b"], _rows(["a", "b"], tag="mine"))
    assert fired and layout.store.write_paths == {"add_only": 1, "add_only_raced": 1}
    got = layout.read_table("quarantine").sort("text")["text"].to_list()
    assert got == sorted([f"{u}-mine-{i}" for u in "ab" for i in range(3)] + ["z-v1-0", "z-v1-1", "z-v1-2"])


WRITER = """
import sys, time
import polars as pl
from qumem_pipeline.storage.layout import DataLayout
root, users = sys.argv[1], sys.argv[2].split(",")
n = int(sys.argv[3])
layout = DataLayout(root)
rows = pl.DataFrame({"user_id": [u for u in users for _ in range(n)],
                     "text": [f"{u}-new-{i}-" + "x" * 200 for u in users for i in range(n)],
                     "turn_index": [i for _ in users for i in range(n)]})
print("writing", flush=True)
layout.replace_users("turns", users, rows)
print("done", flush=True)
"""


def _data_files(table_dir: Path) -> set[Path]:
    return {p for p in table_dir.rglob("*") if p.is_file() and "_delta_log" not in p.parts}


def test_replace_killed_mid_write_leaves_previous_version_complete(tmp_path):
    """SIGKILL while the new files are being written (some already on disk, no commit yet): the table
    is still at the previous version, which reads back complete; a rerun then lands."""
    root = tmp_path / "data"
    layout = DataLayout(root, n_buckets=4)
    users = [f"user{i}" for i in range(8)]
    layout.replace_users("turns", users, _rows(users))
    before = layout.read_table("turns")
    version = layout.store.version("turns")
    table_dir = root / "turns"
    old_files = _data_files(table_dir)
    killed_mid_write = False
    for attempt in range(6):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), ",".join(users), str(150_000)],
                             env=_env(), stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            if _data_files(table_dir) - old_files:  # new data is on disk
                break
            time.sleep(0.005)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        fresh = DataLayout(root)
        if p.returncode == -signal.SIGKILL and fresh.store.version("turns") == version:
            killed_mid_write = bool(_data_files(table_dir) - old_files)
            if killed_mid_write:
                break
        assert fresh.store.version("turns") in (version, version + 1)
        if fresh.store.version("turns") != version:  # the write won the race: start again from a new base
            layout.replace_users("turns", users, _rows(users))
            before, version, old_files = layout.read_table("turns"), layout.store.version("turns"), _data_files(table_dir)
    assert killed_mid_write, "never managed to kill the writer between its first data file and its commit"
    fresh = DataLayout(root)
    assert fresh.store.version("turns") == version
    assert fresh.read_table("turns").equals(before)  # previous version, complete
    # the orphaned files are outside the log: vacuum removes them, and a rerun writes cleanly
    assert fresh.store.vacuum("turns", retention_hours=0)
    assert _data_files(table_dir) == set(map(Path, fresh.store.files("turns")))
    out = subprocess.run([sys.executable, "-c", WRITER, str(root), ",".join(users), "5"], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert DataLayout(root).read_table("turns")["text"].str.contains("-new-").all()


CONCURRENT = """
import sys, time
import polars as pl
from qumem_pipeline.storage.layout import DataLayout
root, who, go = sys.argv[1], sys.argv[2], sys.argv[3]
layout = DataLayout(root, n_buckets=2)
while not __import__("os").path.exists(go):
    time.sleep(0.001)
for i in range(12):
    users = [f"{who}{i}-{j}" for j in range(3)]
    rows = pl.DataFrame({"user_id": [u for u in users for _ in range(2)], "text": [f"{u}:{k}" for u in users for k in range(2)]})
    layout.replace_users("turns", users, rows)
print("done", flush=True)
"""


def test_two_processes_on_disjoint_users_both_land(tmp_path):
    """Two writers committing at the same moment into the same 2 buckets: conflict-checked, retried, all land."""
    root, go = tmp_path / "data", tmp_path / "go"
    DataLayout(root, n_buckets=2).replace_users("turns", ["seed"], pl.DataFrame({"user_id": ["seed"], "text": ["s"]}))
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(root), who, str(go)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for who in ("A", "B")]
    time.sleep(2.0)  # both imported and waiting
    go.write_text("go")
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    layout = DataLayout(root)
    df = layout.read_table("turns")
    expected = {f"{w}{i}-{j}" for w in "AB" for i in range(12) for j in range(3)} | {"seed"}
    assert set(df["user_id"]) == expected
    assert df.height == 2 * (len(expected) - 1) + 1
    assert layout.store.version("turns") == 25  # creation, the seed + 12 commits of each writer, none lost


def test_compact_and_vacuum_keep_the_rows(tmp_path):
    layout = DataLayout(tmp_path, n_buckets=2)
    for i in range(6):
        layout.replace_users("turns", [f"u{i}"], _rows([f"u{i}"]))
    before = layout.read_table("turns")
    n_files = len(layout.store.files("turns"))
    layout.store.compact("turns")
    assert len(layout.store.files("turns")) < n_files <= 6
    removed = layout.store.vacuum("turns", retention_hours=0)
    assert len(removed) == n_files
    assert layout.read_table("turns").equals(before)
    assert _data_files(tmp_path / "turns") == set(map(Path, layout.store.files("turns")))


def test_failing_blocking_check_commits_nothing(tmp_path, monkeypatch):
    """The turns asset on a run whose quarantine exceeds the ceiling: the check fails, the store keeps
    the previous version (no commit), and downstream does not run."""
    from assets.ingest import turns
    from resources import PipelineConfig

    archive = tmp_path / "archive"
    write_jsonl(archive / "a.jsonl", conversation("alice", "c1", ["hi", "hello", "plans?", "sure"]))
    data = tmp_path / "data"
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", ["alice"])

    def run(max_fraction):
        cfg = PipelineConfig(data_root=str(data), archive_path=str(archive), max_quarantine_fraction=max_fraction)
        return dg.materialize([turns], instance=instance, resources={"pipeline": cfg}, partition_key="alice",
                              raise_on_error=False)

    assert run(0.2).success
    layout = DataLayout(data)
    version, before = layout.store.version("turns"), layout.read_user_table("turns", "alice")
    # new bad rows for alice: 2 of 6 rows quarantined > 0.2
    write_jsonl(archive / "b.jsonl", [{"user_id": "alice", "conversation_id": "c2", "role": "robot", "text": "x"},
                                      {"user_id": "alice", "conversation_id": "c2", "role": "user", "text": ""}])
    result = run(0.2)
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"schema_conforms": True, "quarantine_under_ceiling": False}
    fresh = DataLayout(data)
    # no data commit: the only commits since are the sync's lease fence (no files added or removed)
    history = fresh.store._open("turns").history()[: fresh.store.version("turns") - version]
    assert all(not (h.get("operationMetrics") or {}).get("num_added_files")
               and not (h.get("operationMetrics") or {}).get("num_removed_files") for h in history), history
    assert fresh.read_user_table("turns", "alice").equals(before)
    assert fresh.read_user_table("quarantine", "alice") is None  # the new bad rows were not published either
    assert run(0.5).success  # a passing check publishes
    assert DataLayout(data).read_user_table("quarantine", "alice").height == 2


def test_maintenance_job_compacts_and_keeps_rows(tmp_path, monkeypatch):
    import importlib

    monkeypatch.setenv("QUMEM_DATA_ROOT", str(tmp_path / "data"))
    layout = DataLayout(tmp_path / "data", n_buckets=2)
    for i in range(5):
        layout.replace_users("turns", [f"u{i}"], _rows([f"u{i}"]))
    before, n_files = layout.read_table("turns"), len(layout.store.files("turns"))
    import assets.definitions as d

    defs = importlib.reload(d).build_definitions()
    job = defs.resolve_job_def("table_maintenance_job")
    short = job.execute_in_process(instance=dg.DagsterInstance.ephemeral(), raise_on_error=False,
                                   run_config={"ops": {"maintain_tables_op": {"config": {"retention_hours": 0}}}})
    assert not short.success  # under 7 days needs an explicit opt-in
    r = job.execute_in_process(instance=dg.DagsterInstance.ephemeral(), run_config={"ops": {"maintain_tables_op": {
        "config": {"retention_hours": 0, "allow_short_retention": True}}}})
    assert r.success
    fresh = DataLayout(tmp_path / "data")
    assert len(fresh.store.files("turns")) <= 2 < n_files and fresh.read_table("turns").equals(before)
    assert _data_files(tmp_path / "data" / "turns") == set(map(Path, fresh.store.files("turns")))


def _break_row_groups_without(path: str, users: list[str]) -> int:
    """Overwrite the column chunks of every row group of a Parquet file whose user_key range holds
    none of `users` with garbage (its footer intact): a reader that decodes such a group fails."""
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    ki = md.schema.names.index("user_key")
    spans = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        st = rg.column(ki).statistics
        if not any(st.min <= u <= st.max for u in users):
            for j in range(rg.num_columns):
                c = rg.column(j)
                start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                spans.append((start, c.total_compressed_size))
    with open(path, "r+b") as f:
        for start, size in spans:
            f.seek(start)
            f.write(b"\xff" * size)
    return len(spans)


@pytest.mark.parametrize("reader", ["polars", "pyarrow"])
def test_user_read_decodes_only_row_groups_holding_the_users(tmp_path, monkeypatch, reader):
    """Files are sorted by user_key in small row groups; a read of a few users decodes only the
    row groups whose key range holds one of them (pyarrow's isin filter would decode them all) and
    returns exactly the rows a full read filtered to those users gives. Proved by breaking every
    other row group's pages after the full read: the user read still succeeds. Both readers: polars
    on a local root (its own statistics pruning), pyarrow with footers pruned here (object stores)."""
    import pyarrow.parquet as pq
    from deltalake import WriterProperties

    from qumem_pipeline.storage import table_store

    monkeypatch.setattr(table_store, "POLARS_LOCAL_READS", reader == "polars")
    monkeypatch.setattr(table_store, "_WRITER", WriterProperties(compression="ZSTD", max_row_group_size=6))
    monkeypatch.setattr(table_store, "ROW_GROUP_ROWS", 6)  # the add-only path's writer (file_commit)
    store = TableStore(tmp_path, n_buckets=2)
    users = [f"user{i:02d}" for i in range(40)]
    store.replace_keyed("turns", users, _rows(users))  # 3 rows per user, 2 users per row group
    assert all(pq.ParquetFile(f).metadata.num_row_groups > 5 for f in store.files("turns"))
    wanted = ["user03", "user17", "user38"]
    full = store.read("turns")
    broken = sum(_break_row_groups_without(f.removeprefix("file://"), wanted) for f in store.files("turns"))
    assert broken > 0
    with pytest.raises(Exception):  # the broken groups cannot be decoded
        TableStore(tmp_path).read("turns")
    got = TableStore(tmp_path).read("turns", wanted)
    assert got.equals(full.filter(pl.col("user_key").is_in(wanted)))
    assert got["user_key"].unique().sort().to_list() == wanted
    assert TableStore(tmp_path).read("turns", ["nobody"]).height == 0


def test_local_user_reads_scan_each_file_for_its_own_buckets_users_and_agree_with_pyarrow(tmp_path, monkeypatch):
    """On a local root a user read scans each file of the touched buckets for that bucket's users only
    (bench/store_reads.py: one scan with the whole list cost more) and returns exactly what the pyarrow
    path returns: files from several commits, one written before a column was added (its rows get the
    column as nulls), the bucket column from each file's partition, any column subset."""
    from qumem_pipeline.storage import table_store

    store = TableStore(tmp_path, n_buckets=4)
    a, b = [f"user{i:02d}" for i in range(0, 20)], [f"user{i:02d}" for i in range(20, 40)]
    store.replace_keyed("t", a, _rows(a))
    store.replace_keyed("t", b, _rows(b).with_columns(extra=pl.lit("x")))  # a column added later
    store.append("t", _rows(["user03", "user33"], n=2, tag="v2").with_columns(turn_index=pl.col("turn_index") + 3))
    assert len(store.files("t")) >= 10
    wanted = ["user03", "user07", "user18", "user22", "user33", "user39", "nobody"]
    for cols in (None, ["text"], [], ["extra", "user_bucket"]):
        monkeypatch.setattr(table_store, "POLARS_LOCAL_READS", True)
        got = TableStore(tmp_path).read("t", wanted, columns=cols)
        monkeypatch.setattr(table_store, "POLARS_LOCAL_READS", False)
        want = TableStore(tmp_path).read("t", wanted, columns=cols)
        assert got.columns == want.columns and got.schema == want.schema
        key = [c for c in ("user_key", "turn_index") if c in got.columns]
        assert got.sort(key, maintain_order=True).equals(want.sort(key, maintain_order=True)), cols
    full = TableStore(tmp_path).read("t")
    assert got.height == full.filter(pl.col("user_key").is_in(wanted)).height == 3 * 6 + 2 * 2
    assert got.filter(pl.col("user_key") == "user03")["extra"].to_list() == [None] * 5
    assert got.filter(pl.col("user_key") == "user39")["extra"].to_list() == ["x"] * 3
    assert got.group_by("user_key").agg(pl.col("user_bucket").n_unique())["user_bucket"].to_list() == [1] * 6
