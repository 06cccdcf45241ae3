"""Code versions from source: the hashing that every stage's version is made of, over what the stage hands in.

Dagster compares an asset's code_version with the one its last materialization recorded and shows
the asset (and everything downstream) as stale when they differ; every output row carries the
same string in its `code_version` column. A stage declares its version in its own `version` module
(`ingest/version.py`, `episodes/version.py`, ..., a `StageSpec` per stage) and this module hashes
what it is handed, importing no stage:

- the source bytes of the stage's entry modules and of every `qumem_pipeline` module they import,
  found by reading the files (their import lines; the syntax tree where a line may hide one), never
  by importing them, because Dagster imports definitions in every process and models must not load;
- what else decides its output (`StageSpec.inputs`: the classifier artifact, the LLM kind/model, the
  embedder package, read when the version is computed);
- the full versions of its upstream stages (`StageSpec.upstream`, the asset graph), so a change moves
  its stage and everything downstream, and nothing else.

`qumem_pipeline/code_versions.py` (above the stages) gathers every stage's spec; a stage's own code
asks its `version` module, which knows its upstream stages' specs. Source digests are computed once
per process. The git commit (`git_commit`) is recorded beside the versions (asset materialization
metadata), never part of them and never required.
"""

import ast
import functools
import hashlib
import re
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = PACKAGE_ROOT.name  # "qumem_pipeline"


def _no_inputs() -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class StageSpec:
    """What a stage declares about its version: `entries`, the modules (package-relative) its asset calls,
    whose source and package imports are hashed; `upstream`, the stages whose tables it reads; `inputs`,
    what besides source decides its output, read each time a version is computed (env and artifacts may
    change). Prompt texts and schemas are source of the stage's modules, so the source digest covers them."""

    entries: tuple[str, ...]
    upstream: tuple[str, ...] = ()
    inputs: Callable[[], tuple[str, ...]] = _no_inputs


# Reached by imports but never followed: the version declarations (a stage's `version` module names its
# upstream stages' specs; following them would tie all stages together) and this module; the warehouse
# loader is imported by `forget` for erasure, not to make rows.
_NOT_FOLLOWED = {f"{PACKAGE}.contracts.stage_versions", f"{PACKAGE}.storage.warehouse", f"{PACKAGE}.code_versions"}


def _not_followed(module: str) -> bool:
    parts = module.split(".")
    return module in _NOT_FOLLOWED or (len(parts) == 3 and parts[0] == PACKAGE and parts[2] == "version")


# -- source digests ---------------------------------------------------------------------------
def _module_file(dotted: str) -> Path | None:
    rel = dotted.split(".")[1:]
    base = PACKAGE_ROOT.joinpath(*rel) if rel else PACKAGE_ROOT
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _statements(body: list) -> Iterator[ast.stmt]:
    """Every statement of `body`, nested ones included (functions, classes, if/try/with/loop/match bodies),
    and no expression: imports are statements."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            sub = getattr(node, field, None)
            if isinstance(sub, list):
                stack.extend(reversed(sub))


def _imported_modules_ast(path: Path, dotted: str) -> set[str]:
    """The qumem_pipeline modules a file imports (top level or inside functions), by its syntax tree:
    exact, and the oracle of the faster reader below."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found = set()
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute("." * node.level + (node.module or ""), path, dotted)
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]  # `from a.b import c`: c may be a submodule
        else:
            continue
        found.update(n for n in names if _ours(n))
    return found


# An import statement at the start of a line: `from <module> import <names | (names over lines)>` or
# `import <names>`. In a docstring or string such a line counts too, which can only add a module.
_IMPORT_LINE = re.compile(rb"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\((?:[^)#]|#[^\n]*)*\)|[^\n#]*)|import[ \t]+([^\n#]*))", re.M)
# What the line reader cannot see: an import after a ";" (an import continued by a backslash is seen below).
_IMPORT_AFTER_SEMICOLON = re.compile(rb";[ \t]*(?:from|import)[ \t]")


def _imported_modules(path: Path, dotted: str) -> set[str]:
    """The qumem_pipeline modules a file imports, by its import lines: ~10x cheaper than the syntax tree
    (the code-version walk is a fixed cost of every process, e.g. an incremental ingest), the same
    modules (tests/test_stage_versions.py checks it on every module of the package); a file with an
    import the lines may miss is read by the tree."""
    src = path.read_bytes()
    if _IMPORT_AFTER_SEMICOLON.search(src):
        return _imported_modules_ast(path, dotted)
    found = set()
    for m in _IMPORT_LINE.finditer(src):
        if (m.group(2) if m.group(3) is None else m.group(3)).rstrip().endswith(b"\\"):  # continued on the next line
            return _imported_modules_ast(path, dotted)
        if m.group(3) is not None:
            names = [n.split(" as ")[0].strip() for n in m.group(3).decode().split(",")]
        else:
            mod = _absolute(m.group(1).decode(), path, dotted)
            listed = re.sub(r"#[^\n]*", "", m.group(2).decode()).strip("() \t\r\n").replace("\n", " ")
            names = [mod] + [f"{mod}.{n.split(' as ')[0].strip()}" for n in listed.split(",") if n.strip()]
        found.update(n for n in names if _ours(n))
    return found


def _absolute(module: str, path: Path, dotted: str) -> str:
    """`module` as written after `from` (leading dots: relative to the file's package), made absolute."""
    level = len(module) - len(module.lstrip("."))
    if not level:
        return module
    pkg = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
    parts = pkg.split(".")
    base = ".".join(parts[: len(parts) - level + 1])
    return f"{base}.{module[level:]}" if module[level:] else base


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def stage_modules(entry_modules: tuple[str, ...]) -> list[Path]:
    """Every source file that decides a stage's output: its entry modules (package-relative, as a stage
    declares them) and their package imports."""
    entries = [f"{PACKAGE}.{m}" for m in entry_modules]
    todo = list(entries)
    seen: dict[str, Path] = {}
    while todo:
        mod = todo.pop()
        if mod in seen or (_not_followed(mod) and mod not in entries):
            continue
        path = _module_file(mod)
        if path is None:
            continue
        seen[mod] = path
        todo.extend(m for m in _imported_modules(path, mod) - seen.keys())
    missing = [m for m in entry_modules if f"{PACKAGE}.{m}" not in seen]
    if missing:
        raise RuntimeError(f"entry modules {missing} not found under {PACKAGE_ROOT}")
    return sorted(set(seen.values()))


@functools.lru_cache(maxsize=None)
def source_digest(entry_modules: tuple[str, ...]) -> str:
    """sha256 over the module paths and source bytes a stage's entry modules reach (once per process)."""
    h = hashlib.sha256()
    for p in stage_modules(entry_modules):
        h.update(p.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the checkout the package runs from (+ "-dirty" with uncommitted package changes); None without git."""
    try:
        run = functools.partial(subprocess.run, cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=10)
        head = run(["git", "rev-parse", "HEAD"])
        if head.returncode != 0:
            return None
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."])
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


# -- the versions -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _join(stage: str, *parts: str) -> str:
    """`stage@<12 hex>`: short for the UI, changes when any part changes."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]
    return f"{stage}@{digest}"


def _spec(stage: str, specs: Mapping[str, StageSpec]) -> StageSpec:
    try:
        return specs[stage]
    except KeyError:
        raise KeyError(f"unknown stage {stage!r}; stages: {', '.join(specs)}") from None


def own_version(stage: str, specs: Mapping[str, StageSpec]) -> str:
    """The version of `stage`'s own source and inputs only (what a change touches directly)."""
    spec = _spec(stage, specs)
    return _join(stage, source_digest(tuple(spec.entries)), *spec.inputs())


def full_version(stage: str, specs: Mapping[str, StageSpec], memo: dict[str, str] | None = None) -> str:
    """`stage`'s code_version: own source and inputs plus every upstream stage's full version (all of
    them in `specs`); computes only the stage and its upstream, so ingest alone never touches the LLM
    stages' inputs."""
    memo = {} if memo is None else memo
    if stage not in memo:
        spec = _spec(stage, specs)
        memo[stage] = _join(stage, own_version(stage, specs), *(full_version(u, specs, memo) for u in spec.upstream))
    return memo[stage]


def downstream(stages: set[str], specs: Mapping[str, StageSpec]) -> set[str]:
    """The stages plus every stage in `specs` that reads from them, transitively."""
    out = set(stages)
    changed = True
    while changed:
        changed = False
        for s, spec in specs.items():
            if s not in out and out.intersection(spec.upstream):
                out.add(s)
                changed = True
    return out
