"""validate() on 1M canonical turns without turn_index: another revision's history order vs this checkout's.

    python bench/turn_order.py [--rev main]    # best of 3 each; last line one JSON object
"""
import argparse, importlib.util, subprocess, sys, tempfile, time, json
from datetime import datetime, timezone
import polars as pl
from qumem_pipeline.ingest.importers.base import RAW_COLUMNS, ImportResult
from qumem_pipeline.ingest import validate as new
ap = argparse.ArgumentParser(); ap.add_argument("--rev", default="main"); ap.add_argument("--json", action="store_true")
rev = ap.parse_args().rev
src = subprocess.run(["git", "show", f"{rev}:qumem_pipeline/ingest/validate.py"], capture_output=True, text=True, check=True).stdout
tmp = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False); tmp.write(src); tmp.close()
spec = importlib.util.spec_from_file_location("validate_old", tmp.name)
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
N = 1_000_000
users = 1000
i = pl.int_range(N, eager=True)
base = pl.DataFrame({"_i": i}).select(
    user_id=pl.format("u{}", pl.col("_i") // (N // users)), conversation_id=pl.format("c{}", pl.col("_i") // 50),
    session_id=pl.lit(None, pl.String), turn_index=pl.lit(None, pl.Int64),
    role=pl.when(pl.col("_i") % 2 == 0).then(pl.lit("user")).otherwise(pl.lit("assistant")), speaker=pl.lit("x"),
    text=pl.format("turn {} some text here", pl.col("_i")),
    timestamp=(pl.lit(datetime(2024, 1, 1, tzinfo=timezone.utc)) + pl.duration(seconds=pl.col("_i"))).dt.strftime("%Y-%m-%dT%H:%M:%SZ"),
    source_ref=pl.format("r{}", pl.col("_i")), source_file=pl.lit("a.jsonl"), source_row=pl.col("_i") + 1,
)
base = base.select([c for c in RAW_COLUMNS]).cast(RAW_COLUMNS)
unstamped = base.with_columns(timestamp=pl.when(pl.col("source_row") % 10 == 0).then(None).otherwise(pl.col("timestamp")))
now = datetime(2026, 1, 1, tzinfo=timezone.utc)
out = {}
for name, raw in (("stamped", base), ("10pct_unstamped", unstamped)):
    for label, mod in (("rev", old), ("here", new)):
        best = min((lambda: (t := time.perf_counter(), mod.validate(ImportResult(raw), now=now), time.perf_counter() - t)[2])() for _ in range(3))
        out[f"{name}_{label}_s"] = round(best, 3)
    out[f"{name}_ratio"] = round(out[f"{name}_here_s"] / out[f"{name}_rev_s"], 3)
out["rev"] = rev
print(json.dumps(out))
