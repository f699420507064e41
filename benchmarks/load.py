"""Models on demand: load and unload times, through the real server.

A server process serves a tiny model (named at start) and lets requests load two others on
demand (``--allow-models``): the default model's GGUF file (SmolLM2-135M-Instruct Q4_1; on MLX's
CPU backend dequantized to float32 as it loads) and a tiny random-weight llama folder
(``harness/tiny_model.py``). ``--model-ttl`` unloads each once idle. For each model, ``--reps``
rounds of: a streamed request naming it (its time to the first token includes the load), the
load's seconds and phases as ``/v1/models`` reports them, a second request (the model loaded),
the wait for the TTL's unload and its seconds; what MLX holds loaded and after the unload. Round
1 may read the files from disk; later rounds find them in the page cache. The same question is
asked each round: from round 2 on its prompt comes from the model's cache on disk.

Usage: .venv/bin/python -m benchmarks.load [--reps 3] [--ttl 1] [--json FILE]
The result goes to benchmarks/results/load/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import Server, free_port
from mlx_kvserver.models.loading import default_model_path
from harness.tiny_model import make_tiny_model_dir

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence.",
             "message_id": "bench-load-q1"}]


def ask(url: str, model: str, max_tokens: int = 8) -> dict:
    """One streamed greedy request: seconds to the first token and in all, the usage."""
    body = {"model": model, "messages": QUESTION, "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "stream_options": {"include_usage": True}}
    t0, ttft, usage = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"ttft_s": round(ttft if ttft is not None else total, 3), "total_s": round(total, 3),
            "cached_tokens": (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def status(url: str, model: str) -> dict:
    return next(m for m in httpx.get(f"{url}/models", timeout=60).json()["data"]
                if m["id"] == model)


def active(url: str) -> int:
    """What MLX holds now (the engine's memory report)."""
    stats = httpx.get(f"{url}/kv_cache/stats", timeout=60).json()["models"]
    return next(iter(stats.values()))["memory"]["mlx_active_bytes"]


def rounds(url: str, model: str, reps: int, ttl: float) -> list[dict]:
    out = []
    for i in range(reps):
        before = active(url)
        first = ask(url, model)
        loaded = status(url, model)
        second = ask(url, model)
        held = active(url)
        t0 = time.perf_counter()
        while (s := status(url, model))["status"] != "unloaded":
            if time.perf_counter() - t0 > ttl + 120:
                raise SystemExit(f"{model} was not unloaded {ttl} s after its last use")
            time.sleep(0.1)
        row = {"round": i + 1, "load_s": loaded["load_seconds"],
               "load_phases_s": loaded["load_phases_s"], "weights_bytes": loaded["weights_bytes"],
               "first_request": first, "second_request": second,
               "unload_s": s["unload_seconds"], "mlx_active_before_bytes": before,
               "mlx_active_loaded_bytes": held, "mlx_active_unloaded_bytes": active(url)}
        print(json.dumps(row), file=sys.stderr)
        out.append(row)
    return out


def summary(rows: list[dict]) -> dict:
    def med(f):
        return round(statistics.median(f(r) for r in rows), 3)
    return {"load_s": med(lambda r: r["load_s"]), "unload_s": med(lambda r: r["unload_s"]),
            "ttft_with_load_s": med(lambda r: r["first_request"]["ttft_s"]),
            "ttft_loaded_s": med(lambda r: r["second_request"]["ttft_s"]),
            "weights_bytes": rows[0]["weights_bytes"],
            "mlx_active_loaded_bytes": med(lambda r: r["mlx_active_loaded_bytes"]),
            "mlx_active_unloaded_bytes": med(lambda r: r["mlx_active_unloaded_bytes"]),
            "load_phases_s": {k: round(statistics.median(r["load_phases_s"].get(k, 0)
                                                         for r in rows), 3)
                              for k in rows[0]["load_phases_s"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=1.0, help="--model-ttl of the server")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        served = make_tiny_model_dir(tmp / "served", seed=0)
        tiny = str(make_tiny_model_dir(tmp / "tiny", seed=1))
        default = str(default_model_path())
        server = Server(tmp / "kv", free_port(), [
            "--model", str(served), "--allow-models", default, "--allow-models", tiny,
            "--model-ttl", str(args.ttl)])
        try:
            results = {name: rounds(server.url, spec, args.reps, args.ttl)
                       for name, spec in (("tiny", tiny), ("default", default))}
        finally:
            server.stop()
    out = {"command": " ".join([".venv/bin/python -m benchmarks.load", *sys.argv[1:]]),
           "machine": platform.processor() or platform.machine(), "reps": args.reps,
           "ttl_s": args.ttl, "summary": {k: summary(v) for k, v in results.items()},
           "rounds": results}
    print(json.dumps(out["summary"], indent=1))
    write("load", json.dumps(out, indent=1) + "\n", override=args.json)


if __name__ == "__main__":
    main()
