"""Erasure under concurrency, on real Delta tables (issue 27): a write whose snapshot predates a
forget never brings the user back, concurrent forgets from separate processes all land, a
warehouse the forget cannot reach fails it loudly (and a rerun completes it), and tombstones are
keyed digests that confirm nothing without the deployment's secret."""

import hashlib
import hmac
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from qumem_pipeline.storage.audit import audit_data_root
from qumem_pipeline.storage.forget import StoreUnreachable, forget_user, record_warehouse
from qumem_pipeline.storage.table_store import TableStore
from qumem_pipeline.storage.tombstones import REGISTRY_TABLE, TombstoneKeyMissing, TombstoneKeyOrphaned, tombstone_keys
from qumem_pipeline.storage.warehouse import Warehouse

REPO_ROOT = Path(__file__).resolve().parent.parent
USERS = [f"user{i}" for i in range(8)]


def _rows(users, tag="v1", n=2):
    return {u: pl.DataFrame({"user_id": [u] * n, "turn_index": list(range(n)),
                             "text": [f"{u} {tag} secret-{u}-{k}" for k in range(n)]}) for u in users}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update(PYTHONPATH=str(REPO_ROOT), QUMEM_TOMBSTONE_KEY="test-secret", **extra)
    return env


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("QUMEM_TOMBSTONE_KEY", "test-secret")
    monkeypatch.delenv("QUMEM_TOMBSTONE_OLD_KEYS", raising=False)


class _PausedWriter(TableStore):
    """A writer that stops after its snapshot and registry read, before its commit."""

    def __init__(self, *a, gate: threading.Event, reached: threading.Event, **kw):
        super().__init__(*a, **kw)
        self.gate, self.reached, self.paused = gate, reached, False

    def _fast_write(self, *a, **kw):
        if not self.paused:
            self.paused = True
            self.reached.set()
            assert self.gate.wait(60)
        return super()._fast_write(*a, **kw)


@pytest.mark.parametrize("existing_rows", [True, False], ids=["replace", "first-write"])
def test_a_write_on_a_snapshot_before_the_forget_never_resurrects(tmp_path, existing_rows):
    root = tmp_path / "data"
    seed = TableStore(root, n_buckets=4)
    seed.replace("memories", _rows(["bob"]))  # the table exists (another user's rows)
    if existing_rows:
        seed.replace("memories", _rows(["alice"]))
    gate, reached = threading.Event(), threading.Event()
    writer = _PausedWriter(root, n_buckets=4, gate=gate, reached=reached)
    errors = []

    def write():
        try:
            writer.replace("memories", _rows(["alice", "carol"], tag="late"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=write)
    t.start()
    assert reached.wait(60), errors  # the writer has its snapshot and has read the registry: alice not forgotten
    forget_user(root, None, "alice")  # returns while the writer is paused
    assert "alice" not in TableStore(root).users_in("memories")
    gate.set()
    t.join(120)
    assert not errors, errors
    store = TableStore(root)
    assert store.users_in("memories") == ["bob", "carol"]  # carol's rows landed, alice's never did
    assert writer.dropped_forgotten["memories"] >= 1
    assert audit_data_root(str(root), "alice", ["secret-alice"])["hits"] == []


FORGET_ONE = """
import sys, time
from pathlib import Path
from qumem_pipeline.storage.forget import forget_user
root, user, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
while not go.exists():
    time.sleep(0.01)
forget_user(root, None, user)
print("forgot", user)
"""


def test_concurrent_forgets_from_separate_processes_all_land(tmp_path):
    """Six forgets released at the same instant (distinct hosts), then the source sends two more
    turns for every user and ingest writes them: none of the six comes back."""
    root, go = tmp_path / "data", tmp_path / "go"
    store = TableStore(root, n_buckets=4)
    for table in ("turns", "fingerprints", "memories"):
        store.replace(table, _rows(USERS))
    gone = USERS[:6]
    procs = [subprocess.Popen([sys.executable, "-c", FORGET_ONE, str(root), u, str(go)],
                              env=_env(QUMEM_HOST_ID=f"host-{i}"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i, u in enumerate(gone)]
    time.sleep(3.0)  # all imported and polling
    go.write_text("go")
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    store = TableStore(root)
    assert store.tombstones().forgotten_among(USERS) == set(gone)  # every tombstone landed
    for table in ("turns", "fingerprints", "memories"):
        store.replace(table, _rows(USERS, tag="v2", n=4))  # the next ingest, all users in the archive
        assert store.users_in(table) == USERS[6:], table
    report = audit_data_root(str(root), None, [f"secret-{u}" for u in gone])
    assert report["hits"] == [] and report["objects_scanned"] > 10
    for u in gone:
        assert audit_data_root(str(root), u, [])["hits"] == [], u


def test_a_cleanup_leaves_a_file_an_unfinished_forget_may_commit(tmp_path):
    """The interleaving behind CI's failure of the test above (a forget's delete failed on a data
    file of the latest version that was not there). Forget A has deleted alice; forget E has
    tombstoned eve and bumped the epoch but not yet deleted her; a delete of bob (B), on a snapshot
    after both, has rewritten the bucket (eve's rows inside) and not yet committed. A's cleanup must
    leave B's file: B's commit conflicts with nothing and lands. Once E finishes, eve is gone."""
    from deltalake import DeltaTable
    from deltalake.transaction import RemoveAction

    from qumem_pipeline.storage.file_commit import commit_append, write_files
    from qumem_pipeline.storage.tombstones import ERASED

    root = tmp_path / "data"
    store = TableStore(root, n_buckets=1)
    store.replace("memories", _rows(["alice", "bob", "eve", "xavier"]))
    tombs = store.tombstones()
    tombs.record(["alice"])  # forget A, up to its delete
    store.bump_erase_epoch("memories")
    seeded = [f"memories/{p}" for p in pl.DataFrame(DeltaTable(store.uri("memories")).get_add_actions()).get_column("path")]
    assert store.delete("memories", ["alice"]) == 2
    tombs.record(["eve"])  # forget E, up to its epoch bump
    store.bump_erase_epoch("memories")

    dt = DeltaTable(store.uri("memories"))  # delete B's snapshot: bob, eve, xavier in one file
    (old,) = pl.DataFrame(dt.get_add_actions(flatten=True)).to_dicts()
    kept = pl.read_parquet(f"{store.uri('memories')}/{old['path']}").filter(pl.col("user_key") != "bob")
    fs, base = store.filesystem()
    adds = write_files(kept.with_columns(pl.lit(0, pl.Int32).alias("user_bucket")), fs, f"{base}/memories",
                       key="user_key", bucket="user_bucket", row_group_rows=1024, target_file_bytes=1 << 30)

    tombs.record(["alice"], action=ERASED)  # forget A finishes
    # the file A's delete replaced goes (alice inside); B's file stays: it holds eve, not erased yet
    assert store.remove_dead_files("memories", ["alice"]) == seeded

    remove = RemoveAction(old["path"], True, int(time.time() * 1000), old["size_bytes"], {"user_bucket": "0"})
    commit_append(dt, [*adds, remove], partition_by=["user_bucket"], commit=None)  # B's commit lands
    assert TableStore(root).users_in("memories") == ["eve", "xavier"]  # every named file is there

    forget_user(root, None, "eve")  # forget E, run again to its end
    assert TableStore(root).users_in("memories") == ["xavier"]
    assert audit_data_root(str(root), None, ["secret-eve", "secret-alice"])["hits"] == []


def test_a_forget_that_cannot_reach_a_warehouse_fails_and_its_rerun_completes(tmp_path, monkeypatch):
    root, wh_path = tmp_path / "data", tmp_path / "elsewhere" / "warehouse.duckdb"
    store = TableStore(root)
    store.replace("turns", _rows(["alice", "bob"]))
    monkeypatch.setenv("QUMEM_HOST_ID", "warehouse-host")
    from qumem_pipeline.storage.layout import DataLayout

    Warehouse(wh_path).load_users(DataLayout(root), ["alice", "bob"], ["turns"])  # records its location
    monkeypatch.setenv("QUMEM_HOST_ID", "other-host")
    with pytest.raises(StoreUnreachable, match="warehouse-host"):
        forget_user(root, None, "alice")
    assert "alice" not in TableStore(root).users_in("turns")  # the tables are erased already
    assert "alice" in Warehouse(wh_path).users("turns")
    monkeypatch.setenv("QUMEM_HOST_ID", "warehouse-host")
    report = forget_user(root, None, "alice")  # the rerun, where the warehouse is
    assert report["warehouse_rows_deleted"][str(wh_path.absolute())]["turns"] == 2
    assert Warehouse(wh_path).users("turns") == ["bob"]
    assert b"secret-alice" not in wh_path.read_bytes()


def test_a_forget_in_another_pod_on_the_same_volume_completes(tmp_path, monkeypatch):
    """Kubernetes: every step is a pod with a hostname of its own; pods mounting the warehouse volume
    share QUMEM_WAREHOUSE_HOST (deploy/k8s), so the forget's pod finds the loads' warehouse "here"."""
    from qumem_pipeline.storage.layout import DataLayout

    root, wh_path = tmp_path / "data", tmp_path / "volume" / "warehouse.duckdb"
    TableStore(root).replace("turns", _rows(["alice", "bob"]))
    monkeypatch.setenv("QUMEM_WAREHOUSE_HOST", "pvc/qumem-warehouse")
    for pod in ("run-1-warehouse-x7k2p", "run-2-warehouse-q9z4m"):
        monkeypatch.setenv("QUMEM_HOST_ID", pod)
        Warehouse(wh_path).load_users(DataLayout(root), ["alice", "bob"], ["turns"])
    monkeypatch.setenv("QUMEM_HOST_ID", "forget-a1b2c")
    report = forget_user(root, wh_path, "alice")
    assert report["warehouse_rows_deleted"][str(wh_path.absolute())]["turns"] == 2
    assert Warehouse(wh_path).users("turns") == ["bob"] and b"secret-alice" not in wh_path.read_bytes()


def test_a_warehouse_load_after_the_forget_drops_the_user(tmp_path):
    """The load reads the registry under the warehouse lock that the forget's delete takes."""
    from qumem_pipeline.storage.layout import DataLayout

    root, wh_path = tmp_path / "data", tmp_path / "warehouse.duckdb"
    layout = DataLayout(root)
    layout.store.replace("turns", _rows(["alice", "bob"]))
    stale = {"turns": layout.read_table("turns", ["alice", "bob"])}  # a load that read before the forget
    forget_user(root, wh_path, "alice")

    class StaleLayout(DataLayout):
        def read_table(self, table, user_ids=None):
            return stale[table]

    Warehouse(wh_path).load_users(StaleLayout(root), ["alice", "bob"], ["turns"])
    assert Warehouse(wh_path).users("turns") == ["bob"]


def test_tombstones_are_keyed_digests(tmp_path, monkeypatch):
    root = tmp_path / "data"
    TableStore(root).replace("turns", _rows(["alice"]))
    forget_user(root, None, "alice")
    reg = TableStore(root).read(REGISTRY_TABLE)
    digests = set(reg.filter(~reg["user_placeholder"])["digest"])
    assert hashlib.sha256(b"alice").hexdigest() not in digests  # an unkeyed digest would confirm the id
    assert len(digests) == 1
    assert TableStore(root).tombstones().forgotten_among(["alice", "bob"]) == {"alice"}
    # rotation: a new key, the old one listed, the tombstone still holds
    monkeypatch.setenv("QUMEM_TOMBSTONE_KEY", "new-secret")
    monkeypatch.setenv("QUMEM_TOMBSTONE_OLD_KEYS", "test-secret")
    assert TableStore(root).tombstones().forgotten_among(["alice"]) == {"alice"}
    # without the old key, the table alone confirms no id; and the registry refuses to be read (the
    # tombstone would match no one: tests/test_tombstone_keys.py)
    monkeypatch.delenv("QUMEM_TOMBSTONE_OLD_KEYS")
    digest = hmac.new(b"new-secret", b"alice", hashlib.sha256).hexdigest()
    assert digest not in digests
    with pytest.raises(TombstoneKeyOrphaned, match="QUMEM_TOMBSTONE_OLD_KEYS"):
        TableStore(root).tombstones().forgotten_among(["alice"])
    monkeypatch.delenv("QUMEM_TOMBSTONE_KEY")
    monkeypatch.setenv("QUMEM_ENV", "production")
    with pytest.raises(TombstoneKeyMissing, match="QUMEM_TOMBSTONE_KEY"):
        tombstone_keys(str(root))
    monkeypatch.delenv("QUMEM_ENV")
    with pytest.raises(TombstoneKeyMissing):
        tombstone_keys("s3://bucket/root")
    assert tombstone_keys(str(root)) == tombstone_keys(str(root))  # a local root: one generated key, kept


def test_readmitted_user_comes_back_on_purpose(tmp_path):
    from qumem_pipeline.storage.forget import ForgetRegistry

    root = tmp_path / "data"
    TableStore(root).replace("turns", _rows(["alice"]))
    forget_user(root, None, "alice")
    ForgetRegistry(root).remove("alice")
    store = TableStore(root)
    store.replace("turns", _rows(["alice"], tag="again"))
    assert store.users_in("turns") == ["alice"]


def test_a_forget_whose_old_checkpoint_another_forget_removed_first_still_lands(tmp_path, monkeypatch):
    """Two forgets list the same Delta log; the other one deletes an old checkpoint first. Seen in a
    suite run as FileNotFoundError out of scrub_log: the file being gone is what the delete wanted."""
    import pyarrow.fs as pafs

    root = tmp_path / "data"
    store = TableStore(root, n_buckets=4)
    for tag in ("v1", "v2", "v3"):
        store.replace("turns", _rows(["alice", "bob"], tag=tag))
        store._open("turns").create_checkpoint()  # older checkpoints for the scrub to remove
    raced: list[str] = []
    real_drop = TableStore.drop_log_file

    def other_forget_first(fs, path):
        fs.delete_file(path)  # the other forget's delete ...
        raced.append(path)
        real_drop(fs, path)  # ... then ours: FileNotFoundError

    monkeypatch.setattr(TableStore, "drop_log_file", staticmethod(other_forget_first))
    forget_user(root, None, "alice")
    assert any("/turns/_delta_log/" in p and ".checkpoint." in p for p in raced), raced  # the race was exercised
    assert all(not Path(p).exists() for p in raced)
    fresh = TableStore(root)
    assert "alice" not in fresh.users_in("turns") and "bob" in fresh.users_in("turns")
    fs, base = fresh.filesystem()
    log = [i for i in fs.get_file_info(pafs.FileSelector(f"{base}/turns/_delta_log")) if i.type == pafs.FileType.File]
    assert not any("alice" in fs.open_input_stream(i.path).read().decode("utf-8", "replace") for i in log
                   if i.base_name.endswith(".json"))


def test_a_sync_that_waited_for_the_lock_through_a_forget_keeps_the_forgotten_file_keyed(tmp_path):
    """The ingest step builds its forget registry, then waits for the ingest lock while a forget erases
    a user and keys their archive file in the manifest: the sync reads the registry again once it
    holds the lock, so it neither reads that file back nor lists it under its plain path."""
    import json

    from qumem_pipeline.ingest.archive import ArchiveConfig
    from qumem_pipeline.ingest.manifest import read_manifest
    from qumem_pipeline.ingest.sync import key_forgotten_files, sync_archive
    from qumem_pipeline.storage.forget import ForgetRegistry
    from qumem_pipeline.storage.layout import DataLayout

    root, archive = tmp_path / "data", tmp_path / "archive"
    archive.mkdir()
    for u in ("alice", "bob"):
        (archive / f"{u}.jsonl").write_text("".join(json.dumps({
            "user_id": u, "conversation_id": "c", "session_id": "s", "turn_index": i, "role": "user", "speaker": u,
            "text": f"secret-{u}-{i}", "timestamp": f"2024-01-01T00:0{i}:00Z", "source_ref": f"r{i}"}) + "\n" for i in range(3)))
    cfg, layout = ArchiveConfig(path=str(archive)), DataLayout(root)
    sync_archive(cfg, layout, forgotten=ForgetRegistry(root))
    read_before_the_lock = ForgetRegistry(root)  # the nightly step's registry, then it waits for the lock
    forget_user(root, None, "alice")
    key_forgotten_files(layout)  # the forget's step: alice's file is named by a keyed digest only
    r = sync_archive(cfg, layout, forgotten=read_before_the_lock)
    assert r.files_read == 0 and r.users_rebuilt == 0
    listed = set(read_manifest(layout))
    assert "bob.jsonl" in listed and "alice.jsonl" not in listed
    assert layout.store.users_in("turns") == ["bob"]


def test_a_failed_write_removes_its_rewrite_of_a_user_erased_meanwhile(tmp_path):
    """W replaces bob on a snapshot taken before alice's forget; its predicate overwrite rewrites the
    bucket's one file, alice's rows in it. The forget erases alice while W writes; W's commit fails on
    the erase epoch and W retries. The file its failed attempt wrote holds erased alice and nothing
    references it: W removes it itself, before the forget's own clean-up runs (which, in the race this
    stands for, listed the bucket before W's file landed)."""
    import pyarrow.parquet as pq

    from qumem_pipeline.storage.forget import scrub_log
    from qumem_pipeline.storage.tombstones import ERASED

    root = tmp_path / "data"
    TableStore(root, n_buckets=1).replace("turns", _rows(["alice", "bob", "carol"]))  # one file: all three
    gate, reached = threading.Event(), threading.Event()

    class PausedWriter(TableStore):  # W, paused once after its snapshot and registry read
        def _fast_write(self, *a, **k):
            if not reached.is_set():
                reached.set()
                gate.wait(60)
            return super()._fast_write(*a, **k)

    w = PausedWriter(root, n_buckets=1)
    th = threading.Thread(target=lambda: w.replace("turns", _rows(["bob"], tag="v2")))
    th.start()
    assert reached.wait(60)
    f = TableStore(root)  # the forget of alice, step by step, up to its clean-up
    f.tombstones().record(["alice"])
    f.bump_erase_epoch("turns")
    f.delete("turns", ["alice"])
    scrub_log(f, "turns", ["alice"])
    f.tombstones().record(["alice"], action=ERASED)
    gate.set()  # W resumes: its rewrite holds alice; the forget's own clean-up comes later, or listed too early
    th.join(120)
    bucket = root / "turns" / "user_bucket=0"
    referenced = {Path(p).name for p in TableStore(root).files("turns")}
    left = {n.name: set(pq.read_table(n).column("user_key").to_pylist()) for n in bucket.glob("*.parquet")
            if n.name not in referenced}
    assert not [n for n, keys in left.items() if "alice" in keys], left
    assert TableStore(root).users_in("turns") == ["bob", "carol"]
    assert audit_data_root(str(root), None, ["secret-alice"])["hits"] == []


def test_a_killed_syncs_spill_files_are_removed_by_the_forget(tmp_path, monkeypatch):
    """A sync killed after it spilled leaves users' raw turns in its scratch directory on this host;
    the forget's manifest step takes the same host's ingest lock and removes them (so does the next
    sync), so the forgotten user's text is left in no scratch file."""
    import json
    import tempfile

    from qumem_pipeline.ingest.sync import key_forgotten_files
    from qumem_pipeline.storage.layout import DataLayout

    root, archive, tmpdir = tmp_path / "data", tmp_path / "archive", tmp_path / "tmpdir"
    archive.mkdir()
    tmpdir.mkdir()
    (archive / "alice.jsonl").write_text("".join(json.dumps({
        "user_id": "alice", "conversation_id": "c1", "session_id": "s1", "turn_index": i, "role": "user",
        "speaker": "Alice", "text": f"secret-alice-{i}", "timestamp": f"2024-01-01T00:{i:02d}:00Z",
        "source_ref": f"r{i}"}) + "\n" for i in range(50)))
    child = (
        "import os\n"
        "from qumem_pipeline.ingest.archive import ArchiveConfig\n"
        "from qumem_pipeline.ingest.sync import sync_archive\n"
        "from qumem_pipeline.storage.layout import DataLayout\n"
        "def killed(turns, quarantine): os._exit(9)  # killed after the spill, before any commit\n"
        f"sync_archive(ArchiveConfig(path={str(archive)!r}), DataLayout({str(root)!r}), memory_bytes=1, before_commit=killed)\n")
    rc = subprocess.run([sys.executable, "-c", child], env=_env(TMPDIR=str(tmpdir))).returncode
    assert rc == 9

    def holding(needle: bytes) -> list[Path]:
        return [p for p in tmpdir.rglob("*") if p.is_file() and needle in p.read_bytes()]

    assert holding(b"secret-alice-"), "the killed sync spilled nothing: the test would prove nothing"
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    layout = DataLayout(root)
    layout.store.replace("turns", _rows(["alice"]))  # what an earlier sync had written of her
    forget_user(root, None, "alice")
    key_forgotten_files(layout)  # the forget job's manifest step, under this host's ingest lock
    assert holding(b"secret-alice-") == []


def test_a_forget_rewrites_the_parquet_exports_made_before_it(tmp_path, monkeypatch):
    """`qumem export` copies the warehouse's tables out of the data root; the folder is recorded first,
    so the forget rewrites each file that holds the user without their rows, and the audit reads it."""
    from qumem_pipeline.storage.audit import audit_export
    from qumem_pipeline.storage.layout import DataLayout

    root, wh_path, out = tmp_path / "data", tmp_path / "warehouse.duckdb", tmp_path / "exports" / "nightly"
    monkeypatch.setenv("QUMEM_HOST_ID", "here")
    layout = DataLayout(root)
    layout.store.replace("turns", _rows(["alice", "bob"]))
    wh = Warehouse(wh_path)
    wh.load_users(layout, ["alice", "bob"], ["turns"])
    written = wh.export_parquet(out, store=layout.store)
    assert audit_export(str(out), "alice", ["secret-alice"])["hits"]  # the audit sees the copy
    report = forget_user(root, wh_path, "alice")
    assert report["export_rows_deleted"] == {str(out.absolute()): {"turns.parquet": 2}}
    assert audit_export(str(out), "alice", ["secret-alice"])["hits"] == []
    assert sorted(pl.read_parquet(written["turns"])["user_id"].unique().to_list()) == ["bob"]
    assert forget_user(root, wh_path, "alice")["export_rows_deleted"] == {str(out.absolute()): {}}  # a rerun: nothing left
    # a folder on a host this one cannot reach fails the forget, as a warehouse there does
    monkeypatch.setenv("QUMEM_HOST_ID", "export-host")
    wh.export_parquet(tmp_path / "exports" / "elsewhere", store=layout.store)
    monkeypatch.setenv("QUMEM_HOST_ID", "here")
    with pytest.raises(StoreUnreachable, match="export folder.*export-host"):
        forget_user(root, wh_path, "bob")


def _checkpoints(root: Path, table: str) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in (root / table / "_delta_log").glob("*.checkpoint.parquet"))


def test_the_store_checkpoints_every_interval_itself(tmp_path, monkeypatch):
    """delta-rs' post-commit hook takes no checkpoint (the store does: `_after_commit`), so a table
    read does not replay every commit since the first."""
    from qumem_pipeline.storage import table_store as ts

    monkeypatch.setattr(ts, "CHECKPOINT_INTERVAL", 4)
    root = tmp_path / "data"
    store = TableStore(root, n_buckets=2)
    for i in range(9):  # versions 0 (create) .. 9
        store.replace("turns", _rows(["alice", "bob"], tag=f"v{i}"))
    assert _checkpoints(root, "turns") == [4, 8]
    assert TableStore(root).read("turns", ["bob"])["text"].to_list() == ["bob v8 secret-bob-0", "bob v8 secret-bob-1"]


def test_a_checkpoint_written_after_the_forget_scrubbed_the_log_names_no_one(tmp_path, monkeypatch):
    """W's commit is due a checkpoint; W reads the log for it (alice's statistics in it) and its write
    lands late: alice's whole forget runs meanwhile (epoch, delete, log scrub, erased). W's checkpoint
    of its old snapshot names alice and appears after the scrub; W sees the registry moved,
    checkpoints the latest version again and removes the older checkpoints, its own among them.
    (When delta-rs' post-commit hook wrote checkpoints, such a late one stayed until a second forget.)"""
    from qumem_pipeline.storage import table_store as ts

    monkeypatch.setattr(ts, "CHECKPOINT_INTERVAL", 4)
    root = tmp_path / "data"
    log = root / "turns" / "_delta_log"
    plain = TableStore(root, n_buckets=1)
    plain.replace("turns", _rows(["alice", "bob"]))  # versions 0 (create) and 1: one file, both users
    plain.replace("turns", _rows(["carol"]))  # 2
    plain.replace("turns", _rows(["carol"], tag="v2"))  # 3
    gate, reached, late = threading.Event(), threading.Event(), []

    class SlowCheckpointer(TableStore):
        def _checkpoint(self, dt):
            super()._checkpoint(dt)
            if reached.is_set():
                return
            # read from the log now, but not yet landed: held back until the forget has run
            held = {p: p.read_bytes() for p in (log / f"{dt.version():020d}.checkpoint.parquet", log / "_last_checkpoint")}
            assert b"alice" in next(iter(held.values()))
            for p in held:
                p.unlink()
            late.append(dt.version())
            reached.set()
            assert gate.wait(60)
            for p, data in held.items():
                p.write_bytes(data)

    w = SlowCheckpointer(root, n_buckets=1)
    errors = []

    def write():
        try:
            w.replace("turns", _rows(["bob"], tag="v2"))  # version 4: due a checkpoint
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=write)
    th.start()
    assert reached.wait(60), errors
    forget_user(root, None, "alice")
    gate.set()
    th.join(120)
    assert not errors and late == [4]
    assert audit_data_root(str(root), "alice", ["secret-alice"])["hits"] == []
    assert min(_checkpoints(root, "turns")) > 4  # W's own late checkpoint went with the others
    assert TableStore(root).users_in("turns") == ["bob", "carol"]
