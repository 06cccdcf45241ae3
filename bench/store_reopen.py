"""Store reopen bench: the nightly incremental sync with the table store's handles brought forward after
their own commits (`update_incremental`, TableStore._reopen) against loaded again from the whole log,
on local disk and on S3 (moto's standalone server on loopback, as the tests run it), in the same run.

Why: with no post-commit hooks a table has no checkpoint between the store's own compactions, so a
fresh load replays every commit's JSON (on S3 a LIST and a GET per commit), and each write used to
load its table three times. The nightly case is many small syncs on an old root, where those loads
are a fixed cost per table per sync.

Per backend: an archive of `--turns` turns (bench/ingest.py's generator, `--users` users) ingested,
then `--syncs` rounds, each a new file of 10,000 later turns of 100 users followed by one sync with
each mode in turn (the order alternating round by round, a fresh root per mode so both see the same
log lengths). Reported: the median sync seconds of each mode, `ratio` = reopen / reload (< 1:
faster), and how many times a table was loaded whole and brought forward (DeltaTable.__init__ and
update_incremental, counted).

    python bench/store_reopen.py --json                      # local disk and S3 (moto)
    python bench/store_reopen.py --backends local --json

Last JSON line keys: `local` / `s3` -> {`reopen_s`, `reload_s`, `ratio`, `loads_per_sync`, ...};
`ratio_s3`, `ratio_local`.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deltalake  # noqa: E402

import ingest as ingest_bench  # noqa: E402  (bench/ingest.py: the archive generator)
from qumem_pipeline.ingest.archive import ArchiveConfig  # noqa: E402
from qumem_pipeline.ingest.sync import sync_archive  # noqa: E402
from qumem_pipeline.runtime.processes import MOTO_S3_ENV, moto_s3  # noqa: E402
from qumem_pipeline.storage import table_store  # noqa: E402
from qumem_pipeline.storage.layout import DataLayout  # noqa: E402

S3_BUCKET = "qumem-bench"
COUNTS: Counter = Counter()


def _count_table_loads() -> None:
    """Count whole loads and incremental updates of Delta tables (delta-rs' Python entry points)."""
    init, update = deltalake.DeltaTable.__init__, deltalake.DeltaTable.update_incremental

    def counted_init(self, *a, **k):
        COUNTS["loads"] += 1
        return init(self, *a, **k)

    def counted_update(self):
        COUNTS["updates"] += 1
        return update(self)

    deltalake.DeltaTable.__init__ = counted_init
    deltalake.DeltaTable.update_incremental = counted_update


def sync(archive: Path, root: str, reopen: bool) -> tuple[float, dict]:
    table_store.INCREMENTAL_REOPEN = reopen
    before = COUNTS.copy()
    t = time.perf_counter()
    sync_archive(ArchiveConfig(str(archive)), DataLayout(root))
    seconds = time.perf_counter() - t
    return seconds, {k: COUNTS[k] - before[k] for k in ("loads", "updates")}


def run_backend(backend: str, work: Path, turns: int, users: int, syncs: int) -> dict:
    archive = work / f"archive-{backend}"
    ingest_bench.generate(archive, turns, users)
    if backend == "s3":
        base = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}"
        roots = {True: f"{base}/reopen", False: f"{base}/reload"}
    else:
        roots = {True: str(work / "reopen"), False: str(work / "reload")}
    full = {mode: round(sync(archive, root, mode)[0], 3) for mode, root in roots.items()}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    counts: dict[bool, Counter] = {True: Counter(), False: Counter()}
    for k in range(syncs):
        ingest_bench.add_new_file(archive, turns, users, k=k)
        for mode in ((True, False) if k % 2 == 0 else (False, True)):
            s, c = sync(archive, roots[mode], mode)
            seconds[mode].append(round(s, 3))
            counts[mode].update(c)
        print(f"[{backend}] sync {k + 1}/{syncs}: reopen {seconds[True][-1]:.3f} s, reload {seconds[False][-1]:.3f} s",
              flush=True)
    reopen_s, reload_s = statistics.median(seconds[True]), statistics.median(seconds[False])
    return {"turns": turns, "users": users, "syncs": syncs, "full_ingest_s": {"reopen": full[True], "reload": full[False]},
            "reopen_s": round(reopen_s, 3), "reload_s": round(reload_s, 3), "ratio": round(reopen_s / reload_s, 3),
            "reopen_runs_s": seconds[True], "reload_runs_s": seconds[False],
            "loads_per_sync": {"reopen": round(counts[True]["loads"] / syncs, 1), "reload": round(counts[False]["loads"] / syncs, 1)},
            "updates_per_sync": {"reopen": round(counts[True]["updates"] / syncs, 1),
                                 "reload": round(counts[False]["updates"] / syncs, 1)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--turns", type=int, default=100_000)
    ap.add_argument("--users", type=int, default=1_000)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    _count_table_loads()
    out: dict = {}
    work = Path(tempfile.mkdtemp(prefix="qumem-bench-reopen-"))
    endpoint = None
    try:
        with ExitStack() as stack:
            for backend in args.backends.split(","):
                if backend == "s3" and endpoint is None:
                    endpoint = stack.enter_context(moto_s3(buckets=(S3_BUCKET,)))
                    os.environ.update({**MOTO_S3_ENV, "AWS_ENDPOINT_URL": endpoint})
                out[backend] = run_backend(backend, work, args.turns, args.users, args.syncs)
                out[f"ratio_{backend}"] = out[backend]["ratio"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'backend':8s} {'reopen s':>9s} {'reload s':>9s} {'ratio':>6s} {'loads/sync':>16s}")
    for b in args.backends.split(","):
        r = out[b]
        print(f"{b:8s} {r['reopen_s']:9.3f} {r['reload_s']:9.3f} {r['ratio']:6.3f} "
              f"{r['loads_per_sync']['reopen']:>7} / {r['loads_per_sync']['reload']:<7}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
