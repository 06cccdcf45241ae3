#!/usr/bin/env bash
# A second, independent reader of the Delta tables for the tests: DuckDB's delta extension, which is
# delta-kernel-rs (the store writes with delta-rs). The registry packages `duckdb-ext-delta` and
# `duckdb-ext-httpfs` ship the extension files for DuckDB 1.4.4 only, while the project pins DuckDB
# 2.x, so the reader gets a venv of its own (as the vLLM server does) and is loaded from its file,
# never downloaded (scripts/delta_kernel_read.py; tests/test_second_reader.py).
#
#   bash scripts/install_delta_reader.sh [VENV_DIR]      (default ./.venv-delta-reader)
#   export QUMEM_DELTA_READER_PYTHON=VENV_DIR/bin/python
set -euo pipefail
VENV="${1:-${QUMEM_DELTA_READER_VENV:-$PWD/.venv-delta-reader}}"
PY="${PYTHON:-python3}"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
  "duckdb==1.4.4" "duckdb-ext-delta==1.4.4.20260205" "duckdb-ext-httpfs==1.4.4.20260205"
"$VENV/bin/python" "$(dirname "$0")/delta_kernel_read.py" --check
end=$(date +%s)
echo "install_delta_reader: venv=$VENV wall_s=$((end-start)) size=$(du -sh "$VENV" | cut -f1)"
