#!/usr/bin/env bash
# The GPU paths against the CPU (classifier decisions, FAISS top-k): scripts/gpu_check.py, one JSON
# line last. From the repository root of a checkout, on a machine with a CUDA GPU and no network:
#
#     bash scripts/gpu_check.sh            # exit 0: agreed, or "skipped: no CUDA"; 1: mismatch; 2: could not run
#
# Python: $QUMEM_GPU_PYTHON, else the first of python3 / .venv/bin/python whose torch sees CUDA, else
# .venv/bin/python (or python3), which then reports "skipped: no CUDA". Carried beside the checkout (64 MiB at
# most a call, docs/operating.md#gpu-check), one per call:
#   .cache/gpu_check        the fp16 base model (`.venv/bin/python scripts/gpu_check.py --prepare-carry`): --checks classifier
#   .cache/gpu_check_faiss  faiss-gpu pruned to sm_90, CUDA 12 runtime, cuBLAS-12 shim
#                           (`bash scripts/gpu_check_prepare_faiss.sh`): --checks faiss
# and optionally .whl/*.whl (wheels installed into a temporary target, never into the interpreter). Whole run
# bounded by $QUMEM_GPU_CHECK_TIMEOUT seconds (default 540: inside a 10-minute limit).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
py="${QUMEM_GPU_PYTHON:-}"; cuda=0
if [ -n "$py" ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 && cuda=1
else
  for cand in python3 .venv/bin/python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      py="$cand"; cuda=1; break
    fi
  done
fi
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
carries=(.whl/*.whl); [ "$cuda" = 1 ] && carries+=(.cache/gpu_check_faiss/wheels/*.whl)  # cp312 CUDA builds: GPU machine only
wheels=(); for w in "${carries[@]}"; do [ -f "$w" ] && wheels+=("$w"); done
if [ ${#wheels[@]} -gt 0 ]; then
  site="$(mktemp -d /tmp/qumem-gpu-site.XXXXXX)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" >&2 || exit 2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The FAISS GPU carry (scripts/gpu_check_prepare_faiss.sh): faiss-gpu (CUDA 12) with CUDA 12's runtime and
# a cuBLAS-12 forwarding shim onto this machine's cuBLAS 13, laid out as the nvidia-*-cu12 packages faiss
# preloads from (cuBLAS 12's own wheel, ~400 MB, cannot travel).
if [ "$cuda" = 1 ] && [ -d .cache/gpu_check_faiss/site ]; then
  cublas13="$("$py" scripts/gpu_check.py --find-cublas13)"
  export QUMEM_FAISS_CUDA12_SITE="$PWD/.cache/gpu_check_faiss/site" QUMEM_CUBLAS12_SHIM=1 QUMEM_CUBLAS13="$cublas13"
  echo "gpu_check: FAISS carry, cuBLAS-12 shim onto ${cublas13:-(no libcublas.so.13 found)}" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
exec timeout "${QUMEM_GPU_CHECK_TIMEOUT:-540}" "$py" scripts/gpu_check.py "$@"
