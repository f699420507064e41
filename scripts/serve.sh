#!/usr/bin/env bash
# Sets up .venv if needed, then serves the bundled default model (or whatever flags say) on
# http://127.0.0.1:8080/v1. Any flag of `python -m mlx_kvserver --help` may follow.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m mlx_kvserver "$@"
