"""No growth: the server's memory after 1,000 mixed requests against its level after the first 100.

Starts the real server as a process (by default on a tiny random-weight llama folder built like
``harness/tiny_model.py``'s ``make_tiny_model_dir``: the default model is slow on a CPU; ``--model
default`` for a shorter run on it), with a small ``--max-kv-ram-gb`` so the page pool reaches its
budget early and growth beyond it shows, and the disk tier on. ``--clients`` threads send
``--requests`` mixed requests, in batches of ``--every``: short and long prompts, streams closed
mid-answer (cancelled), ``n`` > 1, ``use_kv_cache`` true and false, multi-turn continuations by
message id, JSON-schema answers, some with ``speculate: false``. After each batch the server is
left to settle (``--settle`` seconds, idle) and the script records the server process's resident
memory (``/proc/PID/status`` VmRSS, VmHWM) and the memory figures of ``/v1/kv_cache/stats``
(MLX active, pages, working, MLX buffer cache, peak) with the page pool's counts.

Reported: level(last)/level(first checkpoint at 100 requests) for RSS and MLX active (goal <=
1.05), and the plot of the series. The raw result goes to
``benchmarks/results/memory_growth/<run's UTC time>.json`` (and ``.png``) unless ``--json``
(``--plot``) names another file.

Usage: .venv/bin/python -m benchmarks.memory_growth [--quick] [--json FILE] [--plot FILE]
       [--model default --requests 200] [-- server flags]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.record import OVERRIDE_HELP, run_file, write
from benchmarks.ttft import Server, free_port

WORDS = ("river mill harbour forest glass station library railway marsh tower bridge ledger "
         "summer winter market square north south stone iron copper family village road").split()
SYSTEMS = [f"You are assistant {i}. " + " ".join(WORDS[(i * 7 + j) % len(WORDS)]
                                                  for j in range(120)) for i in range(3)]
SCHEMA = {"type": "object", "properties": {"town": {"type": "string", "maxLength": 12},
                                           "year": {"type": "integer"}},
          "required": ["town", "year"], "additionalProperties": False}
KINDS = [("short", 30), ("long", 12), ("cancel", 15), ("n", 10), ("turn", 23), ("schema", 5),
         ("shared", 5)]
MB = 1 << 20


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


class Mix:
    """The request mix: each request's body from its index (seeded), conversations kept for
    continuations. ``long_words``: the long prompts' size."""

    def __init__(self, url: str, model: str, long_words: int, max_tokens: int):
        self.url, self.model, self.long_words, self.max_tokens = url, model, long_words, max_tokens
        self.lock = threading.Lock()
        self.convs: list[list[dict]] = []
        self.counts: dict[str, int] = {}
        self.kinds = [k for k, w in KINDS for _ in range(w)]

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def one(self, i: int) -> None:
        rng = random.Random(i)
        kind = rng.choice(self.kinds)
        mt = self.max_tokens
        body = {"model": self.model, "temperature": 0 if rng.random() < 0.7 else 0.8,
                "max_tokens": rng.randint(mt // 2, mt), "use_kv_cache": rng.random() < 0.75}
        if rng.random() < 0.25:
            body["speculate"] = False
        conv = None
        msgs = [{"role": "user", "content": text(rng, rng.randint(5, 40)),
                 "message_id": f"g{i}-u"}]
        if kind == "long":
            msgs[0]["content"] = text(rng, rng.randint(self.long_words // 2, self.long_words))
        elif kind == "shared":
            msgs.insert(0, {"role": "system", "content": SYSTEMS[i % 3],
                            "message_id": f"sys{i % 3}"})
        elif kind == "n":
            body["n"] = rng.randint(2, 4)
        elif kind == "schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "town", "schema": SCHEMA}}
        elif kind == "turn":
            with self.lock:
                if self.convs and rng.random() < 0.8:
                    conv = self.convs.pop(rng.randrange(len(self.convs)))
            if conv is not None:
                msgs = conv + msgs
                body["use_kv_cache"] = True
            else:
                conv = []
        body["messages"] = msgs
        if kind == "cancel":
            self.cancelled(body, rng.randint(1, 6))
            self.count("cancel")
            return
        r = httpx.post(f"{self.url}/chat/completions", json=body, timeout=900)
        self.count(f"{kind}:{r.status_code}")
        if r.status_code != 200:
            if r.status_code >= 500:
                print(f"request {i} ({kind}): {r.status_code} {r.text[:300]}", file=sys.stderr)
            return
        res = r.json()
        self.count_tokens(res.get("usage", {}))
        if conv is not None:
            msg = res["choices"][0]["message"]
            turn = msgs + [{"role": "assistant", "content": msg.get("content") or "",
                            "message_id": msg.get("message_id") or res.get("message_id")}]
            if len(turn) < 12:  # a conversation ends after 6 turns (the tiny model's context)
                with self.lock:
                    self.convs.append(turn)

    def count_tokens(self, usage: dict) -> None:
        with self.lock:
            for k in ("prompt_tokens", "completion_tokens"):
                self.counts[k] = self.counts.get(k, 0) + int(usage.get(k) or 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.counts["cached_tokens"] = self.counts.get("cached_tokens", 0) + cached

    def cancelled(self, body: dict, after: int) -> None:
        """A stream closed by the client after ``after`` content chunks (or at its end)."""
        body = dict(body, stream=True, max_tokens=max(body["max_tokens"], 4 * self.max_tokens))
        seen = 0
        with httpx.stream("POST", f"{self.url}/chat/completions", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(
                        c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                    seen += 1
                    if seen >= after:
                        break  # leaving the block closes the connection mid-answer


def snapshot(url: str, pid: int, done: int, t0: float) -> dict:
    stats = httpx.get(f"{url}/kv_cache/stats", timeout=60).json()["models"]
    name, s = next(iter(stats.items()))
    mem, ram = s["memory"], s["ram"]
    return {"requests": done, "t_s": round(time.monotonic() - t0, 1), **proc_status(pid),
            **{k: mem[k] for k in ("mlx_active_bytes", "pages_bytes", "working_bytes",
                                   "mlx_cache_bytes", "mlx_peak_bytes", "weights_bytes",
                                   "pressure_events", "refused")},
            "ram": {k: ram[k] for k in ("entries", "pages", "pages_held", "pages_cached",
                                        "budget_bytes", "resident_sequence_tokens",
                                        "prefix_view_bytes", "evictions")},
            "disk_entries": (s.get("disk") or {}).get("entries")}


def fit_slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of ``y`` against ``x``."""
    mx_, my = sum(x) / len(x), sum(y) / len(y)
    den = sum((a - mx_) ** 2 for a in x)
    return sum((a - mx_) * (b - my) for a, b in zip(x, y)) / den if den else 0.0


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [r["requests"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(x, [r["VmRSS"] / MB for r in rows], "o-", label="VmRSS (idle)")
    a.plot(x, [r["VmHWM"] / MB for r in rows], "--", label="VmHWM (peak so far)")
    a.set(xlabel="requests", ylabel="MiB", title="server process resident memory")
    a.set_ylim(bottom=0)
    for key, label in [("mlx_active_bytes", "MLX active"), ("weights_bytes", "weights"),
                       ("pages_bytes", "KV pages"), ("working_bytes", "working"),
                       ("mlx_cache_bytes", "MLX buffer cache")]:
        b.plot(x, [r[key] / MB for r in rows], "o-", ms=3, label=label)
    b.axhline(rows[0]["ram"]["budget_bytes"] / MB, color="grey", ls=":",
              label="page budget (--max-kv-ram-gb)")
    b.set(xlabel="requests", ylabel="MiB", title="MLX memory (/v1/kv_cache/stats)")
    for ax in (a, b):
        ax.axvline(100, color="grey", lw=0.5)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="requests per batch (a checkpoint)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--settle", type=float, default=3.0, help="idle seconds before a checkpoint")
    ap.add_argument("--model", default="tiny", help="'tiny' (random weights) or a server model")
    ap.add_argument("--long-words", type=int, default=300, help="the long prompts' words, at most")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-kv-ram-gb", type=float, default=0.02)
    ap.add_argument("--quick", action="store_true", help="120 requests, checkpoints every 20")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("--plot", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("server_args", nargs="*", help="extra server flags (after --)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.every = 120, 20
    work = Path(tempfile.mkdtemp(prefix="bench-memgrowth-"))
    model = args.model
    if model == "tiny":
        from harness.tiny_model import make_tiny_model_dir
        model = str(make_tiny_model_dir(work / "tiny", num_layers=4, hidden=256, heads=8,
                                        kv_heads=4))
    flags = ["--model", model, "--max-kv-ram-gb", str(args.max_kv_ram_gb),
             "--max-kv-size-gb", "0.2", "--log-level", "warning", *args.server_args]
    server = Server(work / "kv", free_port(), flags)
    pid = server.proc.pid
    served = httpx.get(f"{server.url}/models", timeout=60).json()["data"][0]["id"]
    mix = Mix(server.url, served, args.long_words, args.max_tokens)
    rows, t0 = [], time.monotonic()
    try:
        time.sleep(args.settle)
        rows.append(snapshot(server.url, pid, 0, t0))
        with ThreadPoolExecutor(args.clients) as pool:
            for start in range(0, args.requests, args.every):
                list(pool.map(mix.one, range(start, min(start + args.every, args.requests))))
                time.sleep(args.settle)
                rows.append(snapshot(server.url, pid, min(start + args.every, args.requests), t0))
                r = rows[-1]
                print(f"{r['requests']:5d} req {r['t_s']:7.1f} s  RSS {r['VmRSS'] / MB:7.1f} MiB"
                      f"  active {r['mlx_active_bytes'] / MB:6.1f}  pages "
                      f"{r['pages_bytes'] / MB:5.1f}  working {r['working_bytes'] / MB:5.1f}"
                      f"  cache {r['mlx_cache_bytes'] / MB:6.1f}  entries "
                      f"{r['ram']['entries']}", flush=True)
    finally:
        server.stop()
    base = next((r for r in rows if r["requests"] >= 100), rows[1])
    last = rows[-1]
    ratios = {k: round(last[k] / base[k], 4) for k in ("VmRSS", "mlx_active_bytes")}
    ratios["mlx_active_less_pages"] = round(
        (last["mlx_active_bytes"] - last["pages_bytes"])
        / (base["mlx_active_bytes"] - base["pages_bytes"]), 4)
    after = [r for r in rows if r["requests"] >= base["requests"]]
    band = {k: [round(min(r[k] for r in after) / base[k], 4),
                round(max(r[k] for r in after) / base[k], 4)]
            for k in ("VmRSS", "mlx_active_bytes")}
    slope = {k: round(fit_slope([r["requests"] for r in after], [r[k] for r in after])
                      * 100 / MB, 3) for k in ("VmRSS", "mlx_active_bytes", "pages_bytes")}
    summary = {"model": args.model, "band_over_base_min_max": band,
               "slope_mib_per_100_requests": slope, "requests": last["requests"],
               "base_at": base["requests"],
               "ratio_last_over_base": ratios, "goal": 1.05,
               "met": all(v <= 1.05 for k, v in ratios.items() if k != "mlx_active_less_pages"),
               "counts": dict(sorted(mix.counts.items())), "seconds": last["t_s"],
               "server_flags": flags[2:], "clients": args.clients, "settle_s": args.settle}
    print(json.dumps(summary, indent=1))
    write("memory_growth", json.dumps({"summary": summary, "checkpoints": rows}, indent=1),
          override=args.json)
    out = run_file("memory_growth", ".png", args.plot)
    plot(rows, out, f"{args.model} model, {last['requests']} mixed requests, "
         f"{args.clients} clients, --max-kv-ram-gb {args.max_kv_ram_gb}: RSS x"
         f"{ratios['VmRSS']}, MLX active x{ratios['mlx_active_bytes']} (100 -> "
         f"{last['requests']})")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
