"""validate() on canonical turns without turn_index: another revision's history order vs this checkout's.

    python bench/turn_order.py [--rev main] [--turns 1000000] [--repeats 3] [--json]
    python bench/turn_order.py --smoke --json      # 10,000 turns, 1 repeat (seconds)

Two inputs: every turn stamped (`stamped`) and every tenth turn without a timestamp (`10pct_unstamped`).
Per input, each variant (`rev`: validate.py as of `--rev`; `here`: this checkout's) first runs once
unmeasured (warm-up: lazy imports, polars' thread pool, allocator), then the two are timed interleaved,
`--repeats` rounds of one run each, alternating which goes first, so load drifting on a shared box
affects both alike; `<input>_<variant>_s` is the best of the rounds.
`<input>_ratio` = here seconds / rev seconds: below 1 this checkout is faster, above 1 slower.
Last line: one JSON object.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qumem_pipeline.ingest import validate as new  # noqa: E402
from qumem_pipeline.ingest.importers.base import RAW_COLUMNS, ImportResult  # noqa: E402


def load_rev(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:qumem_pipeline/ingest/validate.py"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as tmp:
        tmp.write(src)
    try:
        spec = importlib.util.spec_from_file_location("validate_old", tmp.name)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    finally:
        os.unlink(tmp.name)
    return old


def inputs(n: int) -> dict[str, pl.DataFrame]:
    users = min(1000, n)
    i = pl.int_range(n, eager=True)
    base = pl.DataFrame({"_i": i}).select(
        user_id=pl.format("u{}", pl.col("_i") // (n // users)), conversation_id=pl.format("c{}", pl.col("_i") // 50),
        session_id=pl.lit(None, pl.String), turn_index=pl.lit(None, pl.Int64),
        role=pl.when(pl.col("_i") % 2 == 0).then(pl.lit("user")).otherwise(pl.lit("assistant")), speaker=pl.lit("x"),
        text=pl.format("turn {} some text here", pl.col("_i")),
        timestamp=(pl.lit(datetime(2024, 1, 1, tzinfo=timezone.utc)) + pl.duration(seconds=pl.col("_i"))).dt.strftime("%Y-%m-%dT%H:%M:%SZ"),
        source_ref=pl.format("r{}", pl.col("_i")), source_file=pl.lit("a.jsonl"), source_row=pl.col("_i") + 1,
    )
    base = base.select([c for c in RAW_COLUMNS]).cast(RAW_COLUMNS)
    unstamped = base.with_columns(timestamp=pl.when(pl.col("source_row") % 10 == 0).then(None).otherwise(pl.col("timestamp")))
    return {"stamped": base, "10pct_unstamped": unstamped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="main")
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per input (one run of each variant each)")
    ap.add_argument("--smoke", action="store_true", help="10,000 turns, 1 round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.turns, args.repeats = 10_000, 1
    variants = {"rev": load_rev(args.rev), "here": new}
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def timed(mod, raw) -> float:
        t = time.perf_counter()
        mod.validate(ImportResult(raw), now=now)
        return time.perf_counter() - t

    out = {"rev": args.rev, "turns": args.turns, "repeats": args.repeats}
    for name, raw in inputs(args.turns).items():
        for mod in variants.values():  # warm-up, not measured
            timed(mod, raw)
        times: dict[str, list[float]] = {label: [] for label in variants}
        for r in range(args.repeats):  # interleaved, the first one alternating
            for label in (("rev", "here") if r % 2 == 0 else ("here", "rev")):
                times[label].append(timed(variants[label], raw))
        for label in variants:
            out[f"{name}_{label}_s"] = round(min(times[label]), 3)
        out[f"{name}_ratio"] = round(min(times["here"]) / min(times["rev"]), 3)  # here / rev: < 1 = faster here
        if not args.json:
            print(f"{name}: {args.rev} {out[f'{name}_rev_s']} s, here {out[f'{name}_here_s']} s "
                  f"(best of {args.repeats}); here / rev = {out[f'{name}_ratio']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
