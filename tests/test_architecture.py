"""The layering rules of ARCHITECTURE.md, checked on the source: every import of every module under
qumem_pipeline/ (module level and inside functions alike), parsed with `ast`.

- the domain core never imports dagster (or dagster_*);
- it never imports the Dagster layer (assets, resources, deploy), except the CLI's one lazy call
  into `assets.commands` for the commands that run Dagster jobs;
- its import graph has no cycle;
- evaluation (qumem_pipeline.eval) is imported by nothing outside it;
- query strategies never import each other (they meet in `strategies.registry`).

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
DAGSTER_LAYER = ("assets", "resources", "deploy")
ALLOWED_LAYER_EDGES = {("qumem_pipeline.cli", "assets.commands")}
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


MODULES = {module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, wherever it is."""
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
            for a in node.names:
                sub = f"{base}.{a.name}"
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                out.append((sub if sub in MODULES else base, node.lineno))
    return out


IMPORTS = {name: imports_of(name, path) for name, path in MODULES.items()}


def core_target(target: str) -> str | None:
    """The core module an import lands on (the longest known prefix), or None outside the core."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in MODULES:
            return cand
    return None


def test_the_parser_sees_imports_inside_functions():
    # a known lazy import (inside a function) must be found, or the checks below prove nothing
    # the CLI's one import of the Dagster layer sits inside a function
    cli = ast.parse(MODULES["qumem_pipeline.cli"].read_text())
    top_level = {n.lineno for n in cli.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    lazy = [ln for t, ln in IMPORTS["qumem_pipeline.cli"] if t == "assets.commands"]
    assert lazy and not set(lazy) & top_level
    assert len(MODULES) > 60 and "qumem_pipeline.query.strategies.registry" in MODULES


def test_core_never_imports_dagster():
    bad = [(m, t, ln) for m, imps in IMPORTS.items() for t, ln in imps
           if t.split(".")[0] == "dagster" or t.startswith("dagster_")]
    assert not bad, f"dagster imported by the domain core: {bad}"


def test_core_never_imports_the_dagster_layer_but_the_cli_edge():
    bad = sorted((m, t, ln) for m, imps in IMPORTS.items() for t, ln in imps
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


def core_graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, imps in IMPORTS.items():
        for t, _ in imps:
            c = core_target(t)
            if c and c != m:
                graph[m].add(c)
    return graph


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_import_graph_has_no_cycle():
    cycle = find_cycle(core_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


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
