"""The layering rules of ARCHITECTURE.md, checked on the source: every import of every module the project
ships (qumem_pipeline/, assets/, resources/, deploy/, bench/, scripts/), module level and inside functions
alike, parsed with `ast`.

- no import circle anywhere (a package's `__init__` is a module: `from pkg import x` imports `pkg` first);
- the domain core never imports dagster (or dagster_*);
- it never imports the Dagster layer (assets, resources, deploy), except the CLI's one lazy call
  into `assets.cli_commands` for the commands that run Dagster jobs, which nothing in the Dagster layer
  imports back;
- the ground floors (contracts/, runtime/) import no stage, and the shared floors (storage/, llm/,
  embedding/) import no stage either;
- evaluation (qumem_pipeline.eval) is imported by nothing outside it;
- query strategies never import each other (they meet in `strategies.registry`);
- the Dagster layer is thin: every @asset function body is at most 40 lines.

And a fresh interpreter that imports every module finds no dagster in sys.modules.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "qumem_pipeline"
ROOTS = ("qumem_pipeline", "assets", "resources", "deploy", "bench", "scripts")
SCRIPT_DIRS = ("bench", "scripts")  # run as scripts: a bare `import x` may name a sibling file
DAGSTER_LAYER = ("assets", "resources", "deploy")
CLI_COMMANDS = "assets.cli_commands"
ALLOWED_LAYER_EDGES = {("qumem_pipeline.cli", CLI_COMMANDS)}
STAGE_FOLDERS = ("ingest", "episodes", "memories", "index", "query", "eval")
GROUND_FLOORS = ("contracts", "runtime")
SHARED_FLOORS = ("storage", "llm", "embedding")
MAX_ASSET_BODY_LINES = 40
STRATEGY_MODULES = {
    "qumem_pipeline.query.strategies.qumem",
    "qumem_pipeline.query.strategies.topk",
    "qumem_pipeline.query.strategies.adamem.strategy",
    "qumem_pipeline.query.strategies.hybrid",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


ALL_MODULES = {module_name(p): p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}
MODULES = {m: p for m, p in ALL_MODULES.items() if m.split(".")[0] == "qumem_pipeline"}  # the domain core


def known_module(target: str) -> str | None:
    """The project module an import lands on (the longest known prefix), or None outside the project."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in ALL_MODULES:
            return cand
    return None


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, wherever it is.

    `from pkg import x` imports the package `pkg` (its `__init__` runs) and, when x is a submodule,
    `pkg.x` too: both are edges. `import pkg.mod` names the module only."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names if f"{base}.{a.name}" in ALL_MODULES]
    if name.split(".")[0] in SCRIPT_DIRS:  # `from decompose_cost import ...` in bench/ names bench/decompose_cost.py
        here = name.rpartition(".")[0]
        out = [(f"{here}.{t}" if known_module(t) is None and f"{here}.{t.split('.')[0]}" in ALL_MODULES else t, ln)
               for t, ln in out]
    return out


IMPORTS = {name: imports_of(name, path) for name, path in ALL_MODULES.items()}


def core_target(target: str) -> str | None:
    """The core module an import lands on (the longest known prefix), or None outside the core."""
    found = known_module(target)
    return found if found in MODULES else None


def test_the_parser_sees_imports_inside_functions():
    # a known lazy import (inside a function) must be found, or the checks below prove nothing
    # the CLI's one import of the Dagster layer sits inside a function
    cli = ast.parse(MODULES["qumem_pipeline.cli"].read_text())
    top_level = {n.lineno for n in cli.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    lazy = [ln for t, ln in IMPORTS["qumem_pipeline.cli"] if t == CLI_COMMANDS]
    assert lazy and not set(lazy) & top_level
    assert len(MODULES) > 60 and "qumem_pipeline.query.strategies.registry" in MODULES
    # every shipped folder is read, and a bench's bare import of a sibling script is resolved
    assert {m.split(".")[0] for m in ALL_MODULES} == set(ROOTS)
    assert ("bench.decompose_cost", 159) in [(t, ln) for t, ln in IMPORTS["bench.decompose_throughput"]]


def test_core_never_imports_dagster():
    bad = [(m, t, ln) for m, imps in IMPORTS.items() if m in MODULES for t, ln in imps
           if t.split(".")[0] == "dagster" or t.startswith("dagster_")]
    assert not bad, f"dagster imported by the domain core: {bad}"


def test_core_never_imports_the_dagster_layer_but_the_cli_edge():
    bad = sorted((m, t, ln) for m, imps in IMPORTS.items() if m in MODULES for t, ln in imps
                 if t.split(".")[0] in DAGSTER_LAYER and (m, t) not in ALLOWED_LAYER_EDGES)
    assert not bad, f"the domain core imports the Dagster layer: {bad}"
    # the allowed edge is lazy: inside a function, never at module level
    cli = ast.parse(MODULES["qumem_pipeline.cli"].read_text())
    top = [n for n in cli.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top if (getattr(n, "module", None) or "").split(".")[0] in DAGSTER_LAYER
                or any(a.name.split(".")[0] in DAGSTER_LAYER for a in n.names)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def import_graph(modules=None) -> dict[str, set[str]]:
    """Module -> the project modules it imports (restricted to `modules`, default all of them)."""
    modules = ALL_MODULES if modules is None else modules
    graph = {m: set() for m in modules}
    for m in modules:
        for t, _ in IMPORTS[m]:
            c = known_module(t)
            if c and c != m and c in modules:
                graph[m].add(c)
    return graph


def core_graph() -> dict[str, set[str]]:
    return import_graph(MODULES)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle as the set of modules on it (Tarjan's components of more than one module,
    iterative), sorted: all of them at once, so a failure lists everything to untangle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_a_submodule_importing_its_package_face_is_an_edge(tmp_path):
    # `from pkg import x` inside pkg/sub.py runs pkg/__init__: the edge that closes a face circle
    face = imports_of("qumem_pipeline.llm.local_backend", CORE / "llm" / "local_backend.py")
    assert all(t != "qumem_pipeline.llm" for t, _ in face)
    src = tmp_path / "sub.py"
    src.write_text("def f():\n    from qumem_pipeline.llm import model_store\n")
    assert {t for t, _ in imports_of("qumem_pipeline.llm.sub", src)} == {"qumem_pipeline.llm", "qumem_pipeline.llm.model_store"}


def test_import_graph_has_no_cycle_anywhere():
    graph = import_graph()
    circles = strongly_connected(graph)
    lines = [" <-> ".join(c) + "   edges: " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
             for c in circles]
    assert not circles, "import circles:\n" + "\n".join(lines)


def test_nothing_in_the_dagster_layer_imports_the_cli_commands():
    # the CLI's Dagster commands build the Definitions; importing them back would close a circle
    assert CLI_COMMANDS in ALL_MODULES
    bad = sorted((m, ln) for m, imps in IMPORTS.items() for t, ln in imps
                 if known_module(t) == CLI_COMMANDS and m.split(".")[0] in DAGSTER_LAYER + ("qumem_pipeline",)
                 and (m, CLI_COMMANDS) not in ALLOWED_LAYER_EDGES)
    assert not bad, f"imported back by the Dagster layer or the core: {bad}"


@pytest.mark.parametrize("floor", GROUND_FLOORS + SHARED_FLOORS)
def test_floors_import_no_stage(floor):
    """Imports run one way: stages -> shared floors -> ground floors; the ground floors (contracts,
    runtime) import nothing of the package but each other."""
    graph = core_graph()
    prefix = f"qumem_pipeline.{floor}"
    mods = [m for m in graph if m == prefix or m.startswith(prefix + ".")]
    assert mods, f"no modules under {prefix}"
    allowed = {"qumem_pipeline"} | {f"qumem_pipeline.{f}" for f in GROUND_FLOORS}
    if floor in SHARED_FLOORS:
        allowed |= {f"qumem_pipeline.{f}" for f in SHARED_FLOORS}
    bad = sorted((m, t) for m in mods for t in graph[m]
                 if t != "qumem_pipeline" and ".".join(t.split(".")[:2]) not in allowed)
    assert not bad, f"{floor}/ imports a floor above it: {bad}"


def test_eval_is_imported_only_by_eval():
    bad = [(m, c) for m, deps in core_graph().items() for c in deps
           if (c == "qumem_pipeline.eval" or c.startswith("qumem_pipeline.eval."))
           and not (m == "qumem_pipeline.eval" or m.startswith("qumem_pipeline.eval."))
           and m != "qumem_pipeline.cli"]  # `qumem eval ...` forwards to the evaluation's own parser
    assert not bad, f"product code imports the evaluation: {bad}"


def test_strategies_never_import_each_other():
    graph = core_graph()
    assert STRATEGY_MODULES <= set(MODULES)
    bad = [(m, c) for m in STRATEGY_MODULES for c in graph[m] if c in STRATEGY_MODULES or c.endswith(".registry")]
    assert not bad, f"a strategy module imports another strategy: {bad}"


def asset_bodies() -> list[tuple[str, str, int]]:
    """(file, function, body lines) of every function decorated @asset / @dg.asset / @multi_asset in assets/:
    from the first statement after its docstring to its last line."""
    out = []
    for path in sorted((REPO / "assets").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            names = {ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] for d in node.decorator_list}
            if not names & {"asset", "multi_asset"}:
                continue
            body = node.body[1:] if (isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                                     and isinstance(node.body[0].value.value, str)) else node.body
            out.append((path.name, node.name, node.end_lineno - body[0].lineno + 1))
    return out


def test_every_asset_body_is_thin():
    bodies = asset_bodies()
    # the measure sees every asset of the definitions (turns ... warehouse, the AdaMem extras)
    assert {"turns", "episodes", "memories", "memory_embeddings", "memory_indexes", "query_states",
            "warehouse", "persona_profiles", "memory_graph"} <= {name for _, name, _ in bodies}
    fat = sorted((n, f"{f}:{name}") for f, name, n in bodies if n > MAX_ASSET_BODY_LINES)
    assert not fat, f"asset bodies over {MAX_ASSET_BODY_LINES} lines (move the work into the stage): {fat}"


def test_every_registered_strategy_has_a_module_here():
    from qumem_pipeline.query.strategies.registry import STRATEGY_NAMES, get_strategy

    assert set(STRATEGY_NAMES) == {"qumem", "topk", "adamem", "qumem_hybrid"}
    for name in STRATEGY_NAMES:
        s = get_strategy(name)
        assert s.name == name and s.version and type(s).__module__ in STRATEGY_MODULES
    with pytest.raises(ValueError, match="unknown strategy"):
        get_strategy("nope")


def test_importing_every_core_module_loads_no_dagster():
    # __main__ modules run their command on import (continuity/__main__ retrains the classifier)
    names = [m for m, p in MODULES.items() if p.name != "__main__.py"]
    code = ("import importlib, json, sys\n"
            f"for m in {names!r}:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] == 'dagster' or k.startswith('dagster_'))))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], "dagster loaded by importing the domain core"


def test_architecture_md_names_what_this_test_checks():
    """ARCHITECTURE.md stays true to the code: the files it names exist, and its layering rule names every
    folder the circle check reads and the module the CLI's Dagster commands live in."""
    import re

    text = (REPO / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([\w./-]+/[\w.-]+\.py)`", text))
    assert named, "ARCHITECTURE.md names no file"
    missing = sorted(p for p in named if not (REPO / p).is_file() and not (CORE / p).is_file())
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"
    rule = text[text.index("## Layering rule"):]
    assert all(f"`{root}/`" in rule for root in ROOTS), "the layering rule must name every folder the circle check reads"
    assert f"`{CLI_COMMANDS.replace('.', '/')}.py`" in rule and "No import circle" in rule
