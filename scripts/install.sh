#!/usr/bin/env bash
# Installs qumem-pipeline and everything it needs into ./.venv, from the project's own files.
# Idempotent: rerunning it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

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
if [ -f scripts/install_llm_model.sh ]; then
  bash scripts/install_llm_model.sh
fi
echo "installed: $(python -c 'import qumem_pipeline; print("qumem-pipeline", qumem_pipeline.__version__)')"
