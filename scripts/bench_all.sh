#!/usr/bin/env bash
# All benchmarks with small settings, in a few minutes: the multi-turn comparison with mlx-lm's
# server, resident memory with sharing, and the eviction study. Outputs go to docs/quick/ so the
# full-size figures in docs/ are not overwritten. Full runs: see docs/BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out=docs/quick
mkdir -p "$out"
py=.venv/bin/python
echo "== multi-turn, side by side with mlx-lm's server (quick)"
$py scripts/bench_multiturn.py --quick --out "$out"
echo "== resident KV memory with sharing (quick)"
$py scripts/bench_memory.py --quick
echo "== eviction study (quick)"
$py scripts/eviction_sim.py --quick
echo "== done: $out"
