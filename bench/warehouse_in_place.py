"""Warehouse: copy the Delta tables into DuckDB (shipped) or read them in place (issue 51, item 2)?

One run, one box, one generated store: an archive of `--turns` turns of `--users` users (bench/ingest.py's
generator, plus a file of bad rows for the quarantine) ingested by the product (`sync_archive`), and
memories written by the product's store (`DataLayout.replace_users`, in run-sized batches; SYNTHETIC, no
LLM: one per fourth user turn citing it, every 20th user none, so the table has placeholder rows). Then:

- (a) `refresh_s`: the product's warehouse refresh (`Warehouse.load_users` of every user +
  `load_unattributed`, what the `warehouse` asset runs) into a fresh DuckDB file; `run_refresh_s`: one
  run's refresh of `--run-users` users into the loaded file; `forget_rewrite_s`: `Warehouse.delete_user`
  of one user (a forget rewrites the whole file so no freed page keeps their text: a cost only a copy has);
- (b) `copy`: the analyst queries (bench/_warehouse_queries.py) on the copied file, DuckDB 2.x (project venv);
- (c) `in_place`: the same queries over the Delta tables through `delta_scan` (DuckDB 1.4.4 and the
  registry's delta extension, `.venv-delta-reader`), through the outside views (storage/outside_views.py:
  store columns and placeholder rows hidden), so the rows are the warehouse's;
- (d) `copy_v144`: the same queries on the copied file opened by DuckDB 1.4.4. 1.4.4 cannot open the
  product's file (written in DuckDB 2.x's storage format), so the file is copied once more by DuckDB 2.x
  with `STORAGE_VERSION 'v1.4.0'` (`compat_copy_s`); `copy_v140_format` runs 2.x on that same file, so
  the format's effect is separated from the engine's.

Each mode runs in a fresh process per round (`--rounds`, interleaved); a query's `cold_s` is its first
run in that process, `warm_s` the median of its later runs (`--reps`), and each mode keeps its lowest
figures over rounds (the box is shared: noise only adds). Every figure comes in wall seconds (`*_s`) and in
CPU seconds of its process, all threads (`*_cpu_s`): on a box where other work takes the cores, wall time
mostly measures waiting, and the decision reads CPU. The OS page cache is warm for every mode (the
files were just written), so cold = engine and metadata start, not disk. `ratios`: each mode's seconds
over `copy`'s, per query and total, cold and warm; `in_place_vs_copy_same_engine` = in_place / copy_v144;
`breakeven_suites`: how many warm runs of the whole query set pay for one full refresh in CPU seconds
(refresh CPU / (in-place - copy) per suite); `results_agree`: every mode returned the same rows (digests) for every query. `seen`: per table, rows of the
Delta table as an engine reads it raw, through the view, and in the warehouse (placeholders = raw - view).

    nice -n 19 .venv/bin/python bench/warehouse_in_place.py --json
    nice -n 19 .venv/bin/python bench/warehouse_in_place.py --turns 10000000 --users 10000 --json   # scaled up (default 1M turns, 1,000 users)

Needs the reader's venv (bash scripts/install_delta_reader.sh; QUMEM_DELTA_READER_PYTHON to point elsewhere).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ingest import generate  # noqa: E402
from qumem_pipeline.contracts.schema import UNATTRIBUTED  # noqa: E402
from qumem_pipeline.ingest.archive import ArchiveConfig  # noqa: E402
from qumem_pipeline.ingest.sync import sync_archive  # noqa: E402
from qumem_pipeline.memories.parsing import MEMORY_SCHEMA  # noqa: E402
from qumem_pipeline.memories.prompts import MEMORY_TYPES  # noqa: E402
from qumem_pipeline.storage.layout import DataLayout  # noqa: E402
from qumem_pipeline.storage.outside_views import BOOKKEEPING, view_sql  # noqa: E402
from qumem_pipeline.storage.table_store import STORE_COLUMNS  # noqa: E402
from qumem_pipeline.storage.warehouse import Warehouse  # noqa: E402

QUERIES = ROOT / "bench" / "_warehouse_queries.py"
READER = os.environ.get("QUMEM_DELTA_READER_PYTHON") or str(ROOT / ".venv-delta-reader" / "bin" / "python")
KINDS = ("cold", "warm", "cold_cpu", "warm_cpu")  # wall and CPU seconds of a query's first and later runs
BATCH_USERS = 500  # users per memories commit, as a run of the bucket scheme writes them


def bad_rows(archive: Path) -> int:
    """A file of rows the ingest quarantines: empty text (attributed), invalid user ids (unattributed)."""
    rows = [{"user_id": "user-000001", "conversation_id": "c-bad", "session_id": "c-bad", "role": "user",
             "text": "", "timestamp": "2024-01-01T00:00:00Z", "source_ref": f"bad{i}"} for i in range(20)]
    rows += [{"user_id": "no such user!", "conversation_id": "c-x", "session_id": "c-x", "role": "user",
              "text": "hello", "timestamp": "2024-01-01T00:00:00Z", "source_ref": f"x{i}"} for i in range(10)]
    (archive / "zz-bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def write_memories(layout: DataLayout, users: list[str]) -> int:
    """Synthetic memories through the product's store, one commit per BATCH_USERS users."""
    n = 0
    for i in range(0, len(users), BATCH_USERS):
        batch = users[i:i + BATCH_USERS]
        t = layout.read_table("turns", batch)
        mem = (t.filter((pl.col("role") == "user") & (pl.col("turn_index") % 8 == 0)
                        & (pl.col("user_id").str.slice(-2).cast(pl.Int64, strict=False).fill_null(1) % 20 != 0))
               .select(memory_id=pl.col("user_id") + "-m" + pl.col("turn_index").cast(pl.String),
                       user_id="user_id",
                       type=pl.lit(list(MEMORY_TYPES)).list.get(pl.col("turn_index") // 8 % len(MEMORY_TYPES)),
                       content="I said: " + pl.col("text"),
                       episode_id=pl.col("conversation_id"),
                       evidence_turn_ids=pl.concat_list("turn_index"),
                       position="turn_index",
                       valid_from="timestamp",
                       model=pl.lit("synthetic-bench"), prompt_version=pl.lit("synthetic"),
                       code_version=pl.lit("synthetic"), created_at="timestamp")
               .cast(dict(MEMORY_SCHEMA)))
        layout.replace_users("memories", batch, mem)
        n += mem.height
    return n


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_queries(python: str, args: list[str], user: str, reps: int, counts: str = "") -> dict:
    cmd = [python, str(QUERIES), *args, "--user", user, "--reps", str(reps), *(["--counts", counts] if counts else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"warehouse_in_place: {' '.join(cmd[1:3])} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def best(runs: list[dict]) -> dict:
    """Per query, the lowest cold and warm over rounds (digests must not differ between rounds)."""
    out = {"duckdb": runs[0]["duckdb"], "connect_s": min(r["connect_s"] for r in runs),
           "connect_cpu_s": min(r["connect_cpu_s"] for r in runs), "queries": {}}
    for q in runs[0]["queries"]:
        got = [r["queries"][q] for r in runs]
        if len({g["digest"] for g in got}) != 1:
            raise SystemExit(f"warehouse_in_place: {q} returned different rows between rounds")
        out["queries"][q] = {**{f"{k}_s": min(g[f"{k}_s"] for g in got) for k in KINDS},
                             "rows": got[0]["rows"], "digest": got[0]["digest"]}
    for k in KINDS:
        out[f"total_{k}_s"] = round(sum(v[f"{k}_s"] for v in out["queries"].values()), 4)
    if "counts" in runs[0]:
        out["counts"] = runs[0]["counts"]
    return out


def ratios(mode: dict, base: dict) -> dict:
    r = {q: {k: round(v[f"{k}_s"] / max(base["queries"][q][f"{k}_s"], 1e-4), 2) for k in KINDS}
         for q, v in mode["queries"].items()}
    r["total"] = {k: round(mode[f"total_{k}_s"] / base[f"total_{k}_s"], 2) for k in KINDS}
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=1_000_000)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--run-users", type=int, default=100, help="users of one run's refresh")
    p.add_argument("--reps", type=int, default=4, help="runs of each query per process (first cold)")
    p.add_argument("--rounds", type=int, default=2, help="processes per mode, interleaved")
    p.add_argument("--work", help="keep the store here (default: a temporary folder, removed)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not Path(READER).exists():
        raise SystemExit(f"warehouse_in_place: no reader venv at {READER} (bash scripts/install_delta_reader.sh)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="wh-in-place-"))
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    out: dict = {"turns": args.turns, "users": args.users}
    try:
        archive, data = work / "archive", work / "data"
        for d in (archive, data, work / "warehouse"):  # a kept --work folder starts over
            shutil.rmtree(d, ignore_errors=True)
        generate(archive, args.turns, args.users)
        out["bad_rows"] = bad_rows(archive)
        layout = DataLayout(data)
        t = time.perf_counter()
        sync_archive(ArchiveConfig(str(archive)), layout)
        out["ingest_s"] = round(time.perf_counter() - t, 2)
        users = layout.users_in("turns")
        t = time.perf_counter()
        out["memories"] = write_memories(layout, users)
        out["memories_s"] = round(time.perf_counter() - t, 2)
        say(f"store: {args.turns} turns, {out['memories']} memories ({out['ingest_s']} s + {out['memories_s']} s)")

        # (a) the product's refresh into a fresh file, then one run's refresh, sizes
        wh_path = work / "warehouse" / "warehouse.duckdb"
        wh = Warehouse(wh_path)
        t, c = time.perf_counter(), time.process_time()
        wh.load_users(layout, users)
        wh.load_unattributed(layout, UNATTRIBUTED)
        out["refresh_s"], out["refresh_cpu_s"] = round(time.perf_counter() - t, 2), round(time.process_time() - c, 2)
        t, c = time.perf_counter(), time.process_time()
        wh.load_users(layout, users[:args.run_users])
        out["run_refresh_s"], out["run_refresh_cpu_s"] = round(time.perf_counter() - t, 2), round(time.process_time() - c, 2)
        out["warehouse_mb"] = round(wh_path.stat().st_size / 2**20, 1)
        out["delta_mb"] = round(du(data) / 2**20, 1)
        say(f"refresh {out['refresh_cpu_s']} CPU s, run of {args.run_users} users {out['run_refresh_cpu_s']} CPU s")

        # (d) the copy in 1.4.4's storage format, by DuckDB 2.x (not a product step)
        import duckdb

        compat = work / "warehouse_v140.duckdb"
        compat.unlink(missing_ok=True)
        t = time.perf_counter()
        con = duckdb.connect()
        con.execute(f"ATTACH '{compat}' AS n (STORAGE_VERSION 'v1.4.0')")
        con.execute(f"ATTACH '{wh_path}' AS o (READ_ONLY)")
        con.execute("COPY FROM DATABASE o TO n")
        con.close()
        out["compat_copy_s"] = round(time.perf_counter() - t, 2)
        probe = subprocess.run([READER, "-c", f"import duckdb; duckdb.connect('{wh_path}', read_only=True)"],
                               capture_output=True, text=True)
        out["v144_opens_product_file"] = probe.returncode == 0
        out["v144_open_error"] = (probe.stderr.strip().splitlines() or [""])[-1][:200] if probe.returncode else None

        views = work / "views.sql"
        views.write_text(view_sql(layout.store))
        data_tables = [t for t in layout.store.tables() if t not in BOOKKEEPING]
        # the one-user queries' user: from the middle, one with memories (every 20th user has none)
        user = next(u for u in users[len(users) // 2:] + users if int(u[-2:]) % 20)
        modes = {
            "copy": (sys.executable, ["--db", str(wh_path)]),
            "in_place": (READER, ["--views", str(views)]),
            "copy_v144": (READER, ["--db", str(compat)]),
            "copy_v140_format": (sys.executable, ["--db", str(compat)]),
        }
        runs: dict[str, list] = {m: [] for m in modes}
        for _ in range(max(1, args.rounds)):
            for m, (py, a) in modes.items():
                runs[m].append(run_queries(py, a, user, args.reps, ",".join(data_tables) if m == "in_place" else ""))
                say(f"{m}: total warm {sum(v['warm_cpu_s'] for v in runs[m][-1]['queries'].values()):.3f} CPU s")
        res = {m: best(r) for m, r in runs.items()}
        out["modes"] = res
        out["ratios"] = {m: ratios(res[m], res["copy"]) for m in modes if m != "copy"}
        out["in_place_vs_copy_same_engine"] = ratios(res["in_place"], res["copy_v144"])
        digests = {q: {m: res[m]["queries"][q]["digest"] for m in modes} for q in res["copy"]["queries"]}
        out["results_agree"] = all(len(set(d.values())) == 1 for d in digests.values())
        if not out["results_agree"]:
            out["digests"] = digests
        # warm query suites after which the copy's full refresh has paid for itself, in CPU seconds
        # (null: in place is not slower)
        extra = res["in_place"]["total_warm_cpu_s"] - res["copy"]["total_warm_cpu_s"]
        out["breakeven_suites"] = round(out["refresh_cpu_s"] / extra, 1) if extra > 0 else None

        # what an in-place reader sees against the warehouse
        from deltalake import DeltaTable

        wh_counts = wh.counts()
        seen = {}
        for t in data_tables:
            dt = DeltaTable(layout.store.uri(t))
            raw = dt.to_pyarrow_dataset().count_rows()
            view = res["in_place"]["counts"][t]
            seen[t] = {"delta_rows": raw, "view_rows": view, "placeholder_rows": raw - view,
                       "warehouse_rows": wh_counts.get(t)}
        out["seen"] = seen
        out["store_columns_raw"] = sorted(set(STORE_COLUMNS) & set(DeltaTable(layout.store.uri("turns")).schema().to_arrow().names))
        out["warehouse_only_tables"] = sorted(set(wh_counts) - set(data_tables))
        out["views_match_warehouse"] = all(s["view_rows"] == s["warehouse_rows"] for t, s in seen.items() if s["warehouse_rows"] is not None)

        t, c = time.perf_counter(), time.process_time()
        wh.delete_user(users[0])
        out["forget_rewrite_s"], out["forget_rewrite_cpu_s"] = round(time.perf_counter() - t, 2), round(time.process_time() - c, 2)
        say(json.dumps({k: out[k] for k in ("refresh_cpu_s", "run_refresh_cpu_s", "forget_rewrite_cpu_s", "results_agree",
                                            "views_match_warehouse", "breakeven_suites")}))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return 0 if out.get("results_agree") and out.get("views_match_warehouse") else 1


if __name__ == "__main__":
    sys.exit(main())
