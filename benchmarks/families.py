"""Cache reuse per model family: warm vs no-cache time to first token at ~1,500 tokens of history.

For each family of ``harness/tiny_families.py`` (tiny random-weight models built from mlx-lm's own
model code), in one run: the real server starts as a subprocess on the family's model folder;
one turn builds a ~1,500-token history (a system document and a question) and caches it; then
``--repeats`` new questions on that history are sent with the cache and without it
(``use_kv_cache: false``), interleaved. TTFT is measured at the client, from sending the request
to the first streamed content byte; the table shows medians and their ratio.

KV bytes held: right after the history's turn, ``ram.bytes`` of ``/v1/kv_cache/stats`` (the
pages of the stored entries, not the working buffers of resident sequences), next to two figures
computed from the model's own ``make_cache()`` after a one-token forward pass (the server has no
switch for a full cache): "full" = tokens x sum over cached layers of 2 x kv_heads x head_dim x
dtype size (every attention layer keeps every token); "windowed" = the same with each
sliding-window layer (``RotatingKVCache``) holding at most its window (what mlx-lm's own cache
holds). Recurrent layers (``ArraysCache``) hold a fixed-size state and count in neither.

A family whose server does not start, or does not answer, is skipped with the reason.
The result goes to benchmarks/results/families/<run's UTC time>.json unless --json names a file.
Usage: .venv/bin/python -m benchmarks.families [--repeats 5] [--families llama gemma3_text ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import Server, document, free_port
from harness.tiny_families import FAMILIES, make_tiny_family_dir
from harness.tiny_model import CHAT_TEMPLATE, make_tiny_tokenizer

HISTORY_TOKENS = 1500
MAX_TOKENS = 8
PAGE_SIZE = 32


class Skip(Exception):
    """The family cannot be measured (its server did not start or did not answer)."""


def history(target: int = HISTORY_TOKENS) -> list[dict]:
    """A system document and one question, about ``target`` tokens in the tiny tokenizer."""
    from jinja2 import Template

    tok, template = make_tiny_tokenizer(), Template(CHAT_TEMPLATE)
    for n in range(4, 400, 2):
        messages = [{"role": "system", "content": document(n), "message_id": "h-sys"},
                    {"role": "user", "content": "What does the guide say about the harbour?",
                     "message_id": "h-u0"}]
        rendered = template.render(messages=messages, add_generation_prompt=True)
        if len(tok.encode(rendered).ids) >= target:
            return messages
    raise AssertionError("document too short")


def ask(url: str, messages: list[dict], use_cache: bool) -> dict:
    """One streamed greedy request: TTFT (s), text, message_id, prompt and cached tokens."""
    body = {"messages": messages, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
            "use_kv_cache": use_cache, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, mid, usage = None, [], None, {}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise Skip(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise Skip(f"stream error: {chunk['error'].get('message', chunk['error'])}")
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                mid = chunk.get("message_id", mid)
                if c["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(c["delta"]["content"])
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "text": "".join(text), "message_id": mid,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def kv_bytes_per_token(path: Path) -> tuple[int, list[tuple[int, int | None]]]:
    """(bytes per token of a full cache, [(bytes per token, window or None) per cached layer]),
    read from the model's own ``make_cache()`` after a one-token forward pass."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(path))
    cache = make_prompt_cache(model)
    model(mx.array([[1]]), cache=cache)
    layers = []
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is None:
            continue  # a recurrent state: fixed size, no per-token KV
        per_token = 2 * keys.shape[1] * keys.shape[3] * keys.dtype.size
        layers.append((per_token, c.max_size if isinstance(c, RotatingKVCache) else None))
    return sum(b for b, _ in layers), layers


def measure(family: str, work: Path, repeats: int) -> dict:
    path = make_tiny_family_dir(work / "models" / family, family)
    cache_dir = work / family / "kv"
    cache_dir.parent.mkdir(parents=True)
    try:
        server = Server(cache_dir, free_port(), ["--model", str(path), "--page-size",
                                                 str(PAGE_SIZE), "--max-tokens", str(MAX_TOKENS)])
    except RuntimeError as e:
        log = Path(str(e).rsplit(" ", 1)[-1])
        reason = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        raise Skip(f"server did not start: {(reason or [str(e)])[0][:200]}") from None
    try:
        messages = history()
        first = ask(server.url, messages, True)
        messages.append({"role": "assistant", "content": first["text"],
                         "message_id": first["message_id"]})
        stats = httpx.get(f"{server.url}/kv_cache/stats").json()["models"]
        (ram,) = [m["ram"] for m in stats.values()]
        entry = httpx.get(f"{server.url}/kv_cache/{first['message_id']}").json()
        warm, cold, same = [], [], True
        for k in range(repeats):
            question = [{"role": "user", "content": f"Question {k}: what about the library?",
                         "message_id": f"q{k}"}]
            w = ask(server.url, messages + question, True)
            c = ask(server.url, messages + question, False)
            warm.append(w)
            cold.append(c)
            same = same and w["text"] == c["text"]
    finally:
        server.stop()
    full, layers = kv_bytes_per_token(path)
    tokens = entry.get("tokens", 0)
    return {
        "family": family, "prompt_tokens": warm[0]["prompt_tokens"],
        "cached_tokens": statistics.median(w["cached_tokens"] for w in warm),
        "warm_ttft_s": statistics.median(w["ttft"] for w in warm),
        "cold_ttft_s": statistics.median(c["ttft"] for c in cold),
        "same_answers": same, "entry_tokens": tokens, "ram_bytes": ram["bytes"],
        "full_kv_bytes": tokens * full,
        "windowed_kv_bytes": sum(b * (min(tokens, w) if w else tokens) for b, w in layers),
        "windows": sorted({w for _, w in layers if w}),
    }


def table(results: list[dict], skipped: dict[str, str]) -> str:
    out = ["| family | prompt tokens | cached | warm TTFT (ms) | no-cache TTFT (ms) | warm / "
           "no-cache | same answers |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        out.append(f"| {r['family']} | {r['prompt_tokens']} | {r['cached_tokens']:.0f} | "
                   f"{r['warm_ttft_s'] * 1000:.1f} | {r['cold_ttft_s'] * 1000:.1f} | "
                   f"{r['warm_ttft_s'] / r['cold_ttft_s']:.2f} | "
                   f"{'yes' if r['same_answers'] else 'NO'} |")
    for family, reason in skipped.items():
        out.append(f"| {family} | skipped: {reason.replace('|', '/')} | | | | | |")
    sliding = [r for r in results if r["windows"]]
    if sliding:
        out += ["", "KV bytes held after the history's turn (`ram.bytes`) vs the same model with "
                "a full cache and with mlx-lm's windowed cache (both computed: tokens x layers x "
                "2 x kv_heads x head_dim x dtype size; the server has no full-cache switch):", "",
                "| family | window | entry tokens | held (KiB) | full (KiB) | windowed (KiB) | "
                "held / full |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in sliding:
            out.append(f"| {r['family']} | {', '.join(map(str, r['windows']))} | "
                       f"{r['entry_tokens']} | {r['ram_bytes'] / 1024:.0f} | "
                       f"{r['full_kv_bytes'] / 1024:.0f} | {r['windowed_kv_bytes'] / 1024:.0f} | "
                       f"{r['ram_bytes'] / max(r['full_kv_bytes'], 1):.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-families-"))
    results, skipped = [], {}
    for family in args.families:
        print(f"== {family}", file=sys.stderr, flush=True)
        try:
            results.append(measure(family, work, args.repeats))
        except Skip as e:
            print(f"   skipped: {e}", file=sys.stderr, flush=True)
            skipped[family] = str(e)
    print(table(results, skipped))
    write("families", json.dumps({"results": results, "skipped": skipped}, indent=1),
          override=args.json)


if __name__ == "__main__":
    main()
