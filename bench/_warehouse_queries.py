"""The analyst queries of bench/warehouse_in_place.py, run by whichever DuckDB runs this file.

Why a file of its own: the same queries must run in the project's venv (DuckDB 2.x, on the copied
warehouse file) and in the reader's venv (DuckDB 1.4.4, in place over the Delta tables through the
delta extension, or on a copy in 1.4.4's file format), so it imports only the stdlib and duckdb.

    python bench/_warehouse_queries.py --db warehouse.duckdb --user user-000007 [--reps 4]
    python bench/_warehouse_queries.py --views views.sql --user user-000007   # in place (reader venv)

Per query: `cold_s` (its first run in this fresh process and connection), `warm_s` (median of the
runs after), the same in CPU seconds of this process, all threads (`cold_cpu_s`, `warm_cpu_s`: steadier
than wall time on a shared box), `rows` and `digest` (sha256 of the sorted result rows: every mode must
agree); plus `connect_s` / `connect_cpu_s` (connect, extensions loaded, views created). One JSON object
on the last line.
"""

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import duckdb

# name -> SQL over the warehouse's table names (the in-place views carry the same names). Floats are
# rounded and timestamps cast to text so that two engine versions print the same digest.
QUERIES = {
    "count_per_user": "SELECT user_id, count(*) AS turns FROM turns GROUP BY user_id",
    "memories_per_type_join_turns": (
        "SELECT m.type, count(*) AS memories, count(DISTINCT m.user_id) AS users, "
        "round(avg(length(t.text)), 3) AS avg_evidence_chars "
        "FROM memories m JOIN turns t ON t.user_id = m.user_id AND t.turn_index = m.evidence_turn_ids[1] "
        "GROUP BY m.type"),
    "one_user_turns": ("SELECT turn_index, role, text, CAST(timestamp AS VARCHAR) AS ts FROM turns "
                       "WHERE user_id = $user"),
    "one_user_memories": "SELECT memory_id, type, content FROM memories WHERE user_id = $user",
    "filtered_scan": ("SELECT date_trunc('day', timestamp)::DATE::VARCHAR AS day, count(*) AS n "
                      "FROM turns WHERE role = 'user' AND text LIKE '%piano%' AND length(text) > 40 GROUP BY 1"),
    "quarantine_reasons": "SELECT reason, count(*) AS n FROM quarantine GROUP BY reason",
}


def digest(rows: list) -> str:
    return hashlib.sha256("\n".join(sorted(repr(tuple(r)) for r in rows)).encode()).hexdigest()[:16]


def connect(db: str | None, views: str | None) -> duckdb.DuckDBPyConnection:
    if db:
        return duckdb.connect(db, read_only=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from delta_kernel_read import connect as kernel_connect  # the extension files, never downloaded

    con = kernel_connect()
    con.execute(Path(views).read_text())
    return con


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--db", help="a DuckDB warehouse file (opened read-only)")
    src.add_argument("--views", help="SQL creating one view per table over delta_scan (outside_views.py)")
    p.add_argument("--user", required=True, help="the user of the one-user queries")
    p.add_argument("--reps", type=int, default=4, help="runs per query: the first is cold, the rest warm")
    p.add_argument("--counts", default="", help="comma-separated tables: count(*) of each, also reported")
    args = p.parse_args(argv)
    t0, c0 = time.perf_counter(), time.process_time()
    con = connect(args.db, args.views)
    out: dict = {"duckdb": duckdb.__version__, "connect_s": round(time.perf_counter() - t0, 4),
                 "connect_cpu_s": round(time.process_time() - c0, 4), "queries": {}}
    times: dict[str, list[float]] = {q: [] for q in QUERIES}
    cpus: dict[str, list[float]] = {q: [] for q in QUERIES}
    results: dict[str, list] = {}
    for _ in range(max(2, args.reps)):  # round-robin, so no query runs warm while another is still cold
        for name, sql in QUERIES.items():
            t, c = time.perf_counter(), time.process_time()
            rows = con.execute(sql, {"user": args.user} if "$user" in sql else None).fetchall()
            times[name].append(time.perf_counter() - t)
            cpus[name].append(time.process_time() - c)
            results[name] = rows
    for name in QUERIES:
        out["queries"][name] = {"cold_s": round(times[name][0], 4), "warm_s": round(statistics.median(times[name][1:]), 4),
                                "cold_cpu_s": round(cpus[name][0], 4), "warm_cpu_s": round(statistics.median(cpus[name][1:]), 4),
                                "rows": len(results[name]), "digest": digest(results[name])}
    if args.counts:
        out["counts"] = {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in args.counts.split(",")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
