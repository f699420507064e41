#!/usr/bin/env bash
# Three benchmarks with small settings, in a few minutes: the multi-turn comparison with mlx-lm's
# server, resident memory with sharing, and the eviction study. A check that they run, not
# results: the multi-turn files go to .bench/quick/ (or the folder given), not to
# benchmarks/results/, and the other two print their tables only. Full runs: see
# docs/BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out=${1:-.bench/quick}
mkdir -p "$out"
py=.venv/bin/python
echo "== multi-turn, side by side with mlx-lm's server (quick)"
$py -m benchmarks.multiturn --quick --out "$out"
echo "== resident KV memory with sharing (quick)"
$py -m benchmarks.memory --quick
echo "== eviction study (quick)"
$py -m benchmarks.eviction_sim --quick
echo "== done: $out"
