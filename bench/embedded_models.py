"""Which embedded model should `qumem run` ship with? One row per candidate on the example archive (the
same data README's first command runs on): the wall time of `qumem run` on this box, and the readability
of what it made (`qumem_pipeline.memories.readability`: schema-valid, template slots, near-empty,
repeated phrases, grounded memories, states made of labels), against issue 50's targets.

Each model runs the product's own command, nothing scripted:
`QUMEM_LLM_KIND=local QUMEM_LLM_LOCAL_MODEL=<candidate> qumem run --data-root <fresh> --json` in a
fresh directory under `.artifacts/embedded_models/` (its own data root and Dagster home; never ./data),
one after the other in one process, so the rows' wall times share the box's load (recorded per row: the
1-minute load average before and after, and `QUMEM_LLM_THREADS`), and with the CPU seconds the run and its
step processes used (`cpu_s`: on a box shared with other work, the figure to compare). A model not installed is a row with
the install command to run. `--variant LABEL:ENV=VAL[,ENV=VAL]` adds a row for one model under extra
settings (a decoding fix measured against the same model's plain row).

    python scripts/install_llm_model.py --model qwen2.5-coder-0.5b      # once per candidate
    python bench/embedded_models.py --json                              # every candidate in model_store.CANDIDATES
    python bench/embedded_models.py --models smollm2-135m --variant full-bounds:QUMEM_LLM_OUTPUT_BOUNDS=full --json
    python bench/embedded_models.py --rates DIR --json                  # the rates of an earlier run's data root
    python bench/embedded_models.py --checkpoints DIR,DIR --json        # memory rates on the calls both runs finished
"""

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qumem_pipeline.llm import model_store  # noqa: E402
from qumem_pipeline.memories import readability  # noqa: E402

ARCHIVE = ROOT / "examples" / "archive"
QUERIES = ROOT / "examples" / "queries.jsonl"
OUT = ROOT / ".artifacts" / "embedded_models"
SIX_MINUTES = 360.0


def _env(home: Path, key: str, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DAGSTER_HOME": str(home),
           "QUMEM_LLM_KIND": "local", "QUMEM_QUERIES": str(QUERIES)}
    for name in ("QUMEM_LLM_MODEL", "QUMEM_LLM_MODEL_DIR", "QUMEM_LLM_BASE_URL", "QUMEM_DATA_ROOT", "QUMEM_ARCHIVE", "QUMEM_WAREHOUSE",
                 "QUMEM_QUERY_STRATEGY", "QUMEM_LLM_OUTPUT_BOUNDS", "QUMEM_LLM_LOCAL_MODEL", "QUMEM_LLM_WEIGHTS"):
        env.pop(name, None)  # the product's defaults, whatever the caller's shell says
    env["QUMEM_LLM_LOCAL_MODEL"] = key
    env.update(extra)
    return env


def run_model(label: str, key: str, extra: dict[str, str], out: Path) -> dict:
    """`QUMEM_LLM_LOCAL_MODEL=key qumem run` on the example archive in a fresh directory; its figures."""
    spec = model_store.spec_named(key)
    row: dict = {"model": label, "spec": spec.name, "settings": extra, "threads": os.environ.get("QUMEM_LLM_THREADS", "")}
    try:
        model_store.ensure_model_dir(spec)
    except model_store.ModelUnavailable:
        row["error"] = f"not installed: {model_store.install_command(spec)}"
        return row
    work = out / f"{label}-{time.strftime('%Y%m%dT%H%M%S')}"
    work.mkdir(parents=True)
    row["load_before"] = round(os.getloadavg()[0], 2)
    cmd = [sys.executable, "-m", "qumem_pipeline.cli", "run", "--archive", str(ARCHIVE),
           "--data-root", str(work / "data"), "--json"]
    t0 = time.perf_counter()
    with open(work / "qumem_run.stdout", "w") as fo, open(work / "qumem_run.stderr", "w") as fe:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(work / ".dagster_home", key, extra), stdout=fo, stderr=fe)
        # wait4: this run's own CPU seconds (its step processes included), apart from rows run beside it
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    # CPU seconds of the run and every process it waited for: what the run cost, whatever else the box ran
    row["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    row["load_after"] = round(os.getloadavg()[0], 2)
    row["data_root"] = str((work / "data").relative_to(ROOT)) if work.is_relative_to(ROOT) else str(work / "data")
    stderr, stdout = (work / "qumem_run.stderr").read_text(), (work / "qumem_run.stdout").read_text()
    if rc != 0:
        row["error"] = f"qumem run failed (rc {rc}): {stderr.strip().splitlines()[-1:]}"
        return row
    report = json.loads([ln for ln in stdout.splitlines() if ln.strip()][-1])
    summary = report.get("summary", {})
    row["wall_s_by_stage"] = summary.get("wall_s_by_stage")
    row["llm"] = summary.get("llm")
    row.update(readability.read_run(str(work / "data")))
    row["within_6_min"] = row["wall_s"] <= SIX_MINUTES
    row["misses"] = readability.misses(row)
    row["samples"] = samples(work / "data")
    return row


def samples(data_root: Path) -> dict:
    """One memory and one state of the archive's first user (alice), for a person to read."""
    import polars as pl

    from qumem_pipeline.storage.table_store import TableStore

    store = TableStore(str(data_root))
    mem, states = store.read("memories", ["alice"]), store.read("query_states", ["alice"])
    out = {}
    if mem is not None and mem.height:
        m = mem.filter(~pl.col("user_placeholder").fill_null(False)).sort("type", "position").row(0, named=True)
        out["memory"] = {"type": m["type"], "content": m["content"], "evidence_turn_ids": m["evidence_turn_ids"]}
    if states is not None and states.height:
        s = states.filter(~pl.col("user_placeholder").fill_null(False)).sort("query_id").row(0, named=True)
        out["state"] = {"query_id": s["query_id"], "query": s["query"], "state": s["state"]}
    return out


def compare_checkpoints(roots: list[Path]) -> dict:
    """Memory rates of each root's finished decomposition calls, restricted to the calls all roots finished."""
    import polars as pl

    from qumem_pipeline.storage.table_store import TableStore

    mems, turns = [], None
    for root in roots:
        store = TableStore(str(root))
        ck = store.read("memory_checkpoints")
        ck = ck.filter(~pl.col("user_placeholder").fill_null(False))
        mems.append((root, ck, readability.checkpoint_memories(ck)))
        t = store.read("turns")
        turns = t.filter(~pl.col("user_placeholder").fill_null(False)) if turns is None else turns
    common = None
    for _, ck, _ in mems:
        calls = set(ck.filter(pl.col("status") == "ok").select("user_id", "episode_id", "type").iter_rows())
        common = calls if common is None else common & calls
    out = {"bench": "embedded_models", "mode": "checkpoints", "common_calls": len(common or ()), "rows": []}
    for root, ck, m in mems:
        keep = m.filter(pl.struct("user_id", "episode_id", "type").map_elements(
            lambda r: (r["user_id"], r["episode_id"], r["type"]) in common, return_dtype=pl.Boolean))
        got = readability.memory_rates(keep, turns)
        out["rows"].append({"data_root": str(root), "finished_calls": ck.height, **got, "misses": readability.misses(got)})
    return out


COLUMNS = [("model", "model", 26), ("wall_s", "wall s", 7), ("cpu_s", "cpu s", 7), ("load_before", "load", 5),
           ("schema_valid_rate", "valid", 6), ("memories", "mems", 5), ("template_slot_rate", "slots", 6),
           ("near_empty_rate", "empty", 6), ("repeated_phrase_rate", "repeat", 6), ("grounded_rate", "ground", 6),
           ("label_state_rate", "labels", 6), ("empty_state_rate", "e.st", 5),
           ("citing_state_rate", "cites", 5)]


def table(rows: list[dict]) -> str:
    out = ["  ".join(f"{h:>{w}}" for _, h, w in COLUMNS)]
    for r in rows:
        if r.get("error"):
            out.append(f"{r['model']:>26}  {r['error']}")
            continue
        out.append("  ".join(f"{'' if r.get(k) is None else r.get(k):>{w}}" for k, _, w in COLUMNS))
    targets = {k: f"{op}{b}" for k, (op, b) in readability.TARGETS.items()}
    out.append("  ".join(f"{'targets' if k == 'model' else targets.get(k, ''):>{w}}" for k, _, w in COLUMNS))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(model_store.CANDIDATES),
                    help=f"comma-separated keys of model_store.CANDIDATES (default: all: {', '.join(model_store.CANDIDATES)})")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:ENV=VAL[,ENV=VAL] a row of the first model under these settings (repeatable)")
    ap.add_argument("--variant-model", help="the model the variants run (default: the first of --models)")
    ap.add_argument("--out", type=Path, default=OUT, help="where each run's fresh directory goes (default .artifacts/embedded_models)")
    ap.add_argument("--rates", type=Path, help="only the readability rates of this existing data root")
    ap.add_argument("--checkpoints", help="comma-separated data roots: memory rates from each one's memory_checkpoints, "
                    "on the (episode, type) calls every one of them finished (runs stopped mid-stage included)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the rows at the same time (each under the same load; compare cpu_s and wall_s ratios)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.rates:
        got = readability.read_run(str(args.rates))
        got["misses"] = readability.misses(got)
        print(json.dumps(got, indent=None if args.json else 2))
        return 0
    if args.checkpoints:
        print(json.dumps(compare_checkpoints([Path(d) for d in args.checkpoints.split(",") if d])))
        return 0
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    for k in keys:
        try:
            model_store.spec_named(k)  # an unknown name stops here, before any run
        except ValueError as e:
            ap.error(str(e))
    runs: list[tuple[str, str, dict[str, str]]] = [(k, k, {}) for k in keys]
    vkey = args.variant_model or keys[0]
    for v in args.variant:
        label, _, settings = v.partition(":")
        extra = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
        runs.append((f"{vkey}+{label}", vkey, extra))
    args.out.mkdir(parents=True, exist_ok=True)

    def one(run: tuple[str, str, dict[str, str]]) -> dict:
        label, key, extra = run
        print(f"{label}: qumem run on {ARCHIVE.relative_to(ROOT)} ...", file=sys.stderr, flush=True)
        r = run_model(label, key, extra, args.out)
        print(f"{label}: {r.get('error') or str(r['wall_s']) + ' s, misses ' + json.dumps(r['misses'])}", file=sys.stderr,
              flush=True)
        return r

    if args.parallel:
        with ThreadPoolExecutor(len(runs)) as pool:
            rows = list(pool.map(one, runs))
    else:
        rows = [one(r) for r in runs]
    print(table(rows))
    for r in rows:
        for what, s in (r.get("samples") or {}).items():
            print(f"{r['model']} {what}: {json.dumps(s, ensure_ascii=False)[:400]}")
    if args.json:
        print(json.dumps({"bench": "embedded_models", "archive": str(ARCHIVE.relative_to(ROOT)), "cpus": os.cpu_count(),
                          "parallel": args.parallel, "llm_threads": os.environ.get("QUMEM_LLM_THREADS", ""),
                          "targets": readability.TARGETS, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
