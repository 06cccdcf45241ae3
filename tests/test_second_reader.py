"""A second, independent engine reads every table the store writes (issue 51, item 2).

The store writes with delta-rs, adds its own commit entries (fences, erase epochs) and rewrites
committed log files during a forget. DuckDB's delta extension is delta-kernel-rs, another
implementation: after each kind of commit the store makes (first ingest, incremental append,
replace, compaction with a checkpoint, forget with its log rewrite, vacuum) it must return, for every
table of the root, exactly the rows delta-rs returns. On local disk and on S3 (moto's server).

The reader lives in its own venv (DuckDB 1.4.4 and the extension files from the registry:
scripts/install_delta_reader.sh, which CI runs); system tier.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest
from deltalake import DeltaTable

from qumem_pipeline.ingest.archive import ArchiveConfig
from qumem_pipeline.ingest.sync import sync_archive
from qumem_pipeline.storage.forget import forget_user
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.outside_views import BOOKKEEPING, view_sql
from qumem_pipeline.storage.table_store import STORE_COLUMNS
from tests.conftest import REPO_ROOT, conversation, write_jsonl

READER = os.environ.get("QUMEM_DELTA_READER_PYTHON") or str(REPO_ROOT / ".venv-delta-reader" / "bin" / "python")
EXAMPLE = REPO_ROOT / "examples" / "archive"

pytestmark = pytest.mark.skipif(
    not Path(READER).exists() and not os.environ.get("CI"),
    reason="the delta-kernel-rs reader's venv is not installed: bash scripts/install_delta_reader.sh")


def kernel_read(uris: dict[str, str], out: Path, views: Path | None = None) -> dict[str, pl.DataFrame]:
    """Every table through delta-kernel-rs (the reader's venv), as Parquet handed back."""
    res = subprocess.run([READER, str(REPO_ROOT / "scripts" / "delta_kernel_read.py"), "--out", str(out),
                          *(["--views", str(views)] if views else []),
                          *(f"{n}={u}" for n, u in uris.items())], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    frames = {n: pl.read_parquet(out / f"{n}.parquet") for n in uris}
    assert {n: f.height for n, f in frames.items()} == counts
    return frames


def same_rows(a: pl.DataFrame, b: pl.DataFrame) -> bool:
    """The same multiset of rows, whatever the order (b cast to a's column order and types)."""
    if sorted(a.columns) != sorted(b.columns) or a.height != b.height:
        return False
    b = b.select(a.columns).cast(dict(a.schema))
    key = "__row_hash"
    a = a.with_columns(a.hash_rows(seed=7).alias(key)).sort(key)
    b = b.with_columns(b.hash_rows(seed=7).alias(key)).sort(key)
    return a.equals(b)


def test_the_comparison_tells_one_changed_value():
    a = pl.DataFrame({"user_id": ["a", "b"], "turn_index": [0, 1], "ids": [[1], [2, 3]]})
    assert same_rows(a, a.reverse()) and not same_rows(a, a.with_columns(ids=pl.Series([[1], [2, 4]])))
    assert not same_rows(a, a.head(1)) and not same_rows(a, a.drop("ids"))


def check_every_table(layout: DataLayout, out: Path, step: str) -> dict[str, int]:
    store = layout.store
    tables = store.tables()
    assert tables, "no table to read"
    uris = {t: store.uri(t) for t in tables}
    kernel = kernel_read(uris, out / step)
    rows = {}
    for t, uri in uris.items():
        ours = pl.from_arrow(DeltaTable(uri, storage_options=store.storage_options).to_pyarrow_table())
        assert same_rows(ours, kernel[t]), f"after {step}: {t}: delta-rs {ours.height} rows, delta-kernel-rs {kernel[t].height}"
        rows[t] = ours.height
    # what an outside reader is given: the views (store columns and placeholder rows left out) return
    # what the stages read back (DataLayout.read_table)
    sql = out / f"{step}-views.sql"
    sql.parent.mkdir(parents=True, exist_ok=True)
    sql.write_text(view_sql(store))
    data = [t for t in tables if t not in BOOKKEEPING]
    viewed = kernel_read({t: f"view:{t}" for t in data}, out / f"{step}-views", views=sql)
    for t in data:
        assert not set(STORE_COLUMNS) & set(viewed[t].columns)
        assert same_rows(layout.read_table(t), viewed[t]), f"after {step}: the view of {t}"
    return rows


def run_every_commit_kind(root: str, tmp_path: Path) -> dict[str, dict[str, int]]:
    archive = tmp_path / "archive"
    shutil.copytree(EXAMPLE, archive, ignore=shutil.ignore_patterns("*.md"))
    layout = DataLayout(root)
    cfg = ArchiveConfig(str(archive))
    out, seen = tmp_path / "kernel", {}
    sync_archive(cfg, layout)  # first ingest: every ingest table created
    seen["first_ingest"] = check_every_table(layout, out, "first_ingest")
    users = layout.store.users_in("turns")
    assert len(users) >= 3
    gone = users[0]

    write_jsonl(archive / "zz-new.jsonl", conversation("newcomer", "n1", ["I joined today.", "Welcome!"])
                + conversation(users[-1], "n2", ["One more thing.", "Sure."], start="2025-01-01T00:00:00Z"))
    sync_archive(cfg, layout)  # incremental: new and changed users rebuilt, the manifest appended
    layout.store.append("qumem_events", pl.DataFrame({"user_id": users, "event": ["seen"] * len(users)}))
    seen["incremental_append"] = check_every_table(layout, out, "incremental_append")

    turns = layout.read_table("turns", [users[1]])
    layout.store.replace("turns", {users[1]: turns.head(max(1, turns.height - 1))})  # a predicate overwrite
    seen["replace"] = check_every_table(layout, out, "replace")

    for t in layout.store.tables():
        layout.store.compact(t)
        layout.store.fresh_checkpoint(t)
    seen["compaction_checkpoint"] = check_every_table(layout, out, "compaction_checkpoint")

    report = forget_user(root, None, gone)  # deletes, commit files rewritten without ids, fresh checkpoints
    assert sum(report["log_files_rewritten"].values()) > 0
    seen["forget_log_rewrite"] = check_every_table(layout, out, "forget_log_rewrite")

    for t in layout.store.tables():
        layout.store.vacuum(t, retention_hours=0)
    seen["vacuum"] = check_every_table(layout, out, "vacuum")
    return seen


def test_delta_kernel_reads_what_delta_rs_reads_after_every_commit_kind_local(tmp_path):
    seen = run_every_commit_kind(str(tmp_path / "data"), tmp_path)
    assert seen["first_ingest"]["turns"] > 0 and "forgotten_users" in seen["forget_log_rewrite"]
    assert len(seen["vacuum"]) >= 6  # turns, quarantine, fingerprints, manifest, ..., the registry


def test_delta_kernel_reads_what_delta_rs_reads_after_every_commit_kind_s3(s3_root, tmp_path):
    seen = run_every_commit_kind(s3_root, tmp_path)
    assert seen["first_ingest"]["turns"] > 0 and "forgotten_users" in seen["forget_log_rewrite"]
