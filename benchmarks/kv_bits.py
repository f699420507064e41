"""KV pages in 8 and 4 bits against full precision, on this machine (docs/BENCHMARKS.md).

  attention  30 layers of attention (the default model's shape) over a shared prefix of
             ``--history`` positions, for 1 and 256 queries: a decoded view (float buffers, what
             the server reads) against decoding the pages at every step; the coding of new keys
             and values (``KVQuant.fresh``). (Its packed view, read by ``mx.quantized_matmul``,
             went with ``--kv-attention``: its figures are in docs/BENCHMARKS.md's git history.)
  serving    with the default model, each setting through the cache as the server's engine
             sets it up (prefix views, the runner): bytes per token of KV in memory and on
             disk for ~2,266 tokens of history; turn 4 of the ~2,400-token chat (25 new tokens)
             warm and restored from disk (a new pool and store on the same directory; the
             settings take turns rep by rep), medians of ``--reps``: its cache step plus
             prompt pass (the time to the first token without HTTP) and the restore's MB/s (bytes of the entry's files over the cache
             step); and the disk bytes of a 20-turn conversation (``TURN`` tokens a turn,
             saved after every prompt and answer as the server does, random KV), so how many
             fit in 1 GB.
  decode     decode tokens/s at 1 and 8 sequences on one shared document (~2,000 tokens, read
             through prefix views), the settings taking turns for ``--reps`` rounds.

What the settings cost the answers (perplexity, greedy agreement): benchmarks/kv_quality.py.

Usage: .venv/bin/python -m benchmarks.kv_bits attention [--history 2400] [--reps 20] [--json FILE]
       .venv/bin/python -m benchmarks.kv_bits serving [--reps 3] [--json FILE]
       .venv/bin/python -m benchmarks.kv_bits decode [--reps 5] [--json FILE]
The result goes to benchmarks/results/kv_bits/<attention|serving|decode>/<run's UTC time>.json
unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.record import OVERRIDE_HELP, write
from kv_cache.layout.quant import make_quant

# each setting's name, its --kv-bits and whether keys are per channel over a page (as the server
# picks for the default model) or per position (as for a model with recurrent state)
SETTINGS = {"full": (None, True), "q8": (8, True), "q8_4": ((8, 4), True),
            "q4": (4, True), "q4_position": (4, False)}
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
    """Milliseconds for ``queries`` query positions attending to a shared prefix of ``history``
    keys in every layer: float32 buffers (a decoded view), then for each setting decoding the
    pages at every step; and the coding of one step's fresh keys and values."""
    key = mx.random.key(0)
    shape = (1, KV_HEADS, history, HEAD_DIM)
    ks = [mx.random.normal(shape, key=mx.random.split(key, 2 * LAYERS)[i]) for i in range(2 * LAYERS)]
    q = mx.random.normal((1, Q_HEADS, queries, HEAD_DIM), key=key)
    mask = None  # a shared prefix: every query sees every key
    scale = HEAD_DIM ** -0.5
    mx.eval(ks, q)
    out: dict = {"history": history, "queries": queries, "device": str(mx.default_device())}

    def dense(buffers):
        return [mx.fast.scaled_dot_product_attention(q, buffers[2 * i], buffers[2 * i + 1],
                                                     scale=scale, mask=mask)
                for i in range(LAYERS)]

    out["float32_buffers_ms"] = _median_ms(lambda: dense(ks), reps)
    for name, (bits, per_channel) in list(SETTINGS.items())[1:]:
        if not per_channel:
            continue  # q4 above times the same codec (pages decoded per position)
        c = make_quant(bits)
        rows = [c.fresh(ks[2 * i], ks[2 * i + 1])[2:] for i in range(LAYERS)]
        mx.eval(rows)

        def decoded():  # decoding the pages at every step, then float attention
            pages = [c.decode(c.join(kw, vw), mx.float32, HEAD_DIM) for kw, vw in rows]
            return dense([x for d in pages for x in (d[:, 0], d[:, 1])])

        out[f"{name}_decode_each_step_ms"] = _median_ms(decoded, reps)
        fresh = mx.random.normal((1, KV_HEADS, queries, HEAD_DIM), key=key)
        out[f"{name}_fresh_ms"] = _median_ms(
            lambda: [c.fresh(fresh, fresh) for _ in range(LAYERS)], reps)
    return out


SYSTEM, TURN = 200, (60, 140)  # a 20-turn conversation: system prompt, then user + answer


def _setup(lm, setting: tuple, root: Path | None):
    """A manager and runner for ``setting`` (``--kv-bits``, keys per channel) as the engine
    sets them up (disk under ``root``)."""
    from kv_cache.model.views import PrefixViews
    from kv_cache.opening import open_cache
    from kv_cache.layout.spec import key_block_for, with_kv_bits
    from mlx_kvserver.engine.runner import Runner

    bits, per_channel = setting
    block = key_block_for(lm.cache_spec, bits, 32) if per_channel else 0
    spec, fp = with_kv_bits(lm.cache_spec, lm.fingerprint, bits, block)
    m = open_cache(spec, fp, page_size=32, max_ram_bytes=4 << 30, policy="lru", disk_dir=root,
                   max_disk_bytes=1 << 36, max_resident=4)
    m.views = PrefixViews(m.pool)
    return m, Runner(lm.model, m)


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*.safetensors"))


def _turn(m, runner, hist: list[int], new: list[int]) -> tuple[float, float]:
    """Turn 4: the cache step (``start``), then the prompt pass; back to the history after.
    Pages coded when full: a reuse from pages stops at the history's last page boundary and the
    prompt pass reads the rest of the history too (a resident sequence goes on from its end)."""
    t0 = time.perf_counter()
    seq, match = m.start(hist + new, ["h"])
    t1 = time.perf_counter()
    runner.prefill(seq, (hist + new)[match.tokens :])
    t2 = time.perf_counter()
    whole = len(hist) - len(hist) % m.pool.page_size if m.pool.spec.whole_pages else len(hist)
    assert match.tokens in (len(hist), whole), match  # a resident sequence goes on mid-page
    seq.trim(len(seq.tokens) - len(hist))
    m.keep(seq)
    return t1 - t0, t2 - t1


def _history(lm, setting, root: Path, hist: list[int], new: list[int], reps: int) -> dict:
    """Bytes per token of the saved history, and turn 4 warm (the history resident)."""
    m, runner = _setup(lm, setting, root)
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
        for name, setting in SETTINGS.items():
            m, runner = _setup(lm, setting, work / name / "restore")
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


def _on_document(lm, setting, doc: list[int]):
    """8 sequences on one shared document (each later one reads it through a view), as the
    scheduler prompts them; with each one's next greedy token."""
    from benchmarks.ttft import QUESTIONS

    tok = lm.tokenizer
    m, runner = _setup(lm, setting, None)
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
    from benchmarks.ttft import document
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(None)
    doc = lm.tokenizer.encode(document())
    runs = {name: _on_document(lm, setting, doc) for name, setting in SETTINGS.items()}
    out: dict = {"device": str(mx.default_device()), "rounds": rounds, "steps": steps}
    for b in (1, 8):
        per: dict = {name: [] for name in SETTINGS}
        for _ in range(rounds):
            for name, (_, runner, seqs, nxt) in runs.items():
                per[name].append(_tok_s(runner, seqs[:b], nxt[:b], steps))
        for i, unit in enumerate(("tok_s", "tok_per_cpu_s")):
            out[f"{unit}_{b}"] = {str(k): round(statistics.median(x[i] for x in v), 2)
                                  for k, v in per.items()}
            for name in list(SETTINGS)[1:]:
                out[f"{name}_over_full_{unit}_{b}"] = round(statistics.median(
                    q[i] / f[i] for q, f in zip(per[name], per["full"])), 3)
    for m, _, seqs, _ in runs.values():
        for seq in seqs:
            seq.close()
        m.close()
    return out


def _conversation_bytes(lm, setting, root: Path, turns: int = 20) -> dict:
    """Disk bytes of one ``turns``-turn conversation saved as the server saves it; the KV is
    random (sizes do not depend on it), written through the layer caches as a forward pass
    writes it."""
    m, _ = _setup(lm, setting, root)
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
    from benchmarks.ttft import document
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(None)
    doc = lm.tokenizer.encode(document())
    toks = (doc * 2)[: 2266 + 25]
    out: dict = {"model": lm.name, "history_tokens": 2266, "new_tokens": 25,
                 "device": str(mx.default_device())}
    for name, setting in SETTINGS.items():
        row = _history(lm, setting, work / name / "restore", toks[:2266], toks[2266:], reps)
        row.update(_conversation_bytes(lm, setting, work / name / "conversation"))
        out[name] = row
    _restored({k: out[k] for k in SETTINGS}, lm, work, toks[:2266], toks[2266:], reps)
    print(json.dumps({k: out[k] for k in SETTINGS}), flush=True)
    for name in list(SETTINGS)[1:]:
        out[name]["over_full"] = {k: round(out[name][k] / out["full"][k], 3)
                                  for k in out["full"] if isinstance(out["full"][k], (int, float))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["attention", "serving", "decode"])
    ap.add_argument("--history", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    if args.what == "decode":
        result = decode(args.reps)
    elif args.what == "serving":
        with tempfile.TemporaryDirectory() as work:
            result = serving(args.reps, Path(work))
    else:
        result = {"decode": attention(args.history, args.reps),
                  "prefill_256": attention(args.history, max(3, args.reps // 5), queries=256)}
    print(json.dumps(result, indent=1))
    write(f"kv_bits/{args.what}", json.dumps(result, indent=1) + "\n", override=args.json)


if __name__ == "__main__":
    main()
