"""Ingest throughput: import + validate + per-user atomic Parquet writes, against a plain
polars read + write of the same generated archive in the same run (the ratio is the figure).

Also measured in the same run, as the ceiling the storage layout sets: the same plain read
followed by plain per-user writes (one file per user, same writer settings and threads, no
validation, no fingerprints, no quarantine, no temp files). `layout_ceiling_ratio` is what any
ingest could reach with one file per user here; `ratio / layout_ceiling_ratio` is how close
the pipeline gets to it.

    python bench/ingest.py [--turns 1000000] [--users 1000] [--json]
"""

import argparse
import json
import random
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qumem_pipeline.ingest.importers.canonical import import_canonical  # noqa: E402
from qumem_pipeline.ingest.archive import WRITER_THREADS, write_users  # noqa: E402
from qumem_pipeline.storage.layout import FSYNC, DataLayout, write_parquet  # noqa: E402
from qumem_pipeline.ingest.validate import validate  # noqa: E402

WORDS = ("trip plan dinner vegan window seat swim run knee doctor budget book piano lesson "
         "weekend flight hotel recipe garden dog cat meeting deadline report coffee tea").split()


def generate(path: Path, n_turns: int, n_users: int, seed: int = 0) -> None:
    """A canonical JSONL archive: users with alternating user/assistant turns and ISO timestamps."""
    rng = random.Random(seed)
    per_user = n_turns // n_users
    with open(path, "w", encoding="utf-8") as f:
        for u in range(n_users):
            uid = f"user-{u:06d}"
            base = 1_700_000_000 + u * 60
            for t in range(per_user):
                conv = t // 40
                text = " ".join(rng.choices(WORDS, k=rng.randint(6, 30)))
                ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(base + t * 37))
                f.write(json.dumps({
                    "user_id": uid, "conversation_id": f"{uid}-c{conv}", "session_id": f"{uid}-c{conv}",
                    "role": "user" if t % 2 == 0 else "assistant", "speaker": uid if t % 2 == 0 else "assistant",
                    "text": text, "timestamp": ts, "source_ref": f"m{t}",
                }) + "\n")


def write_per_user_plain(df: pl.DataFrame, root: Path) -> float:
    """One file per user with the pipeline's writer and thread count; seconds taken.

    Each user's rows are a zero-copy slice (the generated archive is written user by user, as
    the pipeline's own writer uses slices), so the ceiling pays for no copy the pipeline avoids."""
    t = time.perf_counter()
    if not df["user_id"].is_sorted():
        df = df.sort("user_id", maintain_order=True)
    runs = df["user_id"].rle().struct.unnest()
    slices, start = [], 0
    for user, n in zip(runs["value"].to_list(), runs["len"].to_list()):
        d = root / f"user_id={user}"
        d.mkdir(parents=True)
        slices.append((d / "part-0.parquet", start, n))
        start += n
    with ThreadPoolExecutor(max_workers=WRITER_THREADS) as pool:
        list(pool.map(lambda job: write_parquet(df.slice(job[1], job[2]), job[0]), slices))
    return time.perf_counter() - t


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=1_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="qumem-bench-ingest-"))
    try:
        archive = work / "archive.jsonl"
        t = time.perf_counter()
        generate(archive, args.turns, args.users)
        gen_s = time.perf_counter() - t
        size_mb = archive.stat().st_size / 1e6

        # Baseline: plain polars read + write of the same data (no validation, one file).
        t, c = time.perf_counter(), time.process_time()
        df = pl.read_ndjson(archive)
        df.write_parquet(work / "baseline.parquet", compression="zstd")
        base_s, base_cpu = time.perf_counter() - t, time.process_time() - c
        n = df.height
        del df

        # Layout ceiling: the same plain read, then one plain file per user (nothing else).
        t = time.perf_counter()
        df = pl.read_ndjson(archive)
        ceiling_s = time.perf_counter() - t + write_per_user_plain(df, work / "ceiling")
        del df

        # Pipeline: import (fast path) + validate + per-user atomic writes + fingerprints.
        t, c = time.perf_counter(), time.process_time()
        imported = import_canonical(archive)
        t_import = time.perf_counter()
        res = validate(imported)
        del imported
        t_validate = time.perf_counter()
        users = sorted(res.turns["user_id"].unique().to_list())
        layout = DataLayout(work / "data")
        write_users(layout, res, users)
        t_end = time.perf_counter()
        files_per_table = {t: len(layout.store.files(t)) for t in layout.tables()}  # active Delta data files
        ours_s, ours_cpu = t_end - t, time.process_time() - c
        assert res.turns.height == n and res.quarantine.height == 0, "generated data must be all valid"

        out = {
            "turns": n,
            "users": len(users),
            "archive_mb": round(size_mb, 1),
            "generate_s": round(gen_s, 2),
            "baseline_s": round(base_s, 3),
            "pipeline_s": round(ours_s, 3),
            "baseline_turns_per_s": round(n / base_s),
            "turns_per_s": round(n / ours_s),
            "ratio": round(base_s / ours_s, 3),
            "layout_ceiling_s": round(ceiling_s, 3),
            "layout_ceiling_ratio": round(base_s / ceiling_s, 3),
            "share_of_ceiling": round(ceiling_s / ours_s, 3),
            # CPU seconds (all threads): less sensitive than wall time to other jobs sharing the cores.
            "baseline_cpu_s": round(base_cpu, 3),
            "pipeline_cpu_s": round(ours_cpu, 3),
            "stages_s": {"import": round(t_import - t, 3), "validate": round(t_validate - t_import, 3),
                         "write_users_and_fingerprints": round(t_end - t_validate, 3)},
            "writer": "Delta table per table (deltalake, zstd), partitioned by user bucket, one commit per table",
            "files_per_table": files_per_table,
            "fsync": FSYNC,
            "writer_threads": WRITER_THREADS,
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
        print(f"{'stage':<44}{'seconds':>10}{'turns/s':>14}")
        print(f"{'baseline: polars read_ndjson + write_parquet':<44}{base_s:>10.2f}{n / base_s:>14,.0f}")
        print(f"{'qumem: import + validate + per-user writes':<44}{ours_s:>10.2f}{n / ours_s:>14,.0f}")
        print(f"{'ceiling: same read + plain per-user writes':<44}{ceiling_s:>10.2f}{n / ceiling_s:>14,.0f}")
        print(f"ratio (qumem / baseline throughput): {out['ratio']:.2f}  (target >= 0.5); "
              f"layout ceiling {out['layout_ceiling_ratio']:.2f}, qumem at {out['share_of_ceiling']:.0%} of it")
        print(f"{n:,} turns, {len(users):,} users, {size_mb:.0f} MB JSONL; peak RSS {out['peak_rss_mb']:.0f} MB")
        if args.json:
            print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
