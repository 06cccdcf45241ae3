"""Stage code versions come from source: editing one stage's module in a copy of the package moves that
stage's version and its downstream stages' versions, and no other (each computed in a fresh process)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qumem_pipeline import code_versions
from qumem_pipeline.code_versions import STAGE_UPSTREAM, STAGES, downstream
from qumem_pipeline.contracts import stage_versions
from qumem_pipeline.llm.version import llm_model_id

PACKAGE = Path(stage_versions.__file__).resolve().parents[1]
PRINT_VERSIONS = (
    "import json, qumem_pipeline.code_versions as sv; "
    "print(json.dumps({'file': sv.__file__, 'own': sv.stage_own_versions(), 'full': sv.stage_code_versions(), "
    "'git': sv.git_commit()}))"
)


def _versions_of(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", PRINT_VERSIONS], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).resolve().is_relative_to(root.resolve()), got["file"]  # the copy, not the checkout
    return got


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    """A pristine copy of the package and its versions; each test edits a further copy of it."""
    base = tmp_path_factory.mktemp("pkg")
    shutil.copytree(PACKAGE, base / "qumem_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    return base, _versions_of(base)


def _edited(tmp_path: Path, base: Path, rel: str) -> dict:
    root = tmp_path / "edited"
    shutil.copytree(base, root)
    with open(root / "qumem_pipeline" / rel, "a") as f:
        f.write("\n# an edit that changes the source bytes\n")
    return _versions_of(root)


def _moved(before: dict, after: dict, kind: str) -> set[str]:
    return {s for s in STAGES if before[kind][s] != after[kind][s]}


@pytest.mark.parametrize("rel,own", [
    ("memories/decompose.py", {"memories", "query_states"}),  # the strategies read MEMORY_TYPES from decompose
    ("episodes/segmentation.py", {"episodes"}),
    ("query/strategies/adamem/graph.py", {"memory_graph", "query_states"}),  # the AdaMem retriever walks the graph
    ("index/vector_store.py", {"memory_indexes", "query_states"}),
    ("storage/warehouse.py", {"warehouse"}),
])
def test_editing_a_stage_moves_it_and_only_its_downstream(package_copy, tmp_path, rel, own):
    base, before = package_copy
    after = _edited(tmp_path, base, rel)
    assert _moved(before, after, "own") == own
    assert _moved(before, after, "full") == downstream(own)


def test_versions_are_stable_across_processes_and_need_no_git(package_copy):
    base, before = package_copy
    again = _versions_of(base)
    assert again["full"] == before["full"] and again["own"] == before["own"]
    assert before["git"] is None  # a copy outside any checkout: versions still computed


def test_git_commit_is_recorded_beside_versions_in_a_checkout():
    commit = stage_versions.git_commit()
    if shutil.which("git") is None or not (PACKAGE.parent / ".git").exists():
        pytest.skip("not running from a git checkout")
    assert commit is not None and len(commit.split("-")[0]) == 40


def test_every_package_module_is_claimed_or_declared_outside_the_stages():
    """A new module under a stage's imports is hashed automatically; modules no stage reaches are listed here,
    so a stage whose output depends on an unlisted module cannot silently keep its version."""
    claimed = {p.relative_to(PACKAGE).as_posix() for s in (*STAGES, *code_versions.JOB_STAGES)
               for p in code_versions.stage_files(s)}
    everything = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    unclaimed = everything - claimed
    outside = ("cli.py", "summary.py", "code_versions.py", "eval/", "episodes/continuity/train.py", "episodes/continuity/__main__.py",
               "episodes/continuity/data.py", "episodes/continuity/ood_data.py", "episodes/continuity/generated_dialogues.py",
               "episodes/continuity/tune_decoding.py", "episodes/continuity/tune_learned.py",
               "episodes/continuity/__init__.py",
               "episodes/__init__.py", "episodes/dialogues.py", "episodes/metrics.py", "contracts/",
               "ingest/discovery.py", "ingest/incremental.py", "ingest/__init__.py", "llm/__init__.py",
               "memories/__init__.py", "index/__init__.py", "query/__init__.py", "query/strategies/__init__.py",
               "query/strategies/adamem/__init__.py", "runtime/", "storage/", "embedding/__init__.py",
               "memories/readability.py")  # measures a run's tables (bench/embedded_models.py); no stage reads it
    # every stage's `version` module declares versions and is never hashed
    assert sorted(m for m in unclaimed if not m.startswith(outside) and not m.endswith("/version.py")) == []
    assert not {m for m in claimed if m.endswith("/version.py") or m == "code_versions.py"}
    for must in ("memories/decompose.py", "llm/local_backend.py", "llm/openai_backend.py", "ingest/validate.py",
                 "episodes/segmentation.py", "query/strategies/qumem.py", "query/strategies/adamem/graph.py"):
        assert must in claimed, must


def test_stage_upstream_matches_the_asset_graph():
    from assets.definitions import ALL_ASSETS

    deps = {}
    for a in ALL_ASSETS:
        for key in a.keys:
            deps[key.to_user_string()] = {d.to_user_string() for d in a.asset_deps[key]}
    assert set(deps) == set(STAGES)
    assert {s: set(STAGE_UPSTREAM[s]) for s in STAGES} == deps


def test_row_version_equals_the_asset_code_version():
    from assets.definitions import ALL_ASSETS

    by_asset = {k.to_user_string(): v for a in ALL_ASSETS for k, v in a.code_versions_by_key.items()}
    assert {s: code_versions.stage_version(s) for s in STAGES} == by_asset
    assert len(set(by_asset.values())) == len(STAGES)
    with pytest.raises(KeyError, match="unknown stage"):
        code_versions.stage_version("nope")


def test_llm_id_follows_the_environment_default_backend(monkeypatch):
    for k in ("QUMEM_LLM_KIND", "QUMEM_LLM_MODEL", "QUMEM_LLM_BASE_URL", "QUMEM_ENV"):
        monkeypatch.delenv(k, raising=False)
    assert llm_model_id().startswith("local:SmolLM2")
    monkeypatch.setenv("QUMEM_ENV", "production")  # production's resources default to the openai backend
    monkeypatch.setenv("QUMEM_LLM_BASE_URL", "http://vllm-a:8000/v1")
    a = code_versions.stage_version("memories")
    assert llm_model_id() == "openai:served-by:http://vllm-a:8000/v1"
    monkeypatch.setenv("QUMEM_LLM_BASE_URL", "http://vllm-b:8000/v1")
    assert code_versions.stage_version("memories") != a


def _dotted(path: Path) -> str:
    rel = path.relative_to(stage_versions.PACKAGE_ROOT.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)


def test_the_import_line_reader_finds_every_module_the_syntax_tree_finds():
    """The cheap reader may only add names (an import line in a docstring), never a module file the
    tree does not see, and it walks every stage to the same files."""
    for path in sorted(stage_versions.PACKAGE_ROOT.rglob("*.py")):
        by_tree = stage_versions._imported_modules_ast(path, _dotted(path))
        by_lines = stage_versions._imported_modules(path, _dotted(path))
        assert by_tree <= by_lines, (path, by_tree - by_lines)
        assert all(stage_versions._module_file(m) is None for m in by_lines - by_tree), (path, by_lines - by_tree)
    readers = (stage_versions._imported_modules, stage_versions._imported_modules_ast)
    walks = []
    for reader in readers:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(stage_versions, "_imported_modules", reader)
            walks.append({s: code_versions.stage_files(s) for s in STAGES})
    assert walks[0] == walks[1]


@pytest.mark.parametrize("source, expected", [
    ("from . import a, b as c\n", {"qumem_pipeline.x", "qumem_pipeline.x.a", "qumem_pipeline.x.b"}),
    ("from ..y import (\n    z,  # a comment (with parens)\n    w,\n)\n",
     {"qumem_pipeline.y", "qumem_pipeline.y.z", "qumem_pipeline.y.w"}),
    ("def f():\n    import qumem_pipeline.q.r as s, os\n", {"qumem_pipeline.q.r"}),
    ("from qumem_pipeline.m import \\\n    n\n", {"qumem_pipeline.m", "qumem_pipeline.m.n"}),  # the tree reads it
    ("x = 1; from qumem_pipeline.k import v\n", {"qumem_pipeline.k", "qumem_pipeline.k.v"}),  # the tree reads it
])
def test_the_import_line_reader_on_the_forms_imports_take(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source)
    dotted = "qumem_pipeline.x.mod"
    assert stage_versions._imported_modules(path, dotted) == expected
    assert stage_versions._imported_modules_ast(path, dotted) == expected
