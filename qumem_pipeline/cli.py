"""`qumem`: the command line. Argument parsing lives here; the commands that run Dagster (run,
ingest, forget, export, users, show, personalize) live in the Dagster layer (`assets/cli_commands.py`,
which nothing in the Dagster layer imports back) and are imported only when one of them runs, so the
domain core never imports Dagster. They are in-process Dagster
runs against the instance in $DAGSTER_HOME (default ./.dagster_home), so `dagster dev` pointed at
the same home shows every run the CLI made.
"""

import argparse
import json
import os
import sys
from pathlib import Path



def _apply_common(args: argparse.Namespace) -> None:
    """Flags become the environment that resources read, so CLI and `dagster dev` agree."""
    for flag, env in (("archive", "QUMEM_ARCHIVE"), ("format", "QUMEM_ARCHIVE_FORMAT"),
                      ("data_root", "QUMEM_DATA_ROOT"), ("warehouse", "QUMEM_WAREHOUSE")):
        value = getattr(args, flag, None)
        if value:
            os.environ[env] = str(Path(value).resolve()) if flag != "format" and "://" not in value else value
    if getattr(args, "strict", False):
        os.environ["QUMEM_STRICT"] = "1"
    if getattr(args, "users_per_run", None):
        os.environ["QUMEM_USERS_PER_RUN"] = str(args.users_per_run)


def _dagster_command(name: str):
    """A command that runs Dagster: its code lives in the Dagster layer, imported only when it runs."""

    def call(args: argparse.Namespace) -> int:
        _apply_common(args)
        from assets.cli_commands import run_command

        return run_command(name, args)

    return call


def cmd_migrate_storage(args: argparse.Namespace) -> int:
    from qumem_pipeline.storage.migrate import migrate_storage

    _apply_common(args)
    report = migrate_storage(args.old_root, os.environ.get("QUMEM_DATA_ROOT") or str(Path.cwd() / "data"))
    print("\n".join(f"{t:<24}{r}" for t, r in report.items()) if not args.json else json.dumps(report))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluations keep their own argument parsers; `qumem eval NAME ...` forwards to them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.what == "segmentation":
        from qumem_pipeline.eval.segmentation.evaluate import main as seg_main

        return seg_main(args.rest)
    if args.what == "segmentation-ood":
        from qumem_pipeline.eval.segmentation.robustness import main as robust_main

        return robust_main(args.rest)
    if args.what == "record":  # the evaluation record: tables, check, prune, status
        from qumem_pipeline.eval.record_cli import main as record_main

        return record_main(args.rest)
    if args.what == "personamem":
        from qumem_pipeline.eval.personamem.run import main as personamem_main

        return personamem_main(args.rest)
    from qumem_pipeline.eval.locomo.harness import main as locomo_main

    return locomo_main(args.rest)


def cmd_train_classifier(args: argparse.Namespace) -> int:
    """Retrain the continuity classifier into --out (default .artifacts/continuity/; the committed artifact
    only with --overwrite-shipped), then store the rule kind that ships (the learned block rule)."""
    from qumem_pipeline.episodes.continuity.train import (ShippedArtifactRefused, TrainConfig, output_dir,
                                                          parse_mix, train_as_shipped)

    try:
        out = output_dir(args.out, args.overwrite_shipped)
    except ShippedArtifactRefused as e:
        print(f"qumem: train-classifier: {e}", file=sys.stderr)
        return 2
    mix = parse_mix(args.mix)
    where = ("--overwrite-shipped",) if args.overwrite_shipped else ("--out", str(out))
    res = train_as_shipped(out, args.seed, TrainConfig(mix=mix, cli_args=(
        *where, "--seed", str(args.seed), *(("--mix", ",".join(mix)) if mix else ()))))
    print(f"wrote {out} (version {res['version']}); use it with QUMEM_CLASSIFIER_DIR={out}")
    if args.json:
        print(json.dumps({"out": str(out), "version": res["version"]}))
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
            sp.add_argument("--format", help="jsonl | parquet | locomo | chatgpt | personamem (default: detect)")
            sp.add_argument("--strict", action="store_true", help="fail the run on any bad row instead of quarantining it")
        sp.add_argument("--data-root", help="where the Delta tables live: a local path or s3://, gs://, az:// (default: ./data)")
        sp.add_argument("--warehouse", help="DuckDB file (default: <data-root>/warehouse.duckdb)")
        sp.add_argument("--json", action="store_true", help="print one JSON object with the figures as the last line")

    for name, help_text in (("run", "run the main job for every user in the archive"),
                            ("ingest", "discover users, ingest + validate turns, load the warehouse")):
        sp = sub.add_parser(name, help=help_text)
        common(sp)
        sp.add_argument("--users-per-run", type=int, help="users per Dagster run (default 50)")
        sp.set_defaults(func=_dagster_command(name))

    sp = sub.add_parser("forget", help="delete a user from every table, index, warehouse and instance record")
    sp.add_argument("user_id")
    sp.add_argument("--verify", action="store_true",
                    help="erase nothing: scan the data root, every warehouse and the instance for the id "
                         "(and --canary texts) and print a JSON report; exit 1 when anything is found")
    sp.add_argument("--canary", action="append", default=[], help="a text of the user's to search for (repeatable)")
    common(sp, archive=False)
    sp.set_defaults(func=_dagster_command("forget"))

    sp = sub.add_parser("export", help="export every warehouse table to Parquet for other warehouses")
    sp.add_argument("--out", default="export", help="output directory (default ./export)")
    common(sp, archive=False)
    sp.set_defaults(func=_dagster_command("export"))

    sp = sub.add_parser("migrate-storage", help="move a per-user Parquet data root into the Delta table store")
    sp.add_argument("--from", dest="old_root", required=True, help="the old per-user Parquet data root")
    common(sp, archive=False)
    sp.set_defaults(func=cmd_migrate_storage)

    sp = sub.add_parser("show", help="print a user's episodes, memories and query states (with citations) as tables")
    sp.add_argument("user_id")
    common(sp, archive=False)
    sp.set_defaults(func=_dagster_command("show"))

    # -- personalize: runs personalize_job (assets/personalize.py) from assets/cli_commands.py
    sp = sub.add_parser("personalize", help="answer a batch of queries from the current memories (personalize_job)")
    sp.add_argument("--queries", required=True,
                    help="JSONL or Parquet file, directory of Parquet files or Delta table; local or s3://, gs://, az://")
    sp.add_argument("--batch-id", help="the batch's id (default: the content digest of the batch)")
    sp.add_argument("--query-format", choices=["jsonl", "parquet", "delta"], help="default: detect")
    sp.add_argument("--chunk-rows", type=int, help="rows answered and committed together (default 10000)")
    common(sp, archive=False)
    sp.set_defaults(func=_dagster_command("personalize"))

    sp = sub.add_parser("users", help="list registered user partitions")
    sp.set_defaults(func=_dagster_command("users"))

    sp = sub.add_parser(
        "eval",
        help="evaluations: `segmentation PATH [--format tiage|segments] [--json]`, `segmentation-ood [--json]` "
             "(TIAGE test beside the LoCoMo-joined OOD set), `locomo PATH [--json] ...`, `personamem DIR [--json] ...`",
        description="Forwards to the evaluation's own options; see `qumem eval segmentation --help`.",
    )
    sp.add_argument("what", choices=["segmentation", "segmentation-ood", "locomo", "personamem", "record"])
    sp.add_argument("rest", nargs=argparse.REMAINDER, help="the evaluation's own arguments (PATH first)")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("train-classifier", help="retrain the continuity classifier (reproducible, as shipped) into "
                        "--out, with the learned boundary rule that ships")
    sp.add_argument("--out", default=None, help="artifact dir (default .artifacts/continuity/); the committed "
                    "qumem_pipeline/artifacts/continuity/ only with --overwrite-shipped")
    sp.add_argument("--overwrite-shipped", action="store_true",
                    help="replace the committed artifact qumem_pipeline/artifacts/continuity/")
    sp.add_argument("--json", action="store_true", help="print one JSON object (out, version) as the last line")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--mix", default="ood,gen", help="besides TIAGE train: ood (LoCoMo excerpts joined), gen "
                    "(generated task dialogues), from calibration halves only; '' = TIAGE alone")
    sp.set_defaults(func=cmd_train_classifier)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
