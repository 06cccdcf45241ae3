"""Batched event writes on the PostgreSQL instance: one range run over N partitions, with and without
DAGSTER_EVENT_BATCH_SIZE.

    python bench/event_batch.py [--partitions 1000] [--repeats 2] [--json]

Needs DAGSTER_PG_HOST/PORT/USER/PASSWORD/DB (`eval "$(bash scripts/install_system_deps.sh)"`); each
configuration gets a fresh database made from deploy/postgres/dagster.yaml (dropped afterwards).
A run over N partitions of a trivial asset records N ASSET_MATERIALIZATION_PLANNED events at run
creation and N ASSET_MATERIALIZATION events when its step ends: the part of a many-user run's
orchestration cost that is the event log. Reported per configuration: wall seconds (create + execute),
ms per partition, and the event rows PostgreSQL holds (the same in both, or batching lost events).
dagster-postgres overrides `store_event_batch` for materializations (one INSERT … RETURNING for the
batch); planned events go through the base class, one by one, in both configurations.

With --json the last printed line is one JSON object.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import dagster as dg  # noqa: E402

from qumem_pipeline.runtime.instance_config import install_instance_config  # noqa: E402


def _connect(dbname: str):
    import psycopg2

    return psycopg2.connect(host=os.environ["DAGSTER_PG_HOST"], port=int(os.environ.get("DAGSTER_PG_PORT", "5432")),
                            user=os.environ["DAGSTER_PG_USER"], password=os.environ.get("DAGSTER_PG_PASSWORD", ""),
                            dbname=dbname)


def one_config(n: int, batch_size: int, tmp: Path) -> dict:
    keys = [f"u{i:06d}" for i in range(n)]
    parts = dg.StaticPartitionsDefinition(keys)

    @dg.asset(partitions_def=parts, backfill_policy=dg.BackfillPolicy.single_run())
    def rows(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata={"users": len(context.partition_keys)})

    name = f"qumem_bench_{uuid.uuid4().hex[:10]}"
    admin = _connect(os.environ["DAGSTER_PG_DB"])
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    saved = os.environ.get("DAGSTER_PG_DB")
    os.environ["DAGSTER_PG_DB"] = name
    # "0" explicitly: deploy/postgres/dagster.yaml's storage turns batching on unless the variable is set
    os.environ["DAGSTER_EVENT_BATCH_SIZE"] = str(batch_size)
    home = tmp / name
    home.mkdir()
    install_instance_config(home / "dagster.yaml", source=REPO_ROOT / "deploy" / "postgres" / "dagster.yaml")
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            job = dg.define_asset_job("rows_job", selection=[rows]).resolve(
                asset_graph=dg.Definitions(assets=[rows]).resolve_asset_graph())
            instance.get_runs(limit=1)  # schema created before timing
            t = time.perf_counter()
            result = job.execute_in_process(instance=instance, tags={
                "dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]})
            wall = time.perf_counter() - t
            assert result.success
        with _connect(name) as con, con.cursor() as cur:
            cur.execute("SELECT dagster_event_type, count(*) FROM event_logs WHERE dagster_event_type LIKE 'ASSET_%' "
                        "GROUP BY 1 ORDER BY 1")
            counts = dict(cur.fetchall())
        con.close()
    finally:
        os.environ["DAGSTER_PG_DB"] = saved or ""
        os.environ.pop("DAGSTER_EVENT_BATCH_SIZE", None)
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    return {"batch_size": batch_size, "partitions": n, "wall_s": round(wall, 3),
            "ms_per_partition": round(1000 * wall / n, 2), "event_rows": counts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not os.environ.get("DAGSTER_PG_HOST"):
        print("DAGSTER_PG_HOST is not set: eval \"$(bash scripts/install_system_deps.sh)\"", file=sys.stderr)
        return 2
    import logging

    logging.getLogger("dagster").setLevel(logging.WARNING)
    results = {"unbatched": [], "batched": []}
    with tempfile.TemporaryDirectory(prefix="qumem-evbatch-") as tmp:
        one_config(50, 0, Path(tmp))  # warm-up: imports, first connections
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            results["unbatched"].append(one_config(args.partitions, 0, Path(tmp)))
            results["batched"].append(one_config(args.partitions, args.batch_size, Path(tmp)))
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in results.items()}
    for k, r in best.items():
        print(f"{k:>10}: {r['partitions']} partitions, {r['wall_s']} s ({r['ms_per_partition']} ms/partition), "
              f"rows {r['event_rows']}")
    same_rows = best["unbatched"]["event_rows"] == best["batched"]["event_rows"]
    out = {"partitions": args.partitions, "batch_size": args.batch_size, "backend": "postgres",
           "unbatched_s": best["unbatched"]["wall_s"], "batched_s": best["batched"]["wall_s"],
           "speedup": round(best["unbatched"]["wall_s"] / best["batched"]["wall_s"], 2),
           "same_event_rows": same_rows, "runs": results}
    print(f"speedup {out['speedup']}x; same event rows: {same_rows}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
