"""`qumem migrate-storage`: a per-user Parquet root (the layout before the table store) moved into
Delta tables, lossless: row counts and content hashes equal per user and table, indexes searchable."""

import json
import subprocess
import sys
from datetime import datetime, timezone

import faiss
import numpy as np
import polars as pl
import pytest

from qumem_pipeline.index import vector_store as vi
from qumem_pipeline.storage.forget import ForgetRegistry, _digest
from qumem_pipeline.storage.layout import DataLayout, atomic_write_parquet
from qumem_pipeline.storage.migrate import MigrationMismatch, content_hash, migrate_storage
from tests.conftest import REPO_ROOT

T = datetime(2024, 1, 1, tzinfo=timezone.utc)


def _old_root(root):
    """An old-layout root: several tables, a user written empty, the unattributed quarantine, a column
    only some users have, nested and binary types, FAISS files and checkpoint batch files."""
    def put(table, user, df, name="part-0.parquet"):
        atomic_write_parquet(df, root / table / f"user_id={user}" / name)

    for i, u in enumerate(["alice", "bob", "chen"]):
        put("turns", u, pl.DataFrame({"user_id": [u] * 3, "turn_index": [0, 1, 2], "text": [f"{u} says {k}" for k in range(3)],
                                      "timestamp": [T] * 3}))
        put("episodes", u, pl.DataFrame({"user_id": [u], "episode_id": [f"{u}-e0"], "turn_ids": [[0, 1, 2]]}))
        emb = pl.DataFrame({"user_id": [u] * 2, "memory_id": [f"{u}-m0", f"{u}-m1"], "type": ["fact", "insight"],
                            "position": [0, 1], "embedding_model": ["m@0"] * 2,
                            "embedding": pl.Series(np.eye(2, 4, k=i, dtype=np.float32).tolist(), dtype=pl.Array(pl.Float32, 4))})
        put("memory_embeddings", u, emb)
        ux = vi.build_user_indexes(emb, u, use_gpu=False)
        for t in vi.MEMORY_TYPES:
            (root / "indexes" / f"user_id={u}").mkdir(parents=True, exist_ok=True)
            faiss.write_index(ux.by_type[t].index, str(root / "indexes" / f"user_id={u}" / f"{t}.faiss"))
        put("index_ids", u, ux.idmap_frame())
    put("turns", "dora", pl.DataFrame(schema={"user_id": pl.String, "turn_index": pl.Int64, "text": pl.String,
                                              "timestamp": pl.Datetime("us", "UTC")}))  # all rows quarantined
    put("quarantine", "dora", pl.DataFrame({"user_id": ["dora"], "field": ["role"], "raw": [b"\xff bad"]}))
    put("quarantine", "__unattributed__", pl.DataFrame({"user_id": ["../etc"], "field": ["user_id"], "raw": [b"x"]}))
    put("memories", "alice", pl.DataFrame({"user_id": ["alice"], "memory_id": ["alice-m0"], "content": ["likes tea"]}))
    put("memories", "bob", pl.DataFrame({"user_id": ["bob"], "memory_id": ["bob-m0"], "content": ["runs"],
                                         "confidence": [0.9]}))  # a column alice's file never got
    for n in range(2):
        put("memory_checkpoints", "alice", pl.DataFrame({"key": [f"k{n}"], "user_id": ["alice"], "status": ["ok"]}),
            name=f"batch-run-{n:06d}.parquet")
    (root / "_meta").mkdir()
    (root / "_meta" / "forgotten.json").write_text(json.dumps([_digest("eve")]))
    (root / "turns" / "user_id=alice" / ".tmp-123-dead.parquet").write_bytes(b"half")  # a crash's leftover


def test_migration_is_lossless(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _old_root(old)
    report = migrate_storage(old, new, chunk_users=2)
    layout = DataLayout(new)
    assert set(layout.tables()) == {"turns", "episodes", "memory_embeddings", "indexes", "index_ids", "quarantine",
                                    "memories", "memory_checkpoints", "forgotten_users"}
    for table, r in report.items():
        if table == "forgotten_users":
            continue
        assert r["source_hash"] == r["store_hash"], table
        src_rows = sum(pl.read_parquet(p).height for p in (old / table).glob("user_id=*/*.parquet")
                       if not p.name.startswith(".tmp-")) if table != "indexes" else 3 * 3
        assert r["rows"] == src_rows, table
    assert report["turns"] == {**report["turns"], "users": 4, "rows": 9, "commits": 2}
    # content, read back through the interface the stages use
    for u in ("alice", "bob", "chen"):
        src = pl.read_parquet(old / "turns" / f"user_id={u}" / "part-0.parquet")
        assert layout.read_user_table("turns", u).equals(src)
        assert layout.read_user_table("memory_embeddings", u).equals(
            pl.read_parquet(old / "memory_embeddings" / f"user_id={u}" / "part-0.parquet"))
        ux = vi.load_user_indexes(layout, u)  # the FAISS bytes load and agree with the id map
        assert ux.by_type["fact"].ntotal == 1 and ux.by_type["insight"].ntotal == 1
    assert layout.read_user_table("turns", "dora").height == 0  # present and empty stays so
    assert layout.read_user_table("quarantine", "__unattributed__")["user_id"].to_list() == ["../etc"]
    assert layout.read_user_table("memories", "alice")["confidence"].to_list() == [None]
    assert sorted(layout.read_user_table("memory_checkpoints", "alice")["key"]) == ["k0", "k1"]
    assert ForgetRegistry(new).contains("eve")
    assert ForgetRegistry(new).tombstones.erased_among(["eve", "alice"]) == {"eve"}  # deleted by the old layout


@pytest.mark.parametrize("tamper, message", [
    (lambda df: None, r"turns/bob: 2 rows in the source, None in the store"),
    (lambda df: df.head(1), r"turns/bob: 2 rows in the source, 1 in the store"),
    (lambda df: df.with_columns(pl.lit("changed").alias("text")), r"turns/bob: content hash differs"),
    (lambda df: df.drop("text"), r"columns \['text'\] did not reach the store"),
], ids=["user_missing", "row_missing", "content_changed", "column_missing"])
def test_mismatch_is_detected(tmp_path, monkeypatch, tamper, message):
    a = pl.DataFrame({"x": [1, 2], "s": ["a", "b"]})
    assert content_hash(a) == content_hash(a.reverse()) != content_hash(a.with_columns(pl.lit("c").alias("s")))
    with pytest.raises(FileNotFoundError):
        migrate_storage(tmp_path / "missing", tmp_path / "new")
    old = tmp_path / "old"
    for u in ("alice", "bob"):
        atomic_write_parquet(pl.DataFrame({"user_id": [u] * 2, "turn_index": [0, 1], "text": [f"{u} 0", f"{u} 1"]}),
                             old / "turns" / f"user_id={u}" / "part-0.parquet")
    migrate_storage(old, tmp_path / "clean")  # untampered, the same source verifies
    read_users = DataLayout.read_users

    def tampered(self, table, users):  # the store loses or alters bob's rows between write and verification
        back = read_users(self, table, users)
        if "bob" in back and (df := tamper(back["bob"])) is not None:
            back["bob"] = df
        else:
            back.pop("bob", None)
        return back

    monkeypatch.setattr(DataLayout, "read_users", tampered)
    with pytest.raises(MigrationMismatch, match=message):
        migrate_storage(old, tmp_path / "new")


def test_cli_migrate_storage(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _old_root(old)
    r = subprocess.run([sys.executable, "-m", "qumem_pipeline.cli", "migrate-storage", "--from", str(old),
                        "--data-root", str(new), "--json"], capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["turns"]["rows"] == 9 and all(v["source_hash"] == v["store_hash"] for k, v in report.items()
                                                  if k != "forgotten_users")
    assert DataLayout(new).users_in("turns") == ["alice", "bob", "chen", "dora"]
