#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if ! { command -v chromium || command -v chromium-browser || command -v google-chrome; } >/dev/null 2>&1 \
    || ! command -v chromedriver >/dev/null 2>&1; then
  echo "test: no Chromium/ChromeDriver here, so the chat page's browser test (tests/clients/test_page.py)" \
       "will be skipped; install Debian's chromium and chromium-driver to run it" >&2
fi
# OpenBLAS for MLX's CPU backend on Linux must be preloaded before Python starts.
eval "$(.venv/bin/python -m mlx_kvserver.platform.blas --print-env)"
exec .venv/bin/python -m pytest "$@"
