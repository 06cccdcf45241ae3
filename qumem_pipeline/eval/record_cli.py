"""``qumem eval record ...``: the evaluation record's tables, checks, pruning and size.

- ``status``: entries, runs, tables and bytes on disk.
- ``table NAME -- ARGS...``: run ``qumem eval ARGS... --replay-only`` from the record (no model) and write
  its figures with the command to ``eval_record/tables/NAME.json``; ``table NAME`` alone runs the
  command stored there again (the way to refresh a table after a change that is meant to move it).
- ``check [NAME...]``: replay every table (or those named) and compare with the committed JSON;
  non-zero and the differences when one moved or a call is missing.
- ``prune [--dry-run]``: replay every recorded run and every table; remove the entries none of them
  asked for (no current prompt uses them: the prompt changed, or the run's settings did).

Each subcommand takes ``--json``: its last stdout line is then one compact JSON object (``status``: its
figures; ``table``: the table written, its path and exit code; ``check``: per table ``"same"``, its
differences or its failed replay, and the exit code; ``prune``: its counts, as without ``--json``).

Every replay runs from the repository root, so the dataset paths in the commands are relative to it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from qumem_pipeline.eval.record import REPO_ROOT, EvalRecord, default_root

# report fields that are figures (compared by `check`); everything else (paths, wall time, counters
# of a run's own calls) may change without the table changing
QA_FIELDS = ("dataset", "model", "strategies", "n_scored", "n_questions", "n_questions_adversarial",
             "questions_by_category", "words_budget", "f1_vs_topk_turns", "f1_vs_qumem", "skipped")
QA_OPTIONAL_FIELDS = ("f1_vs_adamem",)
QA_STRATEGY_FIELDS = ("f1", "bleu1", "n", "per_category", "adversarial", "no_answer", "state_failed",
                      "not_answered", "mean_context_words")
PERSONAMEM_FIELDS = ("n_questions", "distinct_questions", "splits", "prompt_version", "accuracy", "n_scored",
                     "accuracy_by_type", "accuracy_by_split", "vs_topk_turns", "vs_qumem", "accuracy_likelihood",
                     "n_scored_likelihood", "accuracy_by_type_likelihood", "accuracy_by_split_likelihood",
                     "vs_topk_turns_likelihood", "vs_qumem_likelihood", "likelihood_calls", "llm_calls")
RECALL_FIELDS = ("retrieval", "retrieval_by_scoring", "retrieval_with_adversarial", "per_category", "strategies",
                 "n_items", "memory_keys")


def figures(report: dict) -> dict:
    """The part of a report a published table shows: scores, sample sizes, intervals, what was replayed."""
    if "accuracy" in report:  # PersonaMem
        out = {k: report[k] for k in PERSONAMEM_FIELDS if k in report}
    elif "qa" in report:
        out = {k: report.get(k) for k in QA_FIELDS}
        out["qa"] = {s: {k: v.get(k) for k in QA_STRATEGY_FIELDS} for s, v in report["qa"].items()}
        for k in QA_OPTIONAL_FIELDS:  # only where the run had that baseline
            if report.get(k):
                out[k] = report[k]
    else:
        out = {k: report[k] for k in RECALL_FIELDS if k in report}
    rp = report.get("replay") or {}
    out["replayed"] = {"conversations": rp.get("conversations"), "questions": rp.get("questions"),
                       "calls": rp.get("calls_replayed"), "missing_calls": (rp.get("missing") or {}).get("calls"),
                       "memories_match_record": rp.get("memories_match_record")}
    return json.loads(json.dumps(out, default=str))


@contextlib.contextmanager
def _at_repo_root():
    old = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        yield
    finally:
        os.chdir(old)


def replay(args: Sequence[str], record: EvalRecord, quiet: bool = True) -> tuple[int, dict | None]:
    """Run ``qumem eval ARGS --replay-only --json --record ROOT`` in-process; (exit code, report)."""
    def cli_main(argv: list[str]) -> int:  # what `qumem eval locomo|personamem ...` runs (no import of the CLI)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if argv[:2] == ["eval", "personamem"]:
            from qumem_pipeline.eval.personamem.run import main as personamem_main

            return personamem_main(argv[2:])
        from qumem_pipeline.eval.locomo.harness import main as locomo_main

        if argv[:2] != ["eval", "locomo"]:
            raise SystemExit(f"the record replays `qumem eval locomo|personamem ...` commands, not {' '.join(argv[:2])!r}")
        return locomo_main(argv[2:])

    argv = ["eval", *args]
    if "--replay-only" not in argv:
        argv.append("--replay-only")
    if "--json" not in argv:
        argv.append("--json")
    argv += ["--record", str(record.root)]
    buf, err = io.StringIO(), io.StringIO()
    with _at_repo_root(), contextlib.redirect_stdout(buf), (contextlib.redirect_stderr(err) if quiet
                                                            else contextlib.nullcontext()):
        try:
            rc = cli_main(argv)
        except SystemExit as e:  # a refusal (no run in the record, ...): its message is the reason
            print(e, file=sys.stderr if not quiet else err)
            rc = e.code if isinstance(e.code, int) else 1
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else None
    if rc and quiet:
        sys.stderr.write(err.getvalue()[-4000:])
    return int(rc or 0), report


def _tables(record: EvalRecord, names: Sequence[str] = ()) -> list[Path]:
    d = record.root / "tables"
    paths = sorted(d.glob("*.json")) if d.is_dir() else []
    if names:
        paths = [p for p in paths if p.stem in set(names)]
        missing = set(names) - {p.stem for p in paths}
        if missing:
            raise SystemExit(f"no table(s) {sorted(missing)} under {d}")
    return paths


def write_table(record: EvalRecord, name: str, command: Sequence[str], as_json: bool = False) -> int:
    rc, report = replay(command, record, quiet=False)
    path = record.root / "tables" / f"{name}.json"
    if rc or report is None:
        print(f"table {name}: the replay failed (exit {rc}); nothing written", file=sys.stderr)
        if as_json:
            print(json.dumps({"table": name, "written": False, "path": str(path), "rc": rc or 1}))
        return rc or 1
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"command": ["qumem", "eval", *command], "figures": figures(report)}
    path.write_text(json.dumps(body, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
    if as_json:
        print(json.dumps({"table": name, "written": True, "path": str(path), **body, "rc": 0}, ensure_ascii=False))
    return 0


def _diff(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    return [] if a == b else [f"{where}: committed {json.dumps(a)[:200]} != replayed {json.dumps(b)[:200]}"]


def check(record: EvalRecord, names: Sequence[str] = (), as_json: bool = False) -> int:
    bad = 0
    tables = _tables(record, names)
    if not tables:
        print(f"no tables under {record.root / 'tables'}", file=sys.stderr)
        if as_json:
            print(json.dumps({"tables": {}, "rc": 1}))
        return 1
    result: dict[str, object] = {}  # per table: "same", its differences, or its failed replay
    for p in tables:
        body = json.loads(p.read_text())
        rc, report = replay(body["command"][2:], record)
        if rc or report is None:
            print(f"{p.stem}: replay failed (exit {rc})")
            result[p.stem] = {"replay_failed": True, "exit": rc}
            bad += 1
            continue
        diffs = _diff(body["figures"], figures(report))
        print(f"{p.stem}: {'same' if not diffs else f'{len(diffs)} figure(s) moved'}")
        for d in diffs[:40]:
            print("  " + d)
        result[p.stem] = "same" if not diffs else {"differences": diffs}
        bad += bool(diffs)
    rc = 1 if bad else 0
    if as_json:
        print(json.dumps({"tables": result, "rc": rc}, ensure_ascii=False))
    return rc


def _dataset_path(name: str) -> str | None:
    for base in (REPO_ROOT.parent / "shared" / "datasets", REPO_ROOT / ".." / "shared" / "datasets"):
        hits = sorted(base.rglob(name)) if base.is_dir() else []
        if hits:
            return os.path.relpath(hits[0], REPO_ROOT)
    return None


def run_commands(record: EvalRecord) -> list[list[str]]:
    """A replay command for every recorded run and every table."""
    cmds = []
    for r in record.runs():
        ds = _dataset_path(r["dataset"])
        if ds is None:
            print(f"prune: dataset {r['dataset']} not found under ../shared/datasets; its run is not replayed "
                  "(its entries count as unused)", file=sys.stderr)
            continue
        if r["kind"] == "locomo_recall":
            cmds.append(["locomo", ds, *r["argv"][1:], "--replay-model", r["model"]])
            continue
        if r["kind"] == "personamem_mc":
            cmds += personamem_commands(r, ds)
            continue
        st = r["settings"]
        groups: dict[tuple, list[str]] = {}  # strategies that answered the same questions replay together
        for s, keys in r["answered"].items():
            groups.setdefault(tuple(keys), []).append(s)
        for keys, strategies in groups.items():
            s = ",".join(strategies)
            convs = sorted({k.split("#")[0] for k in keys})
            cmd = ["locomo", ds, "--qa", "--strategies", s, "--conversations", ",".join(convs), "--questions",
                   ",".join(keys), "--words", str(st["words"]), "--chunk", str(st["chunk"]), "--llm-max-tokens",
                   str(st["llm_max_tokens"]), "--replay-model", r["model"]]
            if st.get("max_sessions"):
                cmd += ["--max-sessions", str(st["max_sessions"])]
            cmd += ["--state-labels", st.get("state_labels", "raw")]  # runs before state_labels.py: raw
            if st.get("context_tokens"):
                cmd += ["--context-tokens", str(st["context_tokens"])]
            if st.get("decompose"):
                cmd.append("--decompose")
                if st.get("episodes_version"):
                    cmd += ["--episodes-version", st["episodes_version"]]
            elif st.get("memories"):
                cmd += ["--memories", st["memories"]]
            cmds.append(cmd)
    for p in _tables(record):
        cmds.append(json.loads(p.read_text())["command"][2:])
    return cmds


def personamem_commands(r: dict, contexts: str) -> list[list[str]]:
    """Replay commands of one recorded PersonaMem run: strategies that answered the same questions together."""
    st = r["settings"]
    qfile = os.path.join(os.path.dirname(contexts), r["questions"])
    groups: dict[tuple, list[str]] = {}
    for s, keys in r["answered"].items():
        groups.setdefault(tuple(keys), []).append(s)
    cmds = []
    for keys, strategies in groups.items():
        cmd = ["personamem", os.path.dirname(contexts) or ".", "--contexts", contexts, "--questions", qfile,
               "--strategies", ",".join(strategies), "--question-keys", ",".join(keys),
               "--context-ids", ",".join(r["conversations"]), "--methods", ",".join(st["methods"]),
               "--words", str(st["words"]), "--context-tokens", str(st["context_tokens"]), "--chunk", str(st["chunk"]),
               "--llm-max-tokens", str(st["llm_max_tokens"]), "--replay-model", r["model"]]
        if st.get("episodes_version"):
            cmd += ["--episodes-version", st["episodes_version"]]
        cmd += ["--state-labels", st.get("state_labels", "raw")]  # runs before state_labels.py: raw
        cmds.append(cmd)
    return cmds


def prune(record: EvalRecord, dry_run: bool = False) -> int:
    record.touched.clear()
    for cmd in run_commands(record):
        rc, _ = replay(cmd, record)
        print(f"replayed (exit {rc}): qumem eval {' '.join(cmd)[:160]}", file=sys.stderr)
    unused = [k for k in record.keys() if k not in record.touched]
    before = record.size()
    if not dry_run:
        for k in unused:
            record.remove(k)
    print(json.dumps({"entries": before["call_entries"], "used": before["call_entries"] - len(unused),
                      "unused": len(unused), "removed": 0 if dry_run else len(unused), "dry_run": dry_run}))
    return 0


def status(record: EvalRecord, as_json: bool = False) -> int:
    runs = record.runs()
    out = {"root": str(record.root), **record.size(), "runs": len(runs), "models": sorted({r["model"] for r in runs}),
           "tables": [p.stem for p in _tables(record)]}
    print(json.dumps(out) if as_json else json.dumps(out, indent=1))  # --json: one compact line
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qumem eval record", description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", default=None, help="the record (default eval_record/ or $QUMEM_EVAL_RECORD)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="the last stdout line is one compact JSON object")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", parents=[common])
    t = sub.add_parser("table", parents=[common], usage="%(prog)s [--json] name [-- locomo PATH ...]")
    t.add_argument("name")
    t.add_argument("command", nargs=argparse.REMAINDER, help="-- then the `qumem eval` arguments (locomo PATH ...)")
    c = sub.add_parser("check", parents=[common])
    c.add_argument("names", nargs="*")
    p = sub.add_parser("prune", parents=[common])
    p.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    root = Path(args.record) if args.record else (default_root() or REPO_ROOT / "eval_record")
    record = EvalRecord(root.resolve())
    if args.cmd == "status":
        return status(record, args.json)
    if args.cmd == "check":
        return check(record, args.names, args.json)
    if args.cmd == "prune":
        return prune(record, args.dry_run)  # its last stdout line is one compact JSON object, --json or not
    # `table NAME --json [-- ...]`: argparse leaves a `--json` after NAME to the remainder; before `--` it is ours
    rest = list(args.command)
    if "--" in rest:
        cut = rest.index("--")
        head, tail = rest[:cut], rest[cut + 1:]
    else:
        n = next((i for i, a in enumerate(rest) if a != "--json"), len(rest))
        head, tail = rest[:n], rest[n:]
    args.json = args.json or "--json" in head
    command = [a for a in head if a != "--json"] + [a for a in tail if a != "--"]
    if not command:
        path = record.root / "tables" / f"{args.name}.json"
        if not path.is_file():
            raise SystemExit(f"no table {args.name}: give its command after --")
        command = json.loads(path.read_text())["command"][2:]
    return write_table(record, args.name, command, args.json)


if __name__ == "__main__":
    sys.exit(main())
