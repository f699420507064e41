#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# OpenBLAS for MLX's CPU backend on Linux must be preloaded before Python starts.
eval "$(.venv/bin/python -m mlx_kvserver.blas --print-env)"
exec .venv/bin/python -m pytest "$@"
