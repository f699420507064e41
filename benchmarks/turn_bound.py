"""How close an agent turn can come to the floor: a turn's new tokens over a long cached history,
against the same tokens alone, on the default model (real weights) with MLX's own caches.

Per (new tokens T, history N), medians of --repeat forward passes, each evaluated:

- floor:      T tokens with no history (what benchmarks/agent.py's --floor measures through the
              server)
- turn:       T tokens after N cached positions (random keys and values: the time does not
              depend on them), MLX's fused attention: what a perfect cache pays per turn
- no softmax: the same turn with attention reduced to its two matrix products (scores = Q K^T,
              out = scores V; no max, no exp, no sum): a lower bound for any exact attention
              on this backend (the products are the same FLOPs on every implementation)

The ratios turn/floor and (no softmax)/floor are what a server's median TTFT/floor can reach at
best on this machine; the FLOP count per new token (attention over N positions against the rest
of the model) gives the same bound on any hardware.

  .venv/bin/python -m benchmarks.turn_bound --new 300 --history 7000 10000 13000 [--json FILE]

The result goes to benchmarks/results/turn_bound/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache

from benchmarks.record import OVERRIDE_HELP, write
from mlx_kvserver.models.loading import resolve_and_load


def products_only(queries, keys, values, cache, scale, mask, sinks=None):
    """The attention's two matrix products alone (wrong values, the right FLOPs)."""
    B, Hq, T, D = queries.shape
    Hkv = keys.shape[1]
    q = (queries * scale).reshape(B, Hkv, Hq // Hkv * T, D)
    s = q @ keys.swapaxes(-1, -2)
    return (s @ values).reshape(B, Hq, T, D)


def forward_ms(model, tokens: mx.array, history: int, repeat: int, layers: int, kv_heads: int,
               head_dim: int) -> float:
    times = []
    for _ in range(repeat + 1):
        caches = []
        for _ in range(layers):
            c = KVCache()
            if history:
                k = mx.random.normal((1, kv_heads, history, head_dim)) * 0.1
                v = mx.random.normal((1, kv_heads, history, head_dim)) * 0.1
                c.update_and_fetch(k, v)
            caches.append(c)
        mx.eval([c.state for c in caches if history])
        t0 = time.perf_counter()
        mx.eval(model(tokens[None], cache=caches)[:, -1])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1000


def flops_per_token(cfg: dict, history: int) -> tuple[float, float]:
    """(attention over ``history`` positions, the rest of the model) per new token."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim", h // heads)
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    attn = layers * heads * 2 * 2 * history * d
    proj = layers * 2 * (h * heads * d + 2 * h * kvh * d + heads * d * h + 3 * h * inter)
    return attn, proj + 2 * h * vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--history", type=int, nargs="+", default=[7000, 10000, 13000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    lm = resolve_and_load(args.model)
    model = lm.model
    args_ = model.args
    cfg = {k: getattr(args_, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "intermediate_size", "vocab_size")
           if hasattr(args_, k)}
    if getattr(args_, "head_dim", None):
        cfg["head_dim"] = args_.head_dim
    layers, kvh = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    tokens = mx.array([(i * 7919) % 1000 + 100 for i in range(args.new)])
    shape = dict(repeat=args.repeat, layers=layers, kv_heads=kvh, head_dim=d)
    floor = forward_ms(model, tokens, 0, **shape)
    print(f"floor: {args.new} tokens alone {floor:.0f} ms", flush=True)
    rows = []
    for n in args.history:
        turn = forward_ms(model, tokens, n, **shape)
        mods = [m for m in sys.modules.values()
                if getattr(m, "scaled_dot_product_attention", None) is mlx_base.scaled_dot_product_attention]
        original = mlx_base.scaled_dot_product_attention
        for m in mods:
            m.scaled_dot_product_attention = products_only
        try:
            bound = forward_ms(model, tokens, n, **shape)
        finally:
            for m in mods:
                m.scaled_dot_product_attention = original
        attn, rest = flops_per_token(cfg, n)
        row = {"history": n, "new": args.new, "floor_ms": round(floor, 1), "turn_ms": round(turn, 1),
               "no_softmax_ms": round(bound, 1), "turn_over_floor": round(turn / floor, 2),
               "no_softmax_over_floor": round(bound / floor, 2),
               "flop_bound_over_floor": round((attn + rest) / rest, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write("turn_bound", json.dumps({"command": " ".join(sys.argv), "config": cfg, "rows": rows},
                                   indent=1) + "\n", override=args.json)


if __name__ == "__main__":
    main()
