"""Query strategies on the embedded model: does each one's user state cite evidence, and what does its
query stage cost? The figures behind the embedded default (`registry.EMBEDDED_MODEL_STRATEGY`, qumem;
docs/evaluation.md#the-default-strategy), measured on the example archive through the product's own
commands, nothing scripted:

1. `qumem run --data-root BASE` once (the main job on the embedded defaults: ingest, episodes, the
   embedded model's decomposition, indexes, the default strategy's `query_states`); its stage table is
   reported as `main_job` for reference;
2. per strategy, a copy of BASE (data root and Dagster home: each copy starts with an empty
   personalization checkpoint table, so every call is paid), then
   `QUMEM_QUERY_STRATEGY=S qumem personalize --queries examples/queries.jsonl --batch-id bench-S`:
   the same 12 queries answered from the same memories by each strategy;
3. the `personalization` table read back: `cited_share` = states with at least one citation / states
   answered, split by what is cited (typed memories, AdaMem's `turn:N` turns, `profile:ID` profiles), and
   `resolved_share` = states whose citations resolve to at least one source turn (`cited_turn_ids`).

Seconds: `answering_s` is the time inside the strategy (its LLM stages and retrieval: the personalize
report's `seconds_answering`), `wall_s` the whole `qumem personalize` command; `answering_ratio_vs_<first>`
divides each strategy's `answering_s` by the first strategy's, measured in the same run. The embedded
model is greedy (temperature 0), so a rerun on the same machine gives the same states; seconds vary.

    python bench/embedded_strategies.py --json                         # qumem, adamem, topk (~8 min idle)
    python bench/embedded_strategies.py --strategies qumem,adamem --json
    python bench/embedded_strategies.py --base DIR --json              # reuse a BASE made by an earlier run
    python bench/embedded_strategies.py --users bob --json             # one user's rows and queries (~2 min)
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARCHIVE = ROOT / "examples" / "archive"
QUERIES = ROOT / "examples" / "queries.jsonl"
STATES = "personalization"


def only_users(users: list[str], out: Path) -> tuple[Path, Path]:
    """The example archive's and queries' lines of `users` (bad lines of theirs included), as files under `out`."""
    out.mkdir(parents=True, exist_ok=True)

    def keep(line: bytes) -> bool:  # the archive holds bad lines on purpose (invalid UTF-8 among them)
        try:
            return json.loads(line.decode("utf-8", errors="replace")).get("user_id") in users
        except (ValueError, AttributeError):
            return False

    archive, queries = out / "archive.jsonl", out / "queries.jsonl"
    with open(archive, "wb") as f:
        for path in sorted(ARCHIVE.glob("*.jsonl")):
            f.writelines(ln for ln in path.read_bytes().splitlines(keepends=True) if keep(ln))
    queries.write_bytes(b"".join(ln for ln in QUERIES.read_bytes().splitlines(keepends=True) if keep(ln)))
    if not archive.stat().st_size or not queries.stat().st_size:
        raise SystemExit(f"no rows or no queries of {users} in the example archive")
    return archive, queries


def _env(home: Path, strategy: str | None = None, queries: Path = QUERIES) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DAGSTER_HOME": str(home),
           "QUMEM_LLM_KIND": "local"}
    for name in ("QUMEM_LLM_MODEL", "QUMEM_LLM_BASE_URL", "QUMEM_DATA_ROOT", "QUMEM_ARCHIVE", "QUMEM_QUERIES",
                 "QUMEM_WAREHOUSE", "QUMEM_QUERY_STRATEGY"):
        env.pop(name, None)  # the embedded defaults, whatever the caller's shell says
    if strategy:
        env["QUMEM_QUERY_STRATEGY"] = strategy
    env["QUMEM_QUERIES"] = str(queries)  # the main job's own query_states answers the same queries
    return env


def _qumem(args: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run a `qumem` command; its last stdout line is its JSON report."""
    cmd = [sys.executable, "-m", "qumem_pipeline.cli", *args, "--json"]
    proc = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


def build_base(base: Path, archive: Path = ARCHIVE, queries: Path = QUERIES) -> dict:
    """The main job on the embedded defaults into `base` (data/ and .dagster_home/)."""
    base.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = _qumem(["run", "--archive", str(archive), "--data-root", str(base / "data")],
                    _env(base / ".dagster_home", queries=queries), base)
    return {"wall_s": round(time.perf_counter() - t0, 2), "report": report}


def citation_counts(data_root: Path, batch_id: str) -> dict:
    """What the batch's states cite, read back from the product's `personalization` table."""
    import polars as pl

    from qumem_pipeline.storage.layout import DataLayout

    rows = DataLayout(str(data_root)).store.read(STATES, columns=["batch_id", "cited_memory_ids", "cited_turn_ids"])
    rows = rows.filter(pl.col("batch_id") == batch_id) if rows is not None else pl.DataFrame()
    n = rows.height
    if not n:
        return {"states": 0}
    cited = rows["cited_memory_ids"].to_list()
    turns = rows["cited_turn_ids"].to_list()

    def share(pred) -> float:
        return round(sum(1 for c in cited if c and pred(c)) / n, 4)

    return {
        "states": n,
        "cited_states": sum(1 for c in cited if c),
        "cited_share": share(lambda c: True),
        "memory_cited_share": share(lambda c: any(not x.startswith(("turn:", "profile:")) for x in c)),
        "turn_cited_share": share(lambda c: any(x.startswith("turn:") for x in c)),
        "profile_cited_share": share(lambda c: any(x.startswith("profile:") for x in c)),
        "resolved_share": round(sum(1 for t in turns if t) / n, 4),
        "citations_per_state": round(sum(len(c or []) for c in cited) / n, 3),
    }


def run_strategy(base: Path, work: Path, strategy: str, queries: Path = QUERIES) -> dict:
    """Answer the example queries from a fresh copy of `base` with `strategy`."""
    copy = work / strategy
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(base, copy)
    batch = f"bench-{strategy}"
    t0 = time.perf_counter()
    report = _qumem(["personalize", "--queries", str(queries), "--batch-id", batch, "--data-root", str(copy / "data")],
                    _env(copy / ".dagster_home", strategy, queries), copy)
    wall = time.perf_counter() - t0
    if report.get("strategy") != strategy:
        raise SystemExit(f"asked for {strategy}, the job ran {report.get('strategy')}")
    return {
        "strategy": strategy,
        "answered": report["answered"],
        "quarantined_llm": report["quarantined_llm"],
        "llm_calls": report["llm_calls"],
        "llm_calls_sent": report["llm_calls_sent"],
        "prompt_tokens": report["prompt_tokens"],
        "completion_tokens": report["completion_tokens"],
        "answering_s": round(report["seconds_answering"], 2),
        "wall_s": round(wall, 2),
        **citation_counts(copy / "data", batch),
    }


def table(rows: list[dict]) -> str:
    cols = [("strategy", "strategy"), ("answered", "states"), ("cited_share", "cited"),
            ("memory_cited_share", "memories"), ("turn_cited_share", "turns"), ("profile_cited_share", "profiles"),
            ("resolved_share", "resolved"), ("llm_calls", "calls"), ("prompt_tokens", "prompt tok"),
            ("answering_s", "answering s"), ("wall_s", "wall s")]
    out = ["  ".join(f"{h:>11}" for _, h in cols)]
    out += ["  ".join(f"{r.get(k, ''):>11}" for k, _ in cols) for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="qumem,adamem,topk",
                    help="comma-separated; the first is the baseline of answering_ratio_vs_* (default qumem,adamem,topk)")
    ap.add_argument("--base", type=Path, help="a BASE an earlier run built (data/ and .dagster_home/); default: build one")
    ap.add_argument("--work", type=Path, help="where the copies go (default: a temporary directory, removed)")
    ap.add_argument("--users", help="comma-separated: only these users' archive rows and queries (default: all four)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    from qumem_pipeline.query.strategies.registry import STRATEGY_NAMES

    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; expected some of {STRATEGY_NAMES}")
    tmp = Path(tempfile.mkdtemp(prefix="qumem-embedded-strategies-"))
    work = args.work or tmp
    try:
        archive, queries = ARCHIVE, QUERIES
        if args.users:
            if args.base:
                ap.error("--users builds its own BASE: not with --base")
            archive, queries = only_users([u.strip() for u in args.users.split(",") if u.strip()], tmp / "input")
        main_job = None
        base = args.base
        if base is None:
            base = tmp / "base"
            built = build_base(base, archive, queries)
            rep = built["report"]
            main_job = {"wall_s": built["wall_s"], "users": rep.get("users"), "warehouse_rows": rep.get("warehouse"),
                        "wall_s_by_stage": rep.get("summary", {}).get("wall_s_by_stage")}
            print(f"main job on the embedded defaults: {built['wall_s']} s", file=sys.stderr)
        rows = []
        for s in strategies:
            rows.append(run_strategy(base, work, s, queries))
            print(f"{s}: {rows[-1]['cited_states']}/{rows[-1]['states']} states cite, "
                  f"{rows[-1]['answering_s']} s answering", file=sys.stderr)
        first = rows[0]
        for r in rows:
            r[f"answering_ratio_vs_{first['strategy']}"] = (
                round(r["answering_s"] / first["answering_s"], 3) if first["answering_s"] else None)
        print(table(rows))
        result = {"bench": "embedded_strategies", "users": args.users or "all",
                  "queries": sum(1 for ln in queries.read_text(encoding="utf-8").splitlines() if ln.strip()),
                  "base": str(base) if args.base else None, "main_job": main_job,
                  "by_strategy": {r["strategy"]: r for r in rows}}
        if args.json:
            print(json.dumps(result))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
