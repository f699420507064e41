"""GFLOP/s of every BLAS candidate for MLX's CPU backend here, and the default model's prefill.

Each candidate the launcher knows (mlx_kvserver/platform/blas.py) that is installed, plus MLX's own
reference BLAS and any --library given, runs in a child process of its own with it preloaded: a
1024x576 @ 576x1536 float32 matmul through MLX (a prefill's shape for the default model: 1,024
tokens, hidden size 576, MLP width 1,536), timed --repeats times after a warm-up, at each thread
count of --threads; the median is reported. A child that dies (SIGILL: the library needs an
instruction this CPU lacks) is reported as such. Then the default model (dequantized to float32)
prefills --prefill-tokens tokens with the BLAS the launcher chooses, at its thread count and at
each of --threads, median of --repeats.

Usage: .venv/bin/python -m benchmarks.blas [--threads 1 2] [--repeats 7] [--prefill-tokens 256]
           [--library NAME=PATH ...] [--json FILE]
The result goes to benchmarks/results/blas/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from benchmarks.record import OVERRIDE_HELP, write
from mlx_kvserver.platform import blas, blas_probe
from mlx_kvserver.platform.blas_candidates import Candidate

ROOT = Path(__file__).resolve().parent.parent

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")

MATMUL = r"""
import json, statistics, sys, time
import mlx.core as mx
want = sys.argv[2:]
maps = open("/proc/self/maps").read()
assert all(p in maps for p in want), "the library is not mapped"
mx.random.seed(0)
a, b = mx.random.normal((1024, 576)), mx.random.normal((576, 1536))
mx.eval(a, b)
for _ in range(2):
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
times = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
    times.append(time.perf_counter() - t0)
print(json.dumps({"gflops": 2 * 1024 * 576 * 1536 / statistics.median(times) / 1e9,
                  "runs": len(times)}))
"""

PREFILL = r"""
import json, statistics, sys, time
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_kvserver.models.loading import resolve_and_load
n, repeats = int(sys.argv[1]), int(sys.argv[2])
lm = resolve_and_load(None)
vocab = lm.model.args.vocab_size
tokens = mx.array([[(i * 31) % (vocab - 200) + 100 for i in range(n)]])
times = []
for i in range(repeats + 1):  # the first run warms up
    cache = make_prompt_cache(lm.model)
    t0 = time.perf_counter()
    mx.eval(lm.model(tokens, cache=cache))
    if i:
        times.append(time.perf_counter() - t0)
print(json.dumps({"tokens_per_s": n / statistics.median(times), "dequantized": lm.dequantized,
                  "model": lm.name}))
"""


def cpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    return {"model": info.get("Model name", platform.processor()).strip(),
            "cpus": os.cpu_count(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}


def candidates(extra: list[str]) -> list[tuple[str, Candidate | None | str]]:
    """(name, candidate) in the launcher's order: None is MLX's own BLAS, a str why not here."""
    found: list[tuple[str, Candidate | None | str]] = [("MLX reference BLAS", None)]
    for name, find in blas.FINDERS:
        if name == blas.LIBRARY_VAR and not os.environ.get(name):
            continue
        try:
            found.append((name, find(os.environ)))
        except Exception as e:  # noqa: BLE001
            found.append((name, f"could not be set up: {e}"))
    for spec in extra:
        name, _, path = spec.partition("=")
        found.append((name, Candidate(name, Path(path), Path(path))))
    return found


def child_env(c: Candidate | None, threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER_VAR)}
    env["PYTHONPATH"] = str(ROOT)
    if c is not None:
        env.update(blas.candidate_env(c, env))
    if threads is not None:
        env.update({k: str(threads) for k in THREAD_VARS})
    return env


def run(code: str, env: dict[str, str], *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=1800, check=False, cwd=ROOT)
    if r.returncode < 0:
        return {"error": f"died with {blas_probe.signal_name(-r.returncode)}"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][-200:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--library", action="append", default=[], metavar="NAME=PATH",
                    help="another library exporting cblas_sgemm to measure")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    result: dict = {"cpu": cpu(), "matmul": "1024x576 @ 576x1536 float32 through MLX",
                    "candidates": []}
    print(f"CPU: {result['cpu']}", flush=True)
    for name, c in candidates(args.library):
        row: dict = {"name": name}
        if isinstance(c, str):
            row["skipped"] = c
        else:
            if c is not None:
                row["library"] = str(c.library)
                verdict = blas_probe.run_child(child_env(c, None), c.files())
                row["check"] = "passes" if verdict.ok else f"rejected: {verdict.why}"
            libs = [str(p.resolve()) for p in c.files()] if c is not None else []
            for n in args.threads:
                got = run(MATMUL, child_env(c, n), str(args.repeats), *libs)
                row[f"{n}_threads"] = round(got["gflops"], 1) if "gflops" in got else got["error"]
        result["candidates"].append(row)
        print(json.dumps(row), flush=True)

    choice = blas.choose({k: v for k, v in os.environ.items() if k != blas.MARKER_VAR})
    chosen = choice.candidate
    default_threads = int(choice.env[chosen.threads_var]) if chosen else None
    prefill: dict = {"blas": chosen.name if chosen else "MLX reference BLAS",
                     "tokens": args.prefill_tokens, "launcher_threads": default_threads}
    for n in sorted({*([default_threads] if default_threads else []), *args.threads}):
        got = run(PREFILL, child_env(chosen, n), str(args.prefill_tokens), str(args.repeats))
        prefill[f"{n}_threads"] = round(got["tokens_per_s"], 1) if "tokens_per_s" in got \
            else got["error"]
        prefill.setdefault("model", got.get("model"))
    result["prefill"] = prefill
    print(json.dumps(prefill), flush=True)
    write("blas", json.dumps(result, indent=1) + "\n", override=args.json)


if __name__ == "__main__":
    main()
