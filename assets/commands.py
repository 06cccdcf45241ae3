"""The `qumem` commands that run Dagster: run, ingest, forget, export, users.

`qumem_pipeline.cli` parses the arguments and calls `run_command` lazily, so the domain core never
imports Dagster. Pipeline commands are in-process Dagster runs against the instance in
$DAGSTER_HOME (default ./.dagster_home), so `dagster dev` pointed at the same home shows every run
the CLI made.
"""

import argparse
import fcntl
import json
import os
import sys
from pathlib import Path

import dagster as dg

from qumem_pipeline.cli import install_instance_config


def _instance():
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path.cwd() / ".dagster_home"))).resolve()
    os.environ["DAGSTER_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    # Two commands started at once on a fresh home would both create the SQLite tables and one
    # fails ("table alembic_version already exists"): set the instance up under a file lock.
    with open(home / ".qumem-instance.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        install_instance_config(home / "dagster.yaml")
        instance = dg.DagsterInstance.get()
        # Touch every storage once so their schema exists before the lock is released.
        instance.get_runs(limit=1)
        instance.get_dynamic_partitions("users")
        return instance


def _defs():
    from assets.definitions import build_definitions

    return build_definitions()


def register_users(instance, defs) -> list[str]:
    """Discover users in the configured archive and register the new ones (both partition schemes)."""
    from assets.partitions import register_users as register
    from qumem_pipeline.ingest.discovery import discover

    pipeline = defs.resources["pipeline"]
    found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout())
    register(instance, sorted(found.fingerprints))
    return sorted(found.fingerprints)


def run_job(instance, defs, job_name: str, users: list[str], per_run: int) -> list[str]:
    """Run `job_name` over `users` in runs of at most `per_run` users (contiguous user ranges, or
    bucket ranges naming their users: assets/planning.py)."""
    from assets.partitions import registered_users
    from assets.planning import pack_runs
    from assets.recovery import fail_dead_runs, launch_tags

    for run_id in fail_dead_runs(instance):  # a killed earlier run would hold its pool slots forever
        print(f"[{job_name}] marked run {run_id} failed: its process was killed", flush=True)
    job = defs.resolve_job_def(job_name)
    runs = pack_runs(instance, registered_users(instance), set(users), per_run)
    run_ids = []
    for i, run in enumerate(runs, start=1):
        print(f"[{job_name}] run {i}/{len(runs)}: {len(run.users)} users ({run.users[0]} .. {run.users[-1]})", flush=True)
        result = job.execute_in_process(
            instance=instance,
            tags={**run.tags, **launch_tags()},  # who runs it, so recovery on a shared instance fails only provably dead runs
            raise_on_error=True,
        )
        run_ids.append(result.run_id)
    return run_ids


def _print_summary(defs) -> dict:
    pipeline = defs.resources["pipeline"]
    counts = pipeline.warehouse().counts()
    print("\nwarehouse:", pipeline.warehouse().path)
    print(f"  {'table':<24}{'rows':>10}")
    for t, n in counts.items():
        print(f"  {t:<24}{n:>10}")
    return counts


def cmd_pipeline(args: argparse.Namespace, job_name: str) -> int:
    instance = _instance()
    defs = _defs()
    users = register_users(instance, defs)
    if not users:
        print("no valid users found in the archive", file=sys.stderr)
        return 1
    per_run = args.users_per_run or int(os.environ.get("QUMEM_USERS_PER_RUN", "50"))
    print(f"{len(users)} users in {defs.resources['pipeline'].archive_path}")
    run_ids = run_job(instance, defs, job_name, users, per_run)
    counts = _print_summary(defs)
    if args.json:
        print(json.dumps({"users": len(users), "runs": run_ids, "warehouse": counts}))
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from qumem_pipeline.contracts.ids import InvalidUserId, validate_user_id

    try:
        validate_user_id(args.user_id)
    except InvalidUserId as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    instance = _instance()
    if getattr(args, "verify", False):
        report = audit_erasure(instance, _defs(), args.user_id, list(args.canary or []))
        print(json.dumps(report, indent=1))
        print(json.dumps({"user_found": report["found"], "objects_scanned": report["data_root"]["objects_scanned"]}))
        return 1 if report["found"] else 0
    result = _defs().resolve_job_def("forget_user_job").execute_in_process(
        instance=instance, run_config={"ops": {"forget_user_op": {"config": {"user_id": args.user_id}}}}
    )
    print(f"forgot {args.user_id}" if result.success else f"forget failed for {args.user_id}")
    return 0 if result.success else 1


def audit_erasure(instance, defs, user_id: str, canaries: list[str]) -> dict:
    """`qumem forget --verify`: the data root's objects, every warehouse, the instance's tables and files."""
    from assets.erasure import scan_home_files, scan_instance
    from qumem_pipeline.storage.audit import audit_data_root, audit_warehouse
    from qumem_pipeline.storage.forget import warehouse_locations
    from qumem_pipeline.storage.table_store import TableStore

    pipeline = defs.resources["pipeline"]
    store = TableStore(pipeline.data_root)
    paths = {p for _, p in warehouse_locations(store)} | {str(pipeline.warehouse().path.absolute())}
    needles = [user_id, *canaries]
    report = {
        "user_id": user_id,
        "data_root": audit_data_root(pipeline.data_root, user_id, canaries),
        "warehouses": [audit_warehouse(p, user_id, canaries) for p in sorted(paths)],
        "instance_tables": scan_instance(instance, needles),
        "instance_files": scan_home_files(needles),
    }
    report["found"] = bool(report["data_root"]["hits"] or any(w["hits"] for w in report["warehouses"])
                           or report["instance_tables"] or report["instance_files"])
    return report


def cmd_export(args: argparse.Namespace) -> int:
    defs = _defs()
    out = Path(args.out).resolve()
    written = defs.resources["pipeline"].warehouse().export_parquet(out)
    for t, p in written.items():
        print(f"{t:<24}{p}")
    if args.json:
        print(json.dumps(written))
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    from assets.partitions import registered_users

    instance = _instance()
    for u in registered_users(instance):
        print(u)
    return 0


COMMANDS = {
    "run": lambda a: cmd_pipeline(a, "main_job"),
    "ingest": lambda a: cmd_pipeline(a, "ingest_job"),
    "forget": cmd_forget,
    "export": cmd_export,
    "users": cmd_users,
}


def run_command(name: str, args: argparse.Namespace) -> int:
    """Run the Dagster-backed command `name` (flags already applied to the environment)."""
    return COMMANDS[name](args)
