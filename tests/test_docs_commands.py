"""The commands the documentation shows keep working: README.md's two set-up commands are there verbatim,
README.md stays a short guide (<= 150 lines), and every `qumem ...` command shown in README.md or docs/*.md
(code blocks and inline code, after env-var prefixes and `&&` / `;` chains are stripped) parses with the
CLI's own argparse parser. Parsing only: no command runs. `qumem eval locomo ...` (without `--qa`, whose
options live in qa.py's main) is also parsed with the LoCoMo harness's own parser, since `qumem` forwards
an evaluation's arguments unparsed.

A bare `qumem SUBCOMMAND` in inline code is a reference to the subcommand in prose (e.g. "`qumem forget`
deletes..."): only the subcommand's existence is checked. A bare `qumem` is the program's (or the query
strategy's) name and is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

from qumem_pipeline.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SETUP_COMMANDS = (
    "bash scripts/install.sh && .venv/bin/qumem run",
    ".venv/bin/python -m pytest -q",
)
README_MAX_LINES = 150

PROGRAM = re.compile(r"^(?:\.venv/bin/)?qumem$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MENTIONS_QUMEM = re.compile(r"(?:^|[\s;&|])(?:\.venv/bin/)?qumem(?:\s|$)")
CHAIN_OPERATORS = {"&&", "||", ";", "|", "&"}
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


# ------------------------------------------------------------------------------ extraction

def code_snippets(text: str) -> list[tuple[int, str, bool]]:
    """(line number, snippet, inline) for every code line (fenced or indented blocks; lines ending in a
    backslash joined with the next) and every inline code span (a span may wrap across lines)."""
    lines = text.splitlines()
    out: list[tuple[int, str, bool]] = []
    prose: list[str] = []  # the text outside code blocks, code lines blanked (line numbers kept)
    in_fence, prev_blank, prev_indented_code = False, True, False
    pending: tuple[int, str] | None = None  # a code line continued with a backslash

    def code_line(no: int, line: str) -> None:
        nonlocal pending
        if pending is not None:
            no, line = pending[0], pending[1] + " " + line.strip()
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (no, line.rstrip()[:-1].rstrip())
            return
        out.append((no, line.strip(), False))

    for no, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_fence = not in_fence
            prose.append("")
            prev_blank, prev_indented_code = False, False
            continue
        indented = line.startswith(("    ", "\t")) and line.strip() != ""
        if in_fence or (indented and (prev_blank or prev_indented_code)):
            code_line(no, line)
            prose.append("")
            prev_indented_code = not in_fence
        else:
            prose.append(line)
            prev_indented_code = False
        prev_blank = line.strip() == ""
    if pending is not None:
        out.append((pending[0], pending[1], False))

    # inline code, paragraph by paragraph (a span never crosses a blank line)
    para_start, para = 1, []
    for no, line in enumerate([*prose, ""], 1):
        if line.strip():
            if not para:
                para_start = no
            para.append(line)
            continue
        body = "\n".join(para)
        for m in INLINE_CODE.finditer(body):
            out.append((para_start + body[:m.start()].count("\n"), " ".join(m.group(2).split()), True))
        para = []
    return sorted(out)


def _tokens(snippet: str) -> list[str]:
    snippet = re.sub(r"(^|\s)#.*$", "", snippet)  # a shell comment starts a word
    lexer = shlex.shlex(snippet, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def qumem_commands(snippet: str) -> list[list[str]]:
    """The argument lists of every `qumem` / `.venv/bin/qumem` command in a shell snippet: chains split
    at `&&`, `||`, `;`, `|`, `&`, leading `NAME=value` assignments dropped. Raises ValueError when a snippet
    that mentions qumem cannot be split into words."""
    if not MENTIONS_QUMEM.search(snippet):
        return []
    commands, segment = [], []
    for tok in [*_tokens(snippet), ";"]:
        if tok not in CHAIN_OPERATORS:
            segment.append(tok)
            continue
        while segment and ENV_ASSIGNMENT.match(segment[0]):
            segment.pop(0)
        if segment and PROGRAM.match(segment[0]):
            commands.append(segment[1:])
        segment = []
    return commands


def documented_commands() -> list[tuple[str, str, list[str], bool]]:
    """(where, snippet, argv, inline) of every qumem command in README.md and docs/*.md."""
    found = []
    for path in doc_files():
        for no, snippet, inline in code_snippets(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(ROOT)}:{no}"
            try:
                commands = qumem_commands(snippet)
            except ValueError as exc:
                found.append((where, snippet, ["<unsplittable>", str(exc)], inline))
                continue
            found += [(where, snippet, argv, inline) for argv in commands]
    return found


# ------------------------------------------------------------------------------ checking

def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace | None, str | None]:
    """(namespace, None) when argv parses, (None, None) for --help, (None, error) when it does not."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return parser.parse_args(argv), None
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return None, None
        return None, (err.getvalue().strip().splitlines() or [f"exit {exc.code}"])[-1]


def check_command(argv: list[str], inline: bool = False) -> str | None:
    """None when `qumem argv` parses (without running anything), else the parser's complaint."""
    if argv[:1] == ["<unsplittable>"]:
        return f"cannot split into words: {argv[1]}"
    if not argv:
        return None if inline else "`qumem` alone: a subcommand is required"
    parser = build_parser()
    if inline and len(argv) == 1 and not argv[0].startswith("-"):
        return None if argv[0] in _subcommands(parser) else f"no subcommand {argv[0]!r}"
    args, error = _parse(parser, argv)
    if error or args is None:
        return error
    if getattr(args, "command", None) == "eval" and args.what == "locomo" and "--qa" not in args.rest:
        from qumem_pipeline.eval.locomo.harness import build_parser as locomo_parser

        _, error = _parse(locomo_parser(), list(args.rest))
        if error:
            return f"qumem eval locomo: {error}"
    return None


# ------------------------------------------------------------------------------ the tests

def test_readme_has_the_setup_commands_verbatim():
    code = [s for _, s, inline in code_snippets(README.read_text(encoding="utf-8")) if not inline]
    for cmd in SETUP_COMMANDS:
        assert cmd in code, f"README.md must show `{cmd}` verbatim as a code line"


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_documented_qumem_commands_parse():
    found = documented_commands()
    argvs = [argv for _, _, argv, _ in found]
    assert ["run"] in argvs, "extraction found no `.venv/bin/qumem run` (README's set-up command)"
    assert len(found) >= 10, f"only {len(found)} qumem commands found in the docs: is extraction broken?"
    failures = [f"{where}: {snippet!r}: {err}" for where, snippet, argv, inline in found
                if (err := check_command(argv, inline))]
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)


def test_extraction_and_a_bogus_command():
    """The checker finds commands in every form the docs use, and rejects one the CLI does not know."""
    doc = "\n".join([
        "Run `qumem forget` to erase; `qumem` is also a strategy; see `qumem/launcher_host`.",
        "With `.venv/bin/qumem eval locomo x.json --units turns",
        "--json` across lines.",
        "",
        "    export DAGSTER_HOME=$PWD/h && .venv/bin/qumem users   # a comment",
        "    QUMEM_LLM_KIND=openai QUMEM_LLM_BASE_URL=http://h:8000/v1 .venv/bin/qumem run \\",
        "        --archive a --format jsonl",
        "",
        "```bash",
        "qumem frobnicate --now",
        "qumem run --users-per-run many",
        "qumem eval locomo x.json --no-such-flag",
        "```",
    ])
    found = [(argv, inline) for _, s, inline in code_snippets(doc) for argv in qumem_commands(s)]
    assert (["forget"], True) in found and ([], True) in found
    assert (["eval", "locomo", "x.json", "--units", "turns", "--json"], True) in found
    assert (["users"], False) in found
    assert (["run", "--archive", "a", "--format", "jsonl"], False) in found
    verdicts = {" ".join(argv): check_command(argv, inline) for argv, inline in found}
    assert verdicts["forget"] is None and verdicts[""] is None and verdicts["users"] is None
    assert verdicts["eval locomo x.json --units turns --json"] is None
    assert verdicts["run --archive a --format jsonl"] is None
    assert "frobnicate" in verdicts["frobnicate --now"]
    assert "many" in verdicts["run --users-per-run many"]
    assert "--no-such-flag" in verdicts["eval locomo x.json --no-such-flag"]
    assert check_command(["forget"]) is not None  # in a code line, a command must be complete
