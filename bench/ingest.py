"""Ingest bench: streaming, incremental ingest of a generated multi-file archive, against two
plain-polars baselines over the same files, measured in the same run.

Per configuration (`--turns`, one or more; default 1,000,000), each measured phase runs in a
child process of its own, so its peak RSS (getrusage of that child) is its own:

`--repeat N` runs the three timed phases (baseline, contract, ingest) N times, interleaved, and reports
each one's median round (`rounds_s` lists them all); the phases after read the last round's data root.

- `baseline`: `pl.scan_ndjson(files).sink_parquet(one file)` (polars streaming engine);
- `contract`: the passes the ingest's contract cannot avoid, in plain polars: read every file
  (with its path and row number), one content hash (a polars hash of each row's content columns),
  a sort by user and history order (user, parsed timestamp, file, row), and one Parquet write
  bucketed by user (64 buckets, `sink_parquet(pl.PartitionBy(...))`). No validation, quarantine,
  duplicates, provenance, manifest, fingerprints per user, Delta commits or bounded memory (the
  sort is in memory): `ratio_contract` = contract seconds / ingest seconds says how close the
  ingest is to the work its output requires;
- `ingest`: `sync_archive` into a fresh data root: read in blocks, validate, spill by user bucket,
  merge, write every table, fingerprints, manifest;
- `incremental`: one new file of 10,000 turns (later turns of 100 existing users) added to the
  ingested archive, then `sync_archive` again (change detection over every file + ingest); done
  `INCREMENTAL_RUNS` times, each with a further new file, and the median run reported (one run of
  ~1 s moved by a tenth between runs), with its steps (`incremental_stages_s`: lock and lease, plan,
  manifest writes, read, take (the staged rows of a merge group gathered, read back when spilled),
  merge, fingerprints, writes; the full ingest's are `ingest_stages_s`);
- `read`: 100 users' turns read back through DataLayout (best of 3);
- `hash`: the content-hash (BLAKE3) + line-count pass over the archive's files that every ingest
  of new files makes (the manifest's content hash; rows must be lines), alone: `ratio_ceiling` =
  baseline / (baseline + this pass) bounds `ratio` from above with everything else of the ingest free;
- `readers` (first configuration only): the candidate bounded readers timed over the same files;
- `writers` (first configuration only): the ingested turns table written again by delta-rs'
  writer and by the store's add-only path (storage/file_commit.py), CPU seconds each.

Keys of the last JSON line (figures of the largest configuration): `ratio` (baseline seconds /
ingest seconds), `ratio_contract` (contract seconds / ingest seconds), `cpu_ratio` and
`cpu_ratio_contract` (the same with CPU seconds: each phase's own, all threads, measured in its
child as a before/after difference, so interpreter start-up and imports are not in it), `peak_rss_mb`
(ingest child), `incremental_ratio` (incremental seconds / full ingest seconds), `files_per_table`;
with two configurations also `rss_growth` (peak of the largest / peak of the smallest) and
`read_ratio_<largest>_vs_<smallest>` (100-user read, largest / smallest; sizes in turns as `10m`, `100k`
or the plain count: `read_ratio_10m_vs_1m` for `--turns 1000000 10000000`); `configs` holds every
configuration's figures. Every phase imports its modules before its clock starts.

    python bench/ingest.py [--turns 1000000 [10000000]] [--users-per-1m 1000] [--repeat 3] [--json]
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("trip plan dinner vegan window seat swim run knee doctor budget book piano lesson "
         "weekend flight hotel recipe garden dog cat meeting deadline report coffee tea").split()
TURNS_PER_FILE = 1_000_000
NEW_FILE_TURNS = 10_000
INCREMENTAL_RUNS = 3
READ_USERS = 100


def _frame(users: np.ndarray, t: np.ndarray, seed: int) -> pl.DataFrame:
    """Rows for (user number, turn number) pairs: alternating roles, 40-turn conversations, ISO times."""
    rng = np.random.default_rng(seed)
    n = len(users)
    lens = rng.integers(6, 31, n)
    idx = rng.integers(0, len(WORDS), (n, 30))
    words = np.array(WORDS)[idx]
    text = [" ".join(w[:k]) for w, k in zip(words, lens)]
    uid = pl.Series("u", users).cast(pl.String).str.zfill(6)
    epoch = 1_700_000_000 + users * 60 + t * 37
    return pl.DataFrame({
        "user_id": "user-" + uid,
        "conversation_id": "user-" + uid + "-c" + pl.Series(t // 40).cast(pl.String),
        "role": np.where(t % 2 == 0, "user", "assistant"),
        "text": text,
        "timestamp": pl.Series(epoch * 1_000_000).cast(pl.Datetime("us")).dt.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source_ref": "m" + pl.Series(t).cast(pl.String),
    }).with_columns(session_id=pl.col("conversation_id"),
                    speaker=pl.when(pl.col("role") == "user").then(pl.col("user_id")).otherwise(pl.lit("assistant")))


def generate(archive: Path, n_turns: int, n_users: int) -> list[Path]:
    """Files by period: file k holds every user's k-th slice of turns (users span all files)."""
    archive.mkdir(parents=True)
    per_user = n_turns // n_users
    n_files = max(2, n_turns // TURNS_PER_FILE)
    cuts = np.linspace(0, per_user, n_files + 1).astype(int)
    files = []
    users_per_block = max(1, 200_000 // max(1, per_user // n_files))
    for k in range(n_files):
        path = archive / f"period-{k:03d}.jsonl"
        with open(path, "wb") as f:
            for u0 in range(0, n_users, users_per_block):
                us = np.arange(u0, min(n_users, u0 + users_per_block))
                t = np.arange(cuts[k], cuts[k + 1])
                uu, tt = np.repeat(us, len(t)), np.tile(t, len(us))
                _frame(uu, tt, seed=k * 100_003 + u0).write_ndjson(f)
        files.append(path)
    return files


def add_new_file(archive: Path, n_turns: int, n_users: int, k: int = 0) -> Path:
    """10,000 later turns of the first 100 users, in a file that sorts after the others (the k-th
    such file holds the turns after the (k-1)-th's)."""
    per_user, each = n_turns // n_users, NEW_FILE_TURNS // READ_USERS
    users = np.repeat(np.arange(READ_USERS), each)
    t = np.tile(np.arange(per_user + k * each, per_user + (k + 1) * each), READ_USERS)
    path = archive / f"period-999-new-{k}.jsonl"
    _frame(users, t, seed=999 + k).write_ndjson(path)
    return path


def files_per_table(data: Path) -> dict[str, int]:
    """Data files (*.parquet) under each table's directory of the data root (either backend:
    per-user Parquet files, or a Delta table's data files; its _delta_log is not counted)."""
    return {d.name: sum(1 for p in d.rglob("*.parquet") if "_delta_log" not in p.parts)
            for d in sorted(data.iterdir()) if d.is_dir() and not d.name.startswith("_")}


# ---------------------------------------------------------------- child phases
def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime  # this process, all threads


def phase(name: str, work: Path) -> dict:
    """One phase in this (child) process. Its modules are imported before the clock starts, so no phase
    pays import time the baseline does not; `seconds` and `cpu_s` (this process's user + system CPU, all
    threads, as a difference) cover the phase alone, not interpreter start-up or imports; `peak_rss_mb`
    is the process's peak (imports included)."""
    from qumem_pipeline.ingest.archive import ArchiveConfig
    from qumem_pipeline.ingest.stream import _hash_and_count_lines, content_hasher
    from qumem_pipeline.ingest.sync import sync_archive
    from qumem_pipeline.storage.layout import DataLayout

    archive, data = work / "archive", work / "data"
    out: dict = {}
    c = _cpu_s()
    t = time.perf_counter()
    if name == "baseline":
        pl.scan_ndjson(sorted(archive.glob("*.jsonl"))).sink_parquet(work / "baseline.parquet", compression="zstd")
        out["rows"] = pl.scan_parquet(work / "baseline.parquet").select(pl.len()).collect().item()
    elif name == "contract":
        out["rows"] = contract_baseline(sorted(archive.glob("*.jsonl")), work / "contract")
    elif name in ("ingest", "incremental"):
        r = sync_archive(ArchiveConfig(str(archive)), DataLayout(data))
        out.update(files_read=r.files_read, users_rebuilt=r.users_rebuilt, rows_read=r.rows_read,
                   quarantined=r.quarantined_read, new=len(r.new), unchanged=r.unchanged, stages_s=r.stages_s,
                   spilled_bytes=r.spilled_bytes)
    elif name == "read":
        layout = DataLayout(data)
        users = sorted(layout.users_in("turns"))[:READ_USERS]
        best = float("inf")
        for _ in range(3):
            t1 = time.perf_counter()
            df = layout.read_table("turns", users)
            best = min(best, time.perf_counter() - t1)
        out.update(rows=df.height, users=len(users), best_s=round(best, 4))
    elif name == "readers":
        out.update(compare_readers(sorted(archive.glob("*.jsonl"))))
    elif name == "writers":
        out.update(compare_writers(data, work / "writers"))
    elif name == "hash":
        out["lines"] = sum(_hash_and_count_lines(f, content_hasher()) for f in sorted(archive.glob("*.jsonl")))
    out["seconds"] = round(time.perf_counter() - t, 3)
    out["cpu_s"] = round(_cpu_s() - c, 2)  # the phase's own CPU, all threads: steadier than wall time on a busy box
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


CONTENT = ["user_id", "conversation_id", "session_id", "role", "speaker", "text", "timestamp", "source_ref"]


def contract_baseline(files: list[Path], out: Path, buckets: int = 64) -> int:
    """The contract's unavoidable passes in plain polars (see the module doc); rows written."""
    lf = pl.scan_ndjson(files, row_index_name="_row", include_file_paths="_file").with_columns(
        timestamp=pl.col("timestamp").str.to_datetime("%Y-%m-%dT%H:%M:%SZ", strict=False, time_unit="us", time_zone="UTC"),
        _content_hash=pl.struct(CONTENT).hash(),
        _bucket=pl.col("user_id").hash(seed=0) % buckets,
    ).sort("_bucket", "user_id", "timestamp", "_file", "_row")
    lf.sink_parquet(pl.PartitionBy(out, key="_bucket", include_key=False), compression="zstd", mkdir=True)
    return pl.scan_parquet(out / "**" / "*.parquet").select(pl.len()).collect().item()


def compare_readers(files: list[Path]) -> dict:
    """Seconds to read every file in bounded pieces, per candidate reader (rows must agree)."""
    import pyarrow.json as paj

    from qumem_pipeline.ingest.stream import DEFAULT_CHUNK_BYTES, read_batches

    res = {}

    def timed(key, fn):
        t = time.perf_counter()
        n = fn()
        res[key] = {"seconds": round(time.perf_counter() - t, 3), "rows": n}

    timed("qumem_blocks_polars_read_ndjson", lambda: sum(b.raw.height for f in files for b in read_batches(f, "jsonl")))
    timed("pyarrow_json_open_json", lambda: sum(
        batch.num_rows for f in files for batch in paj.open_json(f, read_options=paj.ReadOptions(block_size=DEFAULT_CHUNK_BYTES))))
    timed("polars_scan_ndjson_collect_batches", lambda: sum(
        df.height for df in pl.scan_ndjson(files).collect_batches()))
    return {"readers": res}


def compare_writers(data: Path, out: Path) -> dict:
    """The ingested turns table written again, whole, into fresh tables: by delta-rs' writer
    (`write_deltalake`, the store's writer properties) and by the store's add-only path
    (storage/file_commit.py: polars' Parquet writer + one add-actions commit). Seconds and CPU
    seconds (this process, all threads) each; rows read back must agree."""
    from deltalake import DeltaTable, write_deltalake

    from qumem_pipeline.storage import file_commit, table_store

    df = pl.from_arrow(DeltaTable(str(data / "turns")).to_pyarrow_dataset().to_table()).sort(table_store.KEY)
    res = {}

    def timed(key, fn):
        t, c = time.perf_counter(), time.process_time()
        fn(out / key)
        res[key] = {"seconds": round(time.perf_counter() - t, 3), "cpu_s": round(time.process_time() - c, 2),
                    "rows": DeltaTable(str(out / key)).to_pyarrow_dataset().count_rows(),
                    "mb": round(sum(p.stat().st_size for p in (out / key).rglob("*.parquet")) / 1e6, 1)}

    timed("delta_rs_write_deltalake", lambda d: write_deltalake(
        str(d), df.to_arrow(), partition_by=[table_store.BUCKET], writer_properties=table_store._WRITER,
        target_file_size=table_store.TARGET_FILE_SIZE))

    def add_only(d: Path) -> None:
        d.mkdir(parents=True)
        import pyarrow.fs as pafs

        adds = file_commit.write_files(df, pafs.LocalFileSystem(), str(d), key=table_store.KEY, bucket=table_store.BUCKET,
                                       row_group_rows=table_store.ROW_GROUP_ROWS, target_file_bytes=table_store.TARGET_FILE_SIZE)
        from deltalake import CommitProperties

        file_commit.commit_new_table(str(d), df.clear().to_arrow().schema, adds, partition_by=[table_store.BUCKET],
                                     description="bench", configuration={}, storage_options=None, commit=CommitProperties())

    timed("polars_add_only_commit", add_only)
    shutil.rmtree(out, ignore_errors=True)
    a, b = res["delta_rs_write_deltalake"], res["polars_add_only_commit"]
    assert a["rows"] == b["rows"] == df.height
    return {"writers": res, "writer_cpu_ratio": round(a["cpu_s"] / b["cpu_s"], 2)}


# ---------------------------------------------------------------- parent
def run_child(name: str, work: Path) -> dict:
    """One phase in a child process, started once the dirty pages of what ran before (the generated
    archive, the last phase's output) are on disk, so that no phase pays for another's write-back."""
    os.sync()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, __file__, "--phase", name, "--work", str(work)],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"phase {name} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    """The run with the median seconds (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def run_config(n_turns: int, users_per_1m: int, readers: bool, repeat: int = 1) -> dict:
    n_users = max(1, n_turns * users_per_1m // 1_000_000)
    work = Path(tempfile.mkdtemp(prefix="qumem-bench-ingest-"))
    try:
        t = time.perf_counter()
        files = generate(work / "archive", n_turns, n_users)
        gen_s = time.perf_counter() - t
        mb = sum(f.stat().st_size for f in files) / 1e6
        print(f"[{n_turns:,} turns] generated {len(files)} files, {mb:,.0f} MB in {gen_s:.0f}s", file=sys.stderr, flush=True)
        # `repeat` rounds of the three timed phases, interleaved (baseline, contract, ingest, baseline, ...),
        # each phase's median round reported: at 10M turns the contract baseline's first round took
        # 20.7-22.4 s against 14.5-16.1 s for its others (four runs, 2026-12-06; the os.sync before each
        # phase did not change that), which alone moves `ratio_contract` by 0.15-0.2.
        rounds: dict[str, list[dict]] = {"baseline": [], "contract": [], "ingest": []}
        for _ in range(repeat):
            for name in rounds:
                if name == "ingest":  # into a fresh data root each round
                    shutil.rmtree(work / "data", ignore_errors=True)
                rounds[name].append(run_child(name, work))
                shutil.rmtree(work / "contract", ignore_errors=True)
        base, contract, ingest = (_median(rounds[k]) for k in ("baseline", "contract", "ingest"))
        if repeat > 1:  # the data root the later phases read is the last round's (the same rows)
            print(f"[{n_turns:,} turns] rounds (s): " + ", ".join(
                f"{k} {[r['seconds'] for r in v]}" for k, v in rounds.items()), file=sys.stderr, flush=True)
        assert ingest["rows_read"] == base["rows"] == contract["rows"] == n_turns // n_users * n_users
        assert ingest["quarantined"] == 0
        read = run_child("read", work)
        # the pass over the archive's bytes the manifest needs (sha256 + line count), alone
        hashed = run_child("hash", work)
        writers = run_child("writers", work) if readers else None
        runs = []
        for k in range(INCREMENTAL_RUNS):
            add_new_file(work / "archive", n_turns, n_users, k)
            runs.append(run_child("incremental", work))
            assert runs[-1]["files_read"] == 1 and runs[-1]["rows_read"] == NEW_FILE_TURNS
        inc = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]  # the median run
        out = {
            "turns": base["rows"], "users": n_users, "files": len(files), "archive_mb": round(mb, 1),
            "generate_s": round(gen_s, 1),
            "baseline_s": base["seconds"], "ingest_s": ingest["seconds"],
            "ratio": round(base["seconds"] / ingest["seconds"], 3),
            "contract_s": contract["seconds"],
            "ratio_contract": round(contract["seconds"] / ingest["seconds"], 3),
            "turns_per_s": round(base["rows"] / ingest["seconds"]),
            "peak_rss_mb": ingest["peak_rss_mb"], "baseline_peak_rss_mb": base["peak_rss_mb"],
            "contract_peak_rss_mb": contract["peak_rss_mb"],
            # CPU seconds (all threads) of each child: the work done, steadier than wall time under load
            "baseline_cpu_s": base["cpu_s"], "contract_cpu_s": contract["cpu_s"], "ingest_cpu_s": ingest["cpu_s"],
            "cpu_ratio": round(base["cpu_s"] / ingest["cpu_s"], 3),
            "cpu_ratio_contract": round(contract["cpu_s"] / ingest["cpu_s"], 3),
            "ingest_stages_s": ingest["stages_s"],
            # scratch the full ingest wrote (0 when its read was held in memory), per turn read
            "spilled_bytes_per_turn": round(ingest["spilled_bytes"] / max(1, ingest["rows_read"]), 1),
            # a ceiling for `ratio`: the baseline plus only the content-hash pass every ingest of
            # new files makes (nothing else of the ingest counted)
            "hash_pass_s": hashed["seconds"], "hash_pass_cpu_s": hashed["cpu_s"],
            "ratio_ceiling": round(base["seconds"] / (base["seconds"] + hashed["seconds"]), 3),
            "cpu_ratio_ceiling": round(base["cpu_s"] / (base["cpu_s"] + hashed["cpu_s"]), 3),
            "incremental_s": inc["seconds"], "incremental_users_rebuilt": inc["users_rebuilt"],
            "incremental_runs_s": [r["seconds"] for r in runs], "incremental_stages_s": inc["stages_s"],
            "incremental_ratio": round(inc["seconds"] / ingest["seconds"], 4),
            "repeat": repeat, "rounds_s": {k: [r["seconds"] for r in v] for k, v in rounds.items()},
            "read_100_users_s": read["best_s"], "read_100_users_rows": read["rows"],
            "files_per_table": files_per_table(work / "data"),
        }
        if readers:
            out["readers"] = run_child("readers", work)["readers"]
            out.update({k: v for k, v in writers.items() if k in ("writers", "writer_cpu_ratio")})
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def size_label(n_turns: int) -> str:
    """10_000_000 -> '10m', 100_000 -> '100k', 2_500 -> '2500': a configuration's size in a key."""
    if n_turns % 1_000_000 == 0:
        return f"{n_turns // 1_000_000}m"
    if n_turns % 1_000 == 0:
        return f"{n_turns // 1_000}k"
    return str(n_turns)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--users-per-1m", type=int, default=1_000, help="users per million turns (10,000 at 10M)")
    ap.add_argument("--no-readers", action="store_true", help="skip the reader comparison")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of baseline, contract and ingest (interleaved); each one's median round is reported")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, Path(args.work))))
        return 0

    configs = {}
    for i, n in enumerate(sorted(args.turns)):
        configs[n] = run_config(n, args.users_per_1m, readers=(i == 0 and not args.no_readers), repeat=max(1, args.repeat))
    small, large = configs[min(configs)], configs[max(configs)]
    out = {k: large[k] for k in ("turns", "ratio", "ratio_contract", "cpu_ratio", "cpu_ratio_contract", "ratio_ceiling",
                                 "cpu_ratio_ceiling", "peak_rss_mb", "incremental_ratio", "files_per_table")}
    if len(configs) > 1:
        out["rss_growth"] = round(large["peak_rss_mb"] / small["peak_rss_mb"], 3)
        out[f"read_ratio_{size_label(max(configs))}_vs_{size_label(min(configs))}"] = round(
            large["read_100_users_s"] / small["read_100_users_s"], 3)
    out["configs"] = {str(n): c for n, c in configs.items()}
    print(f"{'turns':>12}{'MB':>8}{'baseline s':>12}{'contract s':>12}{'ingest s':>10}{'ratio':>8}{'r_contract':>11}"
          f"{'peak MB':>9}{'incr s':>8}{'incr ratio':>11}{'read100 s':>10}")
    for n, c in configs.items():
        print(f"{n:>12,}{c['archive_mb']:>8,.0f}{c['baseline_s']:>12.2f}{c['contract_s']:>12.2f}{c['ingest_s']:>10.2f}"
              f"{c['ratio']:>8.3f}{c['ratio_contract']:>11.3f}"
              f"{c['peak_rss_mb']:>9.0f}{c['incremental_s']:>8.2f}{c['incremental_ratio']:>11.4f}{c['read_100_users_s']:>10.4f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
