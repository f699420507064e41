"""KV pages in 8 and 4 bits against full precision, on this machine (docs/BENCHMARKS.md).

  attention  30 layers of attention (the default model's shape) over ``--history`` positions,
             for 1 and 256 queries: quantized pages with ``mx.quantized_matmul`` (mlx-lm's
             quantized SDPA) against float buffers, and the round trip of new keys and values.
  quality    with the default model, each setting against full precision: greedy agreement
             over ``--gen`` (200) generated tokens on 20 chat prompts decoded together, and the
             perplexity of a fixed text of ~2,000 tokens (``bench_ttft.document``). The model
             reads keys and values through a cache that round-trips them exactly as pages do
             (``KVQuant.round_trip``), so these are the figures of the paged cache too. For
             reference, the same perplexity with ``mx.quantize``'s own round trip at 8 and 4
             bits (``mx_quantize_q8`` / ``_q4``: not exact, so not usable as pages).

  serving    with the default model, each setting through the cache as the server's engine
             sets it up (prefix views, the runner): bytes per token of KV in memory and on
             disk for ~2,266 tokens of history; turn 4 of the ~2,400-token chat (25 new tokens)
             warm and restored from disk (a new pool and store on the same directory; the
             settings take turns rep by rep), medians of ``--reps``: its cache step plus prompt pass (the time to the first token
             without HTTP) and the restore's MB/s (bytes of the entry's files over the cache
             step); and the disk bytes of a 20-turn conversation (``TURN`` tokens a turn,
             saved after every prompt and answer as the server does, random KV), so how many
             fit in 1 GB.
  decode     decode tokens/s at 1 and 8 sequences on one shared document (~2,000 tokens, read
             through prefix views), the settings taking turns for ``--reps`` rounds.

Usage: python scripts/bench_kv_bits.py attention [--history 2400] [--reps 20] [--json out.json]
       python scripts/bench_kv_bits.py quality [--gen 200] [--json out.json]
       python scripts/bench_kv_bits.py serving [--reps 3] [--json out.json]
       python scripts/bench_kv_bits.py decode [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_cache.layout.quant import KVQuant  # noqa: E402

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.", "Explain what a hash table is.",
    "Give three tips for learning a new language.", "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.", "What is 17 times 23? Show your steps.",
    "Write a short email asking a colleague for a meeting.",
    "List the planets of the solar system in order.", "What does a compiler do?",
    "Describe a cat to someone who has never seen one.", "How do vaccines work?",
    "Write a Python function that reverses a string.", "What causes the seasons on Earth?",
    "Suggest a name for a bakery and say why.", "What is the difference between RAM and disk?",
    "Tell me a fun fact about octopuses.", "How should I prepare for a job interview?",
    "Explain recursion to a child.", "What are the main causes of inflation?",
]

SETTINGS = (None, 8, 4)
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def _median_ms(fn, reps: int) -> float:
    """Median wall milliseconds of ``fn`` evaluated (after two warm-up runs)."""
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def attention(history: int, reps: int, queries: int = 1) -> dict:
    """Milliseconds for ``queries`` query positions attending to ``history`` keys in every
    layer: float32 buffers, then each setting's quantized pages."""
    key = mx.random.key(0)
    shape = (1, KV_HEADS, history, HEAD_DIM)
    ks = [mx.random.normal(shape, key=mx.random.split(key, 2 * LAYERS)[i]) for i in range(2 * LAYERS)]
    q = mx.random.normal((1, Q_HEADS, queries, HEAD_DIM), key=key)
    mask = "causal" if queries > 1 else None
    scale = HEAD_DIM ** -0.5
    mx.eval(ks, q)
    out: dict = {"history": history, "queries": queries, "device": str(mx.default_device())}

    def dense(buffers):
        return [mx.fast.scaled_dot_product_attention(q, buffers[2 * i], buffers[2 * i + 1],
                                                     scale=scale, mask=mask)
                for i in range(LAYERS)]

    out["float32_buffers_ms"] = _median_ms(lambda: dense(ks), reps)
    for bits in SETTINGS[1:]:
        c = KVQuant(bits)
        quant = [c.quantize(k) for k in ks]
        mx.eval(quant)

        def quantized():
            return [quantized_scaled_dot_product_attention(
                q, quant[2 * i], quant[2 * i + 1], scale=scale, mask=mask,
                group_size=c.group_size, bits=bits) for i in range(LAYERS)]

        out[f"q{bits}_matmul_ms"] = _median_ms(quantized, reps)
        out[f"q{bits}_dequantize_each_step_ms"] = _median_ms(
            lambda: dense([c.dequantize(p) for p in quant]), reps)
        fresh = mx.random.normal((1, KV_HEADS, queries, HEAD_DIM), key=key)
        out[f"q{bits}_round_trip_ms"] = _median_ms(
            lambda: [c.round_trip_pair(fresh, fresh) for _ in range(LAYERS)], reps)
    return out


def _caches(model, quant: KVQuant | None, left_padding: list[int]) -> list:
    """mlx-lm batch caches whose fresh keys and values are round-tripped as pages hold them."""

    class RoundTrip(BatchKVCache):
        def update_and_fetch(self, keys, values):
            if quant is not None:
                keys, values = quant.round_trip_pair(keys, values)
            return super().update_and_fetch(keys, values)

    return [RoundTrip(left_padding) for _ in model.layers]


def greedy(model, prompts: list[list[int]], quant: KVQuant | None, n: int) -> list[list[int]]:
    """``n`` greedy tokens for each prompt, all decoded together (left-padded)."""
    width = max(map(len, prompts))
    pad = [width - len(p) for p in prompts]
    caches = _caches(model, quant, pad)
    x = mx.array([[0] * k + p for k, p in zip(pad, prompts)])
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        nxt = mx.argmax(model(x, cache=caches)[:, -1, :], axis=-1)
        for o, t in zip(out, nxt.tolist()):
            o.append(t)
        x = nxt[:, None]
    return out


def perplexity(model, tokens: list[int], quant: KVQuant | None, chunk: int = 256) -> float:
    """exp of the mean negative log-likelihood of ``tokens[1:]``, read in chunks (as a prompt
    is), each chunk attending to the round-tripped keys and values of those before it."""
    caches, nll = _caches(model, quant, [0]), 0.0
    for a in range(0, len(tokens) - 1, chunk):
        ids = tokens[a : min(a + chunk, len(tokens) - 1)]
        logits = model(mx.array([ids]), cache=caches)[0].astype(mx.float32)
        targets = mx.array(tokens[a + 1 : a + 1 + len(ids)])
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll -= mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item()
    return math.exp(nll / (len(tokens) - 1))


def quality(gen: int) -> dict:
    from bench_ttft import document
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(None)
    tok = lm.tokenizer
    prompts = [tok.encode(tok.render([{"role": "user", "content": p}])) for p in PROMPTS]
    text = tok.encode(document())
    out: dict = {"model": lm.name, "prompts": len(prompts), "generated": gen,
                 "text_tokens": len(text), "device": str(mx.default_device())}
    base = None
    for bits in SETTINGS:
        quant = KVQuant(bits) if bits else None
        t = time.perf_counter()
        answers = greedy(lm.model, prompts, quant, gen)
        ppl = perplexity(lm.model, text, quant)
        row = {"perplexity": ppl, "seconds": time.perf_counter() - t}
        if base is None:
            base = (answers, ppl)
        else:
            same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), gen)
                    for a, b in zip(answers, base[0])]
            row.update({
                "perplexity_ratio": ppl / base[1],
                "identical_answers": sum(s == gen for s in same),
                "mean_identical_prefix": statistics.mean(same),
                "position_agreement": statistics.mean(
                    sum(x == y for x, y in zip(a, b)) / gen for a, b in zip(answers, base[0])),
            })
        out[f"q{bits}" if bits else "full"] = row
        print(json.dumps({f"q{bits}" if bits else "full": row}), flush=True)
    for bits in (8, 4):  # for reference: mx.quantize's own round trip (not a projection: no pages)
        ppl = perplexity(lm.model, text, MxQuantizeRoundTrip(bits))
        out[f"mx_quantize_q{bits}"] = {"perplexity": ppl, "perplexity_ratio": ppl / base[1]}
        print(json.dumps({f"mx_quantize_q{bits}": out[f"mx_quantize_q{bits}"]}), flush=True)
    return out


class MxQuantizeRoundTrip:
    """``mx.dequantize(mx.quantize(x))`` at ``bits``, group size 64: the reference perplexity."""

    def __init__(self, bits: int, group_size: int = 64):
        self.bits, self.group_size = bits, group_size

    def round_trip_pair(self, keys, values):
        def rt(x):
            q = mx.quantize(x, group_size=self.group_size, bits=self.bits)
            return mx.dequantize(*q, group_size=self.group_size, bits=self.bits).astype(x.dtype)

        return rt(keys), rt(values)


SYSTEM, TURN = 200, (60, 140)  # a 20-turn conversation: system prompt, then user + answer


def _setup(lm, bits: int | None, root: Path | None):
    """A manager and runner for ``bits`` as the engine sets them up (disk under ``root``)."""
    from kv_cache.model.attention import PrefixViews
    from kv_cache.opening import open_cache
    from kv_cache.layout.spec import with_kv_bits
    from mlx_kvserver.engine.runner import Runner

    spec, fp = with_kv_bits(lm.cache_spec, lm.fingerprint, bits)
    m = open_cache(spec, fp, page_size=32, max_ram_bytes=4 << 30, policy="lru", disk_dir=root,
                   max_disk_bytes=1 << 36, max_resident=4)
    m.views = PrefixViews(m.pool)
    return m, Runner(lm.model, m)


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*.safetensors"))


def _turn(m, runner, hist: list[int], new: list[int]) -> tuple[float, float]:
    """Turn 4: the cache step (``start``), then the prompt pass; back to the history after."""
    t0 = time.perf_counter()
    seq, match = m.start(hist + new, ["h"])
    t1 = time.perf_counter()
    runner.prefill(seq, new)
    t2 = time.perf_counter()
    assert match.tokens == len(hist), match
    seq.trim(len(new))
    m.keep(seq)
    return t1 - t0, t2 - t1


def _history(lm, bits, root: Path, hist: list[int], new: list[int], reps: int) -> dict:
    """Bytes per token of the saved history, and turn 4 warm (the history resident)."""
    m, runner = _setup(lm, bits, root)
    seq, _ = m.start(hist, [])
    for i in range(0, len(hist), 512):
        runner.prefill(seq, hist[i : i + 512])
    m.save("h", seq)
    memory = m.pool.stats().used_bytes / len(hist)
    m.keep(seq)
    m.sync()
    warm = [_turn(m, runner, hist, new) for _ in range(reps)]
    m.close()
    return {"memory_bytes_per_token": round(memory),
            "disk_bytes_per_token": round(_disk_bytes(root) / len(hist)),
            "warm_ttft_s": round(statistics.median(a + b for a, b in warm), 3)}


def _restored(rows: dict, lm, work: Path, hist: list[int], new: list[int], reps: int) -> None:
    """Turn 4 restored from disk (a new pool and store on the directory), the settings taking
    turns rep by rep; its TTFT, cache step and MB/s (the entry's files over the step)."""
    times: dict = {name: [] for name in rows}
    for _ in range(reps):
        for bits in SETTINGS:
            name = f"q{bits}" if bits else "full"
            m, runner = _setup(lm, bits, work / name / "restore")
            times[name].append(_turn(m, runner, hist, new))
            m.close()
    for name, row in rows.items():
        r = statistics.median(a + b for a, b in times[name])
        step = statistics.median(a for a, _ in times[name])
        row.update({"restored_ttft_s": round(r, 3),
                    "restored_over_warm": round(r / row["warm_ttft_s"], 2),
                    "restore_step_s": round(step, 3),
                    "restore_MB_per_s": round(row["disk_bytes_per_token"] * len(hist) / 1e6
                                              / step),
                    "restore_tokens_per_s": round(len(hist) / step)})


def _on_document(lm, bits, doc: list[int]):
    """8 sequences on one shared document (each later one reads it through a view), as the
    scheduler prompts them; with each one's next greedy token."""
    from bench_ttft import QUESTIONS

    tok = lm.tokenizer
    m, runner = _setup(lm, bits, None)
    seqs, nxt = [], []
    for i in range(8):
        prompt = doc + tok.encode(tok.render([{"role": "user", "content":
                                               f"(Reader {i + 1}) {QUESTIONS[i % 4]}"}]))
        seq, match = m.start(prompt, [])
        for at in range(match.tokens, len(prompt), 512):
            logits = runner.prefill(seq, prompt[at : at + 512])
            seq.commit()
        seqs.append(seq)
        nxt.append(int(mx.argmax(logits).item()))
    return m, runner, seqs, nxt


def _tok_s(runner, seqs, tokens, steps: int) -> tuple[float, float]:
    """Tokens per second of wall time, and per second of this process's CPU time (less moved
    by other work on a shared machine)."""
    for _ in range(2):
        tokens = mx.argmax(runner.decode(seqs, tokens), axis=-1).tolist()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tokens = mx.argmax(runner.decode(seqs, tokens), axis=-1).tolist()
    n = len(seqs) * steps
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def decode(rounds: int, steps: int = 8) -> dict:
    """Decode tokens/s at 1 and 8 sequences, the settings taking turns round by round (the
    machine is shared: a paired ratio per round says more than one long run each)."""
    from bench_ttft import document
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(None)
    doc = lm.tokenizer.encode(document())
    runs = {bits: _on_document(lm, bits, doc) for bits in SETTINGS}
    out: dict = {"device": str(mx.default_device()), "rounds": rounds, "steps": steps}
    for b in (1, 8):
        per = {bits: [] for bits in SETTINGS}
        for _ in range(rounds):
            for bits, (_, runner, seqs, nxt) in runs.items():
                per[bits].append(_tok_s(runner, seqs[:b], nxt[:b], steps))
        for i, unit in enumerate(("tok_s", "tok_per_cpu_s")):
            out[f"{unit}_{b}"] = {str(k): round(statistics.median(x[i] for x in v), 2)
                                  for k, v in per.items()}
            for bits in SETTINGS[1:]:
                out[f"q{bits}_over_full_{unit}_{b}"] = round(statistics.median(
                    q[i] / f[i] for q, f in zip(per[bits], per[None])), 3)
    for m, _, seqs, _ in runs.values():
        for seq in seqs:
            seq.close()
        m.close()
    return out


def _conversation_bytes(lm, bits, root: Path, turns: int = 20) -> dict:
    """Disk bytes of one ``turns``-turn conversation saved as the server saves it; the KV is
    random (sizes do not depend on it), written through the layer caches as a forward pass
    writes it."""
    m, _ = _setup(lm, bits, root)
    g = lm.cache_spec.groups[0]
    rng, n = mx.random.key(1), 0
    seq, _ = m.start([], [])

    def read(k: int) -> None:
        nonlocal n
        for c in seq.prepare():
            kv = mx.random.normal((2, 1, g.num_kv_heads, k, g.head_dim), key=rng)
            c.update_and_fetch(kv[0], kv[1])
        seq.append_tokens([(n + i) % 30000 + 10 for i in range(k)])
        n += k

    read(SYSTEM)
    for t in range(turns):
        read(TURN[0])
        m.save(f"u{t}", seq)
        read(TURN[1])
        m.save(f"a{t}", seq)
    seq.close()
    m.close()
    size = _disk_bytes(root)
    return {"conversation_tokens": n, "conversation_disk_bytes": size,
            "conversations_per_GB": round(1e9 / size, 1)}


def serving(reps: int, work: Path) -> dict:
    from bench_ttft import document
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(None)
    doc = lm.tokenizer.encode(document())
    toks = (doc * 2)[: 2266 + 25]
    out: dict = {"model": lm.name, "history_tokens": 2266, "new_tokens": 25,
                 "device": str(mx.default_device())}
    for bits in SETTINGS:
        name = f"q{bits}" if bits else "full"
        row = _history(lm, bits, work / name / "restore", toks[:2266], toks[2266:], reps)
        row.update(_conversation_bytes(lm, bits, work / name / "conversation"))
        out[name] = row
    _restored({k: out[k] for k in ("full", "q8", "q4")}, lm, work, toks[:2266], toks[2266:],
              reps)
    print(json.dumps({k: out[k] for k in ("full", "q8", "q4")}), flush=True)
    for name in ("q8", "q4"):
        out[name]["over_full"] = {k: round(out[name][k] / out["full"][k], 3)
                                  for k in out["full"] if isinstance(out["full"][k], (int, float))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["attention", "quality", "serving", "decode"])
    ap.add_argument("--gen", type=int, default=200)
    ap.add_argument("--history", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.what == "quality":
        result = quality(args.gen)
    elif args.what == "decode":
        result = decode(args.reps)
    elif args.what == "serving":
        with tempfile.TemporaryDirectory() as work:
            result = serving(args.reps, Path(work))
    else:
        result = {"decode": attention(args.history, args.reps),
                  "prefill_256": attention(args.history, max(3, args.reps // 5), queries=256)}
    print(json.dumps(result, indent=1))
    if args.json:
        from bench_results import write_result
        write_result(args.json, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
