"""The `qumem` commands that run Dagster: run, ingest, forget, export, users, show, personalize.

`run` and `ingest` log through the CLI logger (short lines on the terminal, every record with its
traceback in <DAGSTER_HOME>/logs/qumem-<job>-<time>-<pid>.log), print a summary of what was made
(`qumem_pipeline.summary`, also written as JSON to <data-root>/run_summary.json) and, when a
run fails, one line naming the failed step or check and its figures, then exit 1.

`qumem_pipeline.cli` parses the arguments and calls `run_command` lazily, so the domain core never
imports Dagster. This module builds the Definitions (`assets.definitions`); nothing in the Dagster
layer imports it back (tests/test_architecture.py), so the two never form an import circle. Pipeline commands are in-process Dagster runs against the instance in
$DAGSTER_HOME (default ./.dagster_home), so `dagster dev` pointed at the same home shows every run
the CLI made.
"""

import argparse
import fcntl
import json
import os
import sys
import time
import traceback
import uuid
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg

from qumem_pipeline.runtime.instance_config import install_instance_config


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

    from assets.cli_log import terminal_line
    from qumem_pipeline.runtime.progress import ProgressLine

    pipeline = defs.resources["pipeline"]
    # the archive sync (new and changed files read, users rebuilt) runs here, before any Dagster run
    progress = ProgressLine(lambda msg: print(terminal_line("ingest", msg), file=sys.stderr, flush=True),
                            "archive sync")

    def sync_progress(stage: str, done: int, total: int) -> None:
        if progress.label != stage:
            progress.stage(stage, total)
        progress(done, total)

    with progress:
        found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout(),
                         progress=sync_progress)
    register(instance, sorted(found.fingerprints), pipeline, found.fingerprints)
    return sorted(found.fingerprints)


class RunFailed(Exception):
    """A run `qumem` launched failed; `line` says what failed and the figures that decided."""

    def __init__(self, line: str, run_id: str | None = None):
        super().__init__(line)
        self.line, self.run_id = line, run_id


def run_job(instance, defs, job_name: str, users: list[str], per_run: int, log_file: str | None = None) -> list[str]:
    """Run `job_name` over `users` in runs of at most `per_run` users (contiguous user ranges, or
    bucket ranges naming their users: assets/planning.py). With `log_file`, the runs log through the
    CLI logger (short terminal lines, everything in the file: assets/cli_log.py). Raises `RunFailed`
    at the first run that fails, naming its failed step or check and the figures that decided."""
    from assets.cli_log import with_cli_logger
    from assets.partitions import SCHEME, registered_users
    from assets.planning import pack_runs
    from assets.recovery import fail_dead_runs, launch_tags

    for run_id in fail_dead_runs(instance):  # a killed earlier run would hold its pool slots forever
        print(f"[{job_name}] marked run {run_id} failed: its process was killed", flush=True)
    job = defs.resolve_job_def(job_name)
    run_config: dict = {}
    if log_file:
        job, run_config = with_cli_logger(job, log_file)
    pipeline = defs.resources["pipeline"]
    order = registered_users(instance) if SCHEME == "users" else []  # bucket runs are packed by bucket
    runs = pack_runs(instance, order, set(users), per_run, pipeline=pipeline)
    run_ids = []
    for i, run in enumerate(runs, start=1):
        result = None
        for attempt in range(3):  # a forget may unregister a user of the run between the check and the launch
            run = still_registered(instance, run, pipeline)
            if run is None:
                break
            print(f"[{job_name}] run {i}/{len(runs)}: {len(run.users)} users ({run.users[0]} .. {run.users[-1]})", flush=True)
            launch_id = uuid.uuid4().hex
            try:
                result = job.execute_in_process(
                    instance=instance,
                    run_config=run_config,
                    # who runs it, so recovery on a shared instance fails only provably dead runs
                    tags={**run.tags, **launch_tags(), LAUNCH_TAG: launch_id},
                    raise_on_error=False,
                )
                break
            except dg.DagsterInvalidInvocationError as e:
                if "not a valid range" not in str(e) or attempt == 2:
                    raise
                fail_unlaunched(instance, launch_id)
        if result is None:
            print(f"[{job_name}] run {i}/{len(runs)}: skipped, every user of it was forgotten since it was planned", flush=True)
            continue
        run_ids.append(result.run_id)
        if not result.success:
            raise RunFailed(describe_failure(result, defs, i, len(runs)), result.run_id)
    return run_ids


LAUNCH_TAG = "qumem/launch_id"


def still_registered(instance, run, pipeline):
    """`run` narrowed to its users still registered and not forgotten (a forget since the plan was
    made unregisters them; in the `users` scheme a partition range ending at such a user is no
    longer valid); None when none is left. Bucket runs keep their ranges: their steps skip
    forgotten users themselves (assets/partitions.not_forgotten)."""
    from assets.partitions import SCHEME, registered_among
    from assets.planning import RANGE_END, RANGE_START, PlannedRun

    forgotten = pipeline.forgotten() if hasattr(pipeline, "forgotten") else None
    live = [u for u in run.users if forgotten is None or not forgotten.contains(u)]
    if SCHEME == "users":
        registered = registered_among(instance, live)
        live = [u for u in live if u in registered]
    if not live:
        return None
    if live == run.users or SCHEME != "users":
        return run
    return PlannedRun(live, live[0], live[-1], {**run.tags, RANGE_START: live[0], RANGE_END: live[-1]})


def fail_unlaunched(instance, launch_id: str) -> None:
    """A launch refused after its run record was made leaves it NOT_STARTED forever, and a forget
    would wait for it: mark it failed."""
    for rec in instance.get_runs(filters=dg.RunsFilter(tags={LAUNCH_TAG: launch_id})):
        if rec.status in (dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING):
            instance.report_run_failed(rec)


def _root_error(err) -> str:
    """The innermost error's first line (a step's own exception, not Dagster's wrapper)."""
    while getattr(err, "cause", None) is not None:
        err = err.cause
    first = (err.message or "").strip().splitlines()
    return first[0] if first else err.cls_name or "error"


def describe_failure(result, defs, run_no: int, runs: int) -> str:
    """What failed in a run and the figures that decided: a failed blocking check (its description and
    metadata, and where to look), else the first failed step's own error."""
    pipeline = defs.resources["pipeline"]
    layout = pipeline.layout()
    where = f"run {run_no}/{runs} ({result.run_id[:8]})"
    for ev in result.get_asset_check_evaluations():
        if ev.passed:
            continue
        asset, name = ev.asset_key.to_user_string(), ev.check_name
        meta = {k: getattr(v, "value", v) for k, v in (ev.metadata or {}).items()}
        figures = ev.description or ", ".join(f"{k}={v}" for k, v in meta.items())
        if meta.get("quarantined_by_field"):
            figures += f"; by field: {meta['quarantined_by_field']}"
        if name == "quarantine_under_ceiling" and meta.get("quarantine_table"):
            look = (f"the bad rows are in the quarantine table {meta['quarantine_table']}; fix them in "
                    f"{pipeline.archive_path} or raise QUMEM_MAX_QUARANTINE_FRACTION")
        elif name == "quarantine_under_ceiling":  # blocked before the sync's commit
            look = (f"nothing of these users was written; fix the rows in {pipeline.archive_path} (each listed in the "
                    "log) or raise QUMEM_MAX_QUARANTINE_FRACTION")
        else:
            look = f"the table {layout.table_dir(asset)} keeps its previous version"
        return f"{where}: blocking check {asset}:{name} failed: {figures}; {look}"
    for ev in result.all_events:
        if ev.event_type_value == "STEP_FAILURE":
            return f"{where}: step {ev.step_key} failed: {_root_error(ev.event_specific_data.error)}"
    for ev in result.all_events:  # failed outside a step's body, e.g. a resource (a model) that did not load
        err = getattr(ev.event_specific_data, "error", None)
        if err is not None:
            return f"{where}: {ev.event_type_value.lower().replace('_', ' ')}: {_root_error(err)}"
    return f"{where}: the run failed (status {result.dagster_run.status.value})"


def step_wall_times(instance, run_ids: list[str]) -> dict[str, float]:
    """Seconds each step (one per asset in-process) took, summed over the runs, in the order they ran."""
    firsts: dict[str, float] = {}
    total: dict[str, float] = {}
    for run_id in run_ids:
        for st in instance.get_run_step_stats(run_id):
            if st.start_time is None or st.end_time is None:
                continue
            total[st.step_key] = total.get(st.step_key, 0.0) + (st.end_time - st.start_time)
            firsts.setdefault(st.step_key, st.start_time)
    return {k: round(total[k], 3) for k in sorted(total, key=lambda k: firsts[k])}


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _log_file(job_name: str) -> Path:
    home = Path(os.environ["DAGSTER_HOME"])
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    path = home / "logs" / f"qumem-{job_name}-{stamp}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _summary_json_path(pipeline) -> Path:
    """<data-root>/run_summary.json on a local data root, else in the Dagster home."""
    root = str(pipeline.data_root)
    base = Path(os.environ["DAGSTER_HOME"]) if "://" in root else Path(root)
    base.mkdir(parents=True, exist_ok=True)
    return base / "run_summary.json"


def build_summary(instance, defs, users: list[str], run_ids: list[str], started: datetime, wall_s: float,
                  log_file: Path | None) -> dict:
    """The end-of-run summary (`qumem_pipeline.summary`) plus what the orchestrator knows."""
    from qumem_pipeline.summary import collect

    pipeline = defs.resources["pipeline"]
    wh = pipeline.warehouse()
    if wh.path.exists():
        with wh.connect(read_only=True) as con:
            summary = collect(con, users, paid_since=started)
    else:
        summary = collect(duckdb_memory(), users, paid_since=started)
    summary = {"status": "succeeded", "started_at": started.isoformat(), "wall_s": round(wall_s, 3),
               "runs": run_ids, **summary}
    summary["wall_s_by_stage"] = step_wall_times(instance, run_ids)
    layout = pipeline.layout()
    summary["locations"] = {
        "data_root": str(pipeline.data_root), "warehouse": str(wh.path.absolute()),
        "quarantine": layout.table_dir("quarantine"), "dagster_home": os.environ.get("DAGSTER_HOME"),
        "summary_json": str(_summary_json_path(pipeline)), "log": str(log_file) if log_file else None,
    }
    return summary


def duckdb_memory():
    import duckdb

    return duckdb.connect(":memory:")


def write_summary_json(summary: dict) -> None:
    """The figures as JSON (the samples stay on the terminal: user text outside the tables would outlive a forget)."""
    path = Path(summary["locations"]["summary_json"])
    public = {k: v for k, v in summary.items() if k != "samples"}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(public, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


def _fail(job_name: str, line: str, log_file: Path | None, exc: BaseException | None = None) -> int:
    """A failed command: the traceback to the log file, one readable line on stderr, exit status 1."""
    if log_file is not None and exc is not None:
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(f"\nqumem {job_name} failed:\n")
            traceback.print_exception(exc, file=f)
    where = f"; full log and traceback: {log_file}" if log_file else ""
    print(f"qumem: {job_name} FAILED: {line}{where}", file=sys.stderr, flush=True)
    return 1


def cmd_pipeline(args: argparse.Namespace, job_name: str) -> int:
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    instance = _instance()
    log_file = _log_file(job_name)
    try:
        defs = _defs()
        users = register_users(instance, defs)
        if not users:
            print("no valid users found in the archive", file=sys.stderr)
            return 1
        per_run = args.users_per_run or int(os.environ.get("QUMEM_USERS_PER_RUN", "50"))
        print(f"{len(users)} users in {defs.resources['pipeline'].archive_path}; log: {log_file}", flush=True)
        run_ids = run_job(instance, defs, job_name, users, per_run, log_file=str(log_file))
        summary = build_summary(instance, defs, users, run_ids, started, time.perf_counter() - t0, log_file)
        write_summary_json(summary)
    except RunFailed as exc:
        return _fail(job_name, exc.line, log_file)
    except Exception as exc:  # noqa: BLE001 - any failure: one line here, the traceback in the log
        first = (str(exc).strip().splitlines() or [""])[0]
        return _fail(job_name, f"{type(exc).__name__}: {first}", log_file, exc)
    from qumem_pipeline.summary import render_summary

    render_summary(summary, _console())
    if args.json:
        public = {k: v for k, v in summary.items() if k != "samples"}
        print(json.dumps({"users": len(users), "runs": run_ids, "warehouse": defs.resources["pipeline"].warehouse().counts(),
                          "summary": public}, default=str))
    return 0


def _valid_user_id(user_id: str) -> bool:
    """Check a user id from the command line; a bad one is reported on stderr."""
    from qumem_pipeline.contracts.ids import InvalidUserId, validate_user_id

    try:
        validate_user_id(user_id)
    except InvalidUserId as e:
        print(f"error: {e}", file=sys.stderr)
        return False
    return True


def cmd_show(args: argparse.Namespace) -> int:
    """`qumem show USER_ID`: the user's episodes, memories and query states from the warehouse."""
    from qumem_pipeline.summary import render_user, user_view

    if not _valid_user_id(args.user_id):
        return 2
    wh = _defs().resources["pipeline"].warehouse()
    if not wh.path.exists():
        print(f"no warehouse at {wh.path}: run `qumem run` first (or pass --data-root / --warehouse)", file=sys.stderr)
        return 1
    with wh.connect(read_only=True) as con:
        view = user_view(con, args.user_id)
    if view is None:
        print(f"unknown user {args.user_id!r}: the warehouse {wh.path} holds nothing of theirs "
              "(`qumem users` lists the registered users)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(view, default=str))
        return 0
    render_user(view, _console())
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    if not _valid_user_id(args.user_id):
        return 2
    from assets.cli_log import with_cli_logger

    instance = _instance()
    # as `run` and `ingest`: short lines on the terminal, every record and traceback in the log file,
    # and a failure ends with one line naming what failed and where (never Dagster's stack traces)
    log_file = _log_file("forget")
    try:
        defs = _defs()
        if getattr(args, "verify", False):
            report = audit_erasure(instance, defs, args.user_id, list(args.canary or []))
            print(json.dumps(report, indent=1))
            print(json.dumps({"user_found": report["found"], "objects_scanned": report["data_root"]["objects_scanned"]}))
            return 1 if report["found"] else 0
        job, run_config = with_cli_logger(defs.resolve_job_def("forget_user_job"), str(log_file))
        run_config = {**run_config, "ops": {"forget_user_op": {"config": {"user_id": args.user_id}}}}
        result = job.execute_in_process(instance=instance, run_config=run_config, raise_on_error=False)
        if not result.success:
            root = defs.resources["pipeline"].data_root
            return _fail("forget", f"{describe_failure(result, defs, 1, 1)} (data root {root})", log_file)
    except Exception as exc:  # noqa: BLE001 - any failure: one line here, the traceback in the log
        first = (str(exc).strip().splitlines() or [""])[0]
        return _fail("forget", f"{type(exc).__name__}: {first}", log_file, exc)
    print(f"forgot {args.user_id}; log: {log_file}")
    return 0


def audit_erasure(instance, defs, user_id: str, canaries: list[str]) -> dict:
    """`qumem forget --verify`: the data root's objects, every warehouse, the instance's tables and files."""
    from assets.erasure import scan_home_files, scan_instance
    from qumem_pipeline.storage.audit import audit_data_root, audit_warehouse
    from qumem_pipeline.storage.audit import audit_export
    from qumem_pipeline.storage.forget import warehouse_locations
    from qumem_pipeline.storage.table_store import TableStore
    from qumem_pipeline.storage.warehouse_locations import export_locations

    pipeline = defs.resources["pipeline"]
    store = TableStore(pipeline.data_root)
    paths = {p for _, p in warehouse_locations(store)} | {str(pipeline.warehouse().path.absolute())}
    needles = [user_id, *canaries]
    report = {
        "user_id": user_id,
        "data_root": audit_data_root(pipeline.data_root, user_id, canaries),
        "warehouses": [audit_warehouse(p, user_id, canaries) for p in sorted(paths)],
        "exports": [audit_export(p, user_id, canaries) for p in sorted({p for _, p in export_locations(store)})],
        "instance_tables": scan_instance(instance, needles),
        "instance_files": scan_home_files(needles),
    }
    report["found"] = bool(report["data_root"]["hits"] or any(w["hits"] for w in report["warehouses"])
                           or any(e["hits"] for e in report["exports"])
                           or report["instance_tables"] or report["instance_files"])
    return report


def cmd_export(args: argparse.Namespace) -> int:
    defs = _defs()
    out = Path(args.out).resolve()
    pipeline = defs.resources["pipeline"]
    # recorded in the data root first: a later `qumem forget` rewrites these files too
    written = pipeline.warehouse().export_parquet(out, store=pipeline.layout().store)
    for t, p in written.items():
        print(f"{t:<24}{p}")
    if args.json:
        print(json.dumps(written))
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    from assets.partitions import registered_users

    instance = _instance()
    for u in registered_users(instance, _defs().resources["pipeline"]):
        print(u)
    return 0


def cmd_personalize(args) -> int:
    """`qumem personalize --queries PATH_OR_URI [--batch-id ID]`: run `personalize_job` in-process."""
    from assets.personalize import run_config
    from assets.recovery import launch_tags

    queries = args.queries if "://" in args.queries else str(Path(args.queries).resolve())
    instance = _instance()
    t0 = time.perf_counter()
    result = _defs().resolve_job_def("personalize_job").execute_in_process(
        instance=instance, run_config=run_config(queries, args.batch_id, args.query_format, args.chunk_rows),
        tags=launch_tags(), raise_on_error=False)
    wall = time.perf_counter() - t0
    if not result.success:
        errs = [e.step_failure_data.error for e in result.all_events if e.is_step_failure]
        first = errs[0] if errs else None
        while first is not None and getattr(first, "cause", None) is not None and not (first.message or "").strip():
            first = first.cause
        line = ((first.message if first else "") or "").strip().splitlines()
        print(f"qumem: personalize_job FAILED: {line[0] if line else 'see the Dagster run ' + result.run_id}",
              file=sys.stderr)
        return 1
    report = result.output_for_node("export_personalization_op")
    print(f"batch {report['batch_id']} ({report['format']}, {report['rows']} rows, {report['chunks']} chunks, "
          f"strategy {report['strategy']})")
    for label, key in (("answered", "answered"), ("already done (earlier run)", "already_done"),
                       ("quarantined: bad input rows", "quarantined_input"),
                       ("quarantined: users without memories", "quarantined_user"),
                       ("quarantined: unusable LLM output", "quarantined_llm"), ("LLM calls", "llm_calls"),
                       ("LLM calls sent", "llm_calls_sent"), ("LLM calls replayed", "llm_calls_replayed")):
        print(f"  {label:<36}{report[key]}")
    print(f"  tables: personalization, personalization_quarantine, personalization_llm_ledger; warehouse rows "
          f"{report['warehouse_rows']}; run {result.run_id}; {wall:.1f}s")
    if args.json:
        print(json.dumps({**report, "run_id": result.run_id, "wall_s": round(wall, 3)}, default=str))
    return 0


COMMANDS = {
    "run": lambda a: cmd_pipeline(a, "main_job"),
    "ingest": lambda a: cmd_pipeline(a, "ingest_job"),
    "forget": cmd_forget,
    "export": cmd_export,
    "users": cmd_users,
    "show": cmd_show,
    "personalize": cmd_personalize,
}


def run_command(name: str, args: argparse.Namespace) -> int:
    """Run the Dagster-backed command `name` (flags already applied to the environment)."""
    return COMMANDS[name](args)
