"""The project's benchmarks: one module per benchmark, each a script run from the repository root.

    .venv/bin/python -m benchmarks.<name> --help      # e.g. benchmarks.ttft, benchmarks.memory_peak

A run writes its raw result to ``benchmarks/results/<name>/<YYYYMMDD-HHMMSS>.json`` (the UTC time
of the run; ``BENCH_MACHINE=<machine>`` appends ``-<machine>`` to the stem), with its plots and
tables beside it under the same stem, and never over an earlier run's file
(``benchmarks/record.py``). ``--json`` (or ``--out``, where a benchmark has it) names another
file instead. ``docs/BENCHMARKS.md`` reports the latest runs; ``benchmarks/claims.toml`` ties each
figure it quotes to its raw file. ``benchmarks/quick.sh`` runs three of them with small settings.
"""
