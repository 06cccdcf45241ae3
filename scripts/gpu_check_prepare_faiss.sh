#!/usr/bin/env bash
# Prepare .cache/gpu_check_faiss for scripts/gpu_check.sh on a GPU machine with no network, whose image
# has CUDA 13 and torch (run here, where pip can download). Why each part:
# - faiss-gpu (PyPI, CUDA 12): the one pip build with sm_90 code (faiss-gpu-cu12 1.14 has sm_70/80 only:
#   "no kernel image" on an H200, seen). Its 135 MB wheel is over the 64 MiB carry, so every GPU image in
#   libfaiss.so but the SASS for $FAISS_KEEP_SM (90: Hopper) is zeroed (scripts/fatbin_keep_arch.py) and
#   the wheel repacked.
# - CUDA 12's runtime library (from its pip wheel) and a cuBLAS-12 forwarding shim onto the machine's own
#   cuBLAS 13 (scripts/cublas12_shim: the 8 calls faiss makes; cuBLAS 12's wheel is ~400 MB), laid out as
#   the nvidia-*-cu12 packages faiss preloads from (curand: an empty stand-in; libfaiss does not link it).
# ~40 MB: carry it alone (`--checks faiss`); the classifier's carry travels in another call.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/gpu_check_faiss; py="${PYTHON:-python3}"
FAISS_VERSION="${FAISS_VERSION:-1.15.1}" CUDART_VERSION="${CUDART_VERSION:-12.9.79}" KEEP_SM="${FAISS_KEEP_SM:-90}"
rm -rf "$dest"; mkdir -p "$dest/wheels" "$dest/site/nvidia/cuda_runtime/lib" "$dest/site/nvidia/cublas/lib" "$dest/site/nvidia/curand/lib"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
dl=("$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${dl[@]}" -d "$tmp/dl" "faiss-gpu==$FAISS_VERSION" "nvidia-cuda-runtime-cu12==$CUDART_VERSION"
whl="$(ls "$tmp"/dl/faiss_gpu-*.whl)"
mkdir "$tmp/faiss" && (cd "$tmp/faiss" && unzip -q "$whl")
"$py" scripts/fatbin_keep_arch.py "$tmp/faiss/faiss/libfaiss.so" --arch "$KEEP_SM" >&2
(cd "$tmp/faiss" && zip -q -9 -r "$OLDPWD/$dest/wheels/$(basename "$whl")" .)
(cd "$tmp" && unzip -q -o dl/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12')
cp "$tmp/nvidia/cuda_runtime/lib/libcudart.so.12" "$dest/site/nvidia/cuda_runtime/lib/"
bash scripts/cublas12_shim/make.sh "$dest/site/nvidia/cublas/lib"
echo 'int qumem_curand10_placeholder;' > "$tmp/curand.c"
gcc -O2 -fPIC -shared -o "$dest/site/nvidia/curand/lib/libcurand.so.10" -Wl,-soname,libcurand.so.10 "$tmp/curand.c"
(cd "$dest" && find . -type f ! -name SHA256SUMS -exec sha256sum {} + | sort -k2) > "$dest/SHA256SUMS"
du -sb "$dest" | awk -v sm="$KEEP_SM" '{printf "{\"status\": \"prepared\", \"carry\": \"%s\", \"bytes\": %d, \"faiss_sm\": %s}\n", $2, $1, sm}'
