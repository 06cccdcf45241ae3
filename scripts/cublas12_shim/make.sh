#!/usr/bin/env bash
# A libcublas.so.12 that forwards the eight cuBLAS calls faiss-gpu-cu12 makes to the machine's
# libcublas.so.13 (and an empty libcublasLt.so.12, which faiss names but never calls): lets the
# cu12 FAISS wheel (48 MB) run on a CUDA 13 image, where a cuBLAS 12 wheel (~400 MB) cannot travel.
# Only for scripts/gpu_check.sh; x86-64 Linux, gcc. Usage: make.sh OUT_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"; out="$1"; mkdir -p "$out"; tmp="$(mktemp -d)"
syms=(cublasCreate_v2 cublasDestroy_v2 cublasGemmEx cublasGemmStridedBatchedEx cublasGetMathMode
      cublasSetMathMode cublasSetStream_v2 cublasSgemmEx)
{ echo "libcublas.so.12 { global:"; printf '  %s;\n' "${syms[@]}"; echo "local: *; };"; } > "$tmp/v.map"
{ echo ".text"
  for i in "${!syms[@]}"; do
    s=${syms[$i]}
    printf '.globl %s\n.type %s,@function\n%s:\n  jmp *qumem_real_%d(%%rip)\n.size %s,.-%s\n' "$s" "$s" "$s" "$i" "$s" "$s"
  done
  echo '.section .note.GNU-stack,"",@progbits'; } > "$tmp/tramp.S"
{ echo '#define _GNU_SOURCE'
  echo '#include <dlfcn.h>'; echo '#include <stdio.h>'; echo '#include <stdlib.h>'
  for i in "${!syms[@]}"; do echo "__attribute__((visibility(\"hidden\"))) void *qumem_real_$i;"; done
  echo 'static const char *names[] = {'; printf '  "%s",\n' "${syms[@]}"; echo '};'
  cat "$here/resolve.c.in"
  for i in "${!syms[@]}"; do echo "  qumem_real_$i = must(lib, names[$i]);"; done
  echo '}'; } > "$tmp/shim.c"
gcc -O2 -fPIC -shared -o "$out/libcublas.so.12" -Wl,-soname,libcublas.so.12 -Wl,--version-script="$tmp/v.map" \
    "$tmp/shim.c" "$tmp/tramp.S" -ldl
echo 'int qumem_cublaslt12_placeholder;' > "$tmp/lt.c"
gcc -O2 -fPIC -shared -o "$out/libcublasLt.so.12" -Wl,-soname,libcublasLt.so.12 "$tmp/lt.c"
rm -rf "$tmp"
