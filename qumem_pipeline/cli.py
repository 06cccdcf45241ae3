"""`qumem`: the command line. Pipeline commands are thin wrappers over in-process Dagster runs
against the instance in $DAGSTER_HOME (default ./.dagster_home), so `dagster dev` pointed at
the same home shows every run the CLI made. Dagster is imported only by those commands.
"""

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# sha256 of every dagster.yaml this repository has shipped. A home holding one of them unedited is
# brought up to the current one (e.g. to get the batched event log); an edited one is left alone.
# tests/test_cli_instance_config.py fails until the current file's hash is added here.
SHIPPED_INSTANCE_CONFIGS = frozenset({
    "fc1c66bfedc1c7924385f3865548688c34e29c057a6171efb3a28beff6189f80",
    "279f952775f4578dc68dbb2e60376885bb43f843059164766bacc073e57b78e5",
    "17298d347a3568a747e86de24ff4cd4cf99485d67633b8c7ebd17bd8a7da2a9c",
    "695e917c4c8b0293eb4edd8502ce205e431cf66c271522690d6b6c3eae167a20",
})


def _apply_common(args: argparse.Namespace) -> None:
    """Flags become the environment that resources read, so CLI and `dagster dev` agree."""
    for flag, env in (("archive", "QUMEM_ARCHIVE"), ("format", "QUMEM_ARCHIVE_FORMAT"),
                      ("data_root", "QUMEM_DATA_ROOT"), ("warehouse", "QUMEM_WAREHOUSE")):
        value = getattr(args, flag, None)
        if value:
            os.environ[env] = str(Path(value).resolve()) if flag != "format" else value
    if getattr(args, "strict", False):
        os.environ["QUMEM_STRICT"] = "1"
    if getattr(args, "users_per_run", None):
        os.environ["QUMEM_USERS_PER_RUN"] = str(args.users_per_run)


def install_instance_config(cfg: Path, source: Path = REPO_ROOT / "dagster.yaml") -> str:
    """Put the repository's dagster.yaml at `cfg` unless the operator has made their own.

    Returns "new", "upgraded" (an unedited older shipped copy was replaced), "current" or "edited"
    (left as is, with a note on stderr), or "none" when the repository has no dagster.yaml."""
    if not source.exists():
        return "none"
    want = source.read_bytes()
    existed = cfg.exists()
    if existed:
        have = cfg.read_bytes()
        if have == want:
            return "current"
        if hashlib.sha256(have).hexdigest() not in SHIPPED_INSTANCE_CONFIGS:
            print(f"qumem: {cfg} differs from {source} and is not a copy qumem installed; left as is",
                  file=sys.stderr)
            return "edited"
    tmp = cfg.with_name(f".dagster.yaml.tmp-{os.getpid()}")
    shutil.copy(source, tmp)
    os.replace(tmp, cfg)
    if existed:
        print(f"qumem: {cfg} was an unedited older copy of {source}; replaced with the current one",
              file=sys.stderr)
    return "upgraded" if existed else "new"


def _instance():
    import dagster as dg

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
    """Discover users in the configured archive and add new ones as partitions."""
    from assets.partitions import users_partitions
    from qumem_pipeline.ingest.discovery import discover

    pipeline = defs.resources["pipeline"]
    found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout())
    existing = set(instance.get_dynamic_partitions(users_partitions.name))
    new = [u for u in sorted(found.fingerprints) if u not in existing]
    if new:
        instance.add_dynamic_partitions(users_partitions.name, new)
    return sorted(found.fingerprints)


def run_job(instance, defs, job_name: str, users: list[str], per_run: int) -> list[str]:
    """Run `job_name` over `users` in contiguous partition ranges of at most `per_run` users."""
    from assets.partitions import users_partitions
    from assets.recovery import fail_dead_runs

    for run_id in fail_dead_runs(instance):  # a killed earlier run would hold its pool slots forever
        print(f"[{job_name}] marked run {run_id} failed: its process was killed", flush=True)
    wanted = set(users)
    ordered = [k for k in instance.get_dynamic_partitions(users_partitions.name) if k in wanted]
    job = defs.resolve_job_def(job_name)
    run_ids = []
    keys = instance.get_dynamic_partitions(users_partitions.name)
    pos = {k: i for i, k in enumerate(keys)}
    chunks, current = [], []
    for u in ordered:  # a range must be contiguous in partition order
        if current and (len(current) >= per_run or pos[u] != pos[current[-1]] + 1):
            chunks.append(current)
            current = []
        current.append(u)
    if current:
        chunks.append(current)
    for i, chunk in enumerate(chunks, start=1):
        print(f"[{job_name}] run {i}/{len(chunks)}: {len(chunk)} users ({chunk[0]} .. {chunk[-1]})", flush=True)
        result = job.execute_in_process(
            instance=instance,
            tags={"dagster/asset_partition_range_start": chunk[0], "dagster/asset_partition_range_end": chunk[-1]},
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
    _apply_common(args)
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

    _apply_common(args)
    try:
        validate_user_id(args.user_id)
    except InvalidUserId as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    instance = _instance()
    result = _defs().resolve_job_def("forget_user_job").execute_in_process(
        instance=instance, run_config={"ops": {"forget_user_op": {"config": {"user_id": args.user_id}}}}
    )
    print(f"forgot {args.user_id}" if result.success else f"forget failed for {args.user_id}")
    return 0 if result.success else 1


def cmd_export(args: argparse.Namespace) -> int:
    _apply_common(args)
    defs = _defs()
    out = Path(args.out).resolve()
    written = defs.resources["pipeline"].warehouse().export_parquet(out)
    for t, p in written.items():
        print(f"{t:<24}{p}")
    if args.json:
        print(json.dumps(written))
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    _apply_common(args)
    from assets.partitions import users_partitions

    instance = _instance()
    for u in instance.get_dynamic_partitions(users_partitions.name):
        print(u)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluations keep their own argument parsers; `qumem eval NAME ...` forwards to them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.what == "segmentation":
        from qumem_pipeline.eval.segmentation.evaluate import main as seg_main

        return seg_main(args.rest)
    from qumem_pipeline.eval.locomo.harness import main as locomo_main

    return locomo_main(args.rest)


def cmd_train_classifier(args: argparse.Namespace) -> int:
    from qumem_pipeline.episodes.continuity.train import train

    train(out_dir=args.out, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qumem",
        description="Turn conversation archives into typed per-user memories (QUMem), orchestrated by Dagster.",
        epilog="Typical use: `qumem run` (example archive, ./data, ./.dagster_home), then `dagster dev` to browse.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, archive=True):
        if archive:
            sp.add_argument("--archive", help="archive file, directory or glob (default: examples/archive)")
            sp.add_argument("--format", help="jsonl | parquet | locomo | chatgpt (default: detect)")
            sp.add_argument("--strict", action="store_true", help="fail the run on any bad row instead of quarantining it")
        sp.add_argument("--data-root", help="where per-user Parquet tables live (default: ./data)")
        sp.add_argument("--warehouse", help="DuckDB file (default: <data-root>/warehouse.duckdb)")
        sp.add_argument("--json", action="store_true", help="print one JSON object with the figures as the last line")

    sp = sub.add_parser("run", help="run the main job for every user in the archive")
    common(sp)
    sp.add_argument("--users-per-run", type=int, help="users per Dagster run (default 50)")
    sp.set_defaults(func=lambda a: cmd_pipeline(a, "main_job"))

    sp = sub.add_parser("ingest", help="discover users, ingest + validate turns, load the warehouse")
    common(sp)
    sp.add_argument("--users-per-run", type=int, help="users per Dagster run (default 50)")
    sp.set_defaults(func=lambda a: cmd_pipeline(a, "ingest_job"))

    sp = sub.add_parser("forget", help="delete a user from every table, index and the warehouse")
    sp.add_argument("user_id")
    common(sp, archive=False)
    sp.set_defaults(func=cmd_forget)

    sp = sub.add_parser("export", help="export every warehouse table to Parquet for other warehouses")
    sp.add_argument("--out", default="export", help="output directory (default ./export)")
    common(sp, archive=False)
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("users", help="list registered user partitions")
    sp.set_defaults(func=cmd_users)

    sp = sub.add_parser(
        "eval",
        help="evaluations: `segmentation PATH [--format tiage|segments] [--json]`, `locomo PATH [--json] ...`",
        description="Forwards to the evaluation's own options; see `qumem eval segmentation --help`.",
    )
    sp.add_argument("what", choices=["segmentation", "locomo"])
    sp.add_argument("rest", nargs=argparse.REMAINDER, help="the evaluation's own arguments (PATH first)")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("train-classifier", help="train the continuity classifier on TIAGE (reproducible)")
    sp.add_argument("--out", default=str(REPO_ROOT / "qumem_pipeline" / "artifacts" / "continuity"))
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=cmd_train_classifier)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
