"""KV pages in bits against full precision: what they cost the default model's answers.

All settings in one run, on the default model's real weights (its latest run: docs/BENCHMARKS.md,
"KV pages in 8 and 4 bits"):

  perplexity  of a long public text read with long context: the first ``--text-tokens``
              (12,288) tokens of Python's own documentation as ``help()`` shows it (the
              standard library's ``pydoc_data/topics.py``, installed with every Python: its
              topics in file order), read in windows of ``2 * --context`` tokens that advance by
              ``--context``, each scoring only its second half: every scored token (8,192 here)
              has between ``--context`` (4,096) and ``2 * --context - 1`` tokens before it.
              The model reads keys and values through a cache that codes them exactly as pages
              do (``KVQuant.round_trip_pair``: the decoded values of the stored codes), so these
              are the paged cache's figures too.
  agreement   greedy answers of ``--gen`` (200) tokens to 20 chat prompts decoded together:
              how many tokens each answer keeps before its first difference from full
              precision, and the share of positions that agree.

Settings: full precision, 8, 8,4 (keys 8, values 4), 4, keys and values per position (the
Hadamard rotation, groups of 64: what a sliding window or a model with recurrent state holds);
for reference ``mx.quantize``'s own round trip at 4 bits (not exact, so not usable for pages),
``q4_g32``: 4 bits in groups of 32 (what a head_dim that 64 does not divide gets), ``q4_8``:
keys 4, values 8 (which side the loss is on). The settings of flags that are gone
(``--kv-calibration on``, ``--kv-rotation none``; their figures: docs/BENCHMARKS.md's git history)
are in this script's git history.

SIMULATIONS, not usable for pages (``benchmarks/kivi_sim.py``): ``q4_kivi``: KIVI-style keys, 4 bits
per (layer, kv head, channel) over page-aligned blocks of 32 consecutive positions, the trailing
incomplete block in full precision, each query reading what a token-by-token decode would (its
own block float, earlier blocks decoded), values as ``--kv-bits 4`` codes them (rotation, groups
of 64); ``q4_kivi_g16``: blocks of 16; ``kivi4_values_float``: the same keys, values in full
precision (the keys' share of the loss); ``q4_open_float``: the control, keys coded per
position as ``--kv-bits 4`` does there but the open block of 32 float as in ``q4_kivi`` (what
the float tail alone gives).

THROUGH THE REAL PAGED CACHE (``PagedSequence`` over a page pool, pages of 32, as the server
runs it: prompt pieces committed to pages, answers decoded together by ``batch_caches``):
``full_pages``: full precision (the control: what the paged path alone changes);
``q4_pages``: ``--kv-bits 4`` as the server holds the default model's pages (keys per channel
over a page, ``kv_cache.layout.channel_keys``); ``q4_position_pages``: the same with keys per
position (what a model with recurrent state gets); ``q8_pages``, ``q8_4_pages``: 8 and 8,4 as
the server holds them.

Usage: .venv/bin/python -m benchmarks.kv_quality [--gen 200] [--context 4096] [--json FILE]
The result goes to benchmarks/results/kv_quality/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from benchmarks.kivi_sim import KiviSim
from benchmarks.record import OVERRIDE_HELP, write
from kv_cache import open_cache
from kv_cache.hooks import batch_caches, install
from kv_cache.layout.spec import key_block_for, with_kv_bits
from kv_cache.layout.quant import KVQuant, make_quant

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


class MxQuantizeRoundTrip:
    """``mx.dequantize(mx.quantize(x))`` at ``bits``, group size 64: a reference only."""

    def __init__(self, bits: int, group_size: int = 64):
        self.bits, self.group_size = bits, group_size

    def round_trip_pair(self, keys, values):
        def rt(x):
            q = mx.quantize(x, group_size=self.group_size, bits=self.bits)
            return mx.dequantize(*q, group_size=self.group_size, bits=self.bits).astype(x.dtype)

        return rt(keys), rt(values)


class Paged:
    """A setting read through the real paged cache: ``--kv-bits``, and keys per channel over a
    page as the server picks them (``key_block_for``) or per position (``per_channel`` off)."""

    def __init__(self, bits, per_channel: bool = True, page_size: int = 32):
        self.bits, self.per_channel, self.page_size = bits, per_channel, page_size


# name: (--kv-bits, group size), keys and values per position
SETTINGS = {"full": None, "q8": (8, 64), "q8_4": ("8,4", 64), "q4": (4, 64),
            "q4_g32": (4, 32), "q4_8": ("4,8", 64), "mx_quantize_q4": MxQuantizeRoundTrip(4),
            # SIMULATIONS (benchmarks/kivi_sim.py): keys per channel over blocks of positions
            "q4_kivi": KiviSim(32, 4, KVQuant(4)), "q4_kivi_g16": KiviSim(16, 4, KVQuant(4)),
            "kivi4_values_float": KiviSim(32, 4, None),
            "q4_open_float": KiviSim(32, 4, KVQuant(4), per_channel=False),
            # the real paged cache (pages of 32)
            "full_pages": Paged(None), "q4_pages": Paged(4),
            "q4_position_pages": Paged(4, per_channel=False),
            "q8_pages": Paged(8), "q8_4_pages": Paged("8,4")}
GREEDY = ("full", "q8", "q8_4", "q4", "full_pages", "q4_pages", "q4_position_pages", "q8_pages",
          "q8_4_pages")  # the settings whose answers are compared


class Setting:
    """A setting's codec per model slot, as the server makes it (``Engine._open``)."""

    def __init__(self, lm, setting):
        self.by_slot: dict = {}
        self.quant = None
        self.kivi = setting if isinstance(setting, KiviSim) else None
        self.manager = None
        if isinstance(setting, Paged):
            block = key_block_for(lm.cache_spec, setting.bits, setting.page_size) \
                if setting.per_channel else 0
            spec, fp = with_kv_bits(lm.cache_spec, lm.fingerprint, setting.bits, block)
            self.quant = spec.groups[0].quant
            self.manager = open_cache(spec, fp, page_size=setting.page_size,
                                      max_ram_bytes=4 << 30, policy="lru", disk_dir=None,
                                      max_disk_bytes=0, max_resident=0)
            install(lm.model)
        elif isinstance(setting, tuple):
            self.quant = make_quant(*setting)
            self.by_slot = {s: self.quant for g in lm.cache_spec.groups for s in g.layers}
        elif setting is not None and self.kivi is None:
            self.by_slot = {i: setting for i in range(len(lm.model.layers))}

    def round_trip_pair(self, keys, values, slot):
        return self.by_slot[slot].round_trip_pair(keys, values)

    def cache(self, slot: int):
        """The model's cache for layer ``slot`` under this setting (a ``KVCache``)."""
        return self.kivi.make_cache() if self.kivi is not None else _coding(KVCache, self, slot)()


def text_tokens(tokenizer, n: int) -> tuple[list[int], str]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics.values())
    tokens = tokenizer.encode(text)
    if len(tokens) < n:
        raise SystemExit(f"pydoc_data.topics gives {len(tokens)} tokens, fewer than {n}")
    return tokens[:n], f"pydoc_data/topics.py of Python {sys.version.split()[0]}"


def _coding(cls, codec: Setting, slot: int):
    class Coded(cls):
        def update_and_fetch(self, keys, values):
            if codec.by_slot:
                keys, values = codec.round_trip_pair(keys, values, slot)
            return super().update_and_fetch(keys, values)

    return Coded


def perplexity(model, tokens: list[int], quant, context: int, chunk: int = 512) -> dict:
    """exp of the mean negative log-likelihood of the scored tokens (see the module's note)."""
    nll, scored = 0.0, 0
    for start in range(0, len(tokens) - 2 * context + 1, context):
        window = tokens[start : start + 2 * context]
        seq = quant.manager.new_sequence() if quant.manager is not None else None
        caches = None if seq is not None else [quant.cache(i) for i in range(len(model.layers))]
        for a in range(0, len(window) - 1, chunk):
            ids = window[a : min(a + chunk, len(window) - 1)]
            logits = model(mx.array([ids]), cache=caches or seq.prepare())[0]
            if seq is not None:  # into pages, as the server's prompt pieces
                seq.append_tokens(ids)
                seq.commit()
            first = max(context - 1 - a, 0)  # predicts position a + 1 + i: score from context on
            if first >= len(ids):
                mx.eval([c.state for c in caches] if caches else logits)
                continue
            lp = logits[first:].astype(mx.float32)
            lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
            targets = mx.array(window[a + 1 + first : a + 1 + len(ids)])
            nll -= mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item()
            scored += len(ids) - first
        if seq is not None:
            seq.close()
    return {"perplexity": math.exp(nll / scored), "scored_tokens": scored}


def greedy(model, prompts: list[list[int]], quant, n: int) -> list[list[int]]:
    """``n`` greedy tokens for each prompt, all decoded together (left-padded)."""
    width = max(map(len, prompts))
    pad = [width - len(p) for p in prompts]
    if quant.kivi is not None:
        raise ValueError("the KIVI simulation has no batched cache: no greedy answers")
    if quant.manager is not None:
        return greedy_paged(model, prompts, quant.manager, n)
    caches = [_coding(BatchKVCache, quant, i)(pad) for i in range(len(model.layers))]
    x = mx.array([[0] * k + p for k, p in zip(pad, prompts)])
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        nxt = mx.argmax(model(x, cache=caches)[:, -1, :], axis=-1)
        for o, t in zip(out, nxt.tolist()):
            o.append(t)
        x = nxt[:, None]
    return out


def greedy_paged(model, prompts: list[list[int]], manager, n: int) -> list[list[int]]:
    """``greedy`` through the paged cache: each prompt read alone, the answers decoded
    together (``batch_caches``), as the server's scheduler does."""
    seqs, nxt = [], []
    for p in prompts:
        seq = manager.new_sequence()
        logits = model(mx.array([p]), cache=seq.prepare())[0, -1]
        seq.append_tokens(p)
        seq.commit()
        seqs.append(seq)
        nxt.append(mx.argmax(logits).item())
    out = [[t] for t in nxt]
    for _ in range(n - 1):
        logits = model(mx.array(nxt)[:, None], cache=batch_caches(seqs))[:, -1, :]
        for seq, t in zip(seqs, nxt):
            seq.append_tokens([t])
        nxt = mx.argmax(logits, axis=-1).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
    for seq in seqs:
        seq.close()
    return out


def agreement(answers: list[list[int]], base: list[list[int]], n: int) -> dict:
    same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
            for a, b in zip(answers, base)]
    return {"identical_answers": sum(s == n for s in same),
            "mean_tokens_before_first_difference": statistics.mean(same),
            "median_tokens_before_first_difference": statistics.median(same),
            "position_agreement": round(statistics.mean(
                sum(x == y for x, y in zip(a, b)) / n for a, b in zip(answers, base)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gen", type=int, default=200)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--text-tokens", type=int, default=12288)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(None)
    tok = lm.tokenizer
    prompts = [tok.encode(tok.render([{"role": "user", "content": p}])) for p in PROMPTS]
    text, source = text_tokens(tok, args.text_tokens)
    out: dict = {"model": lm.name, "text": source, "text_tokens": len(text),
                 "context": args.context, "prompts": len(prompts), "generated": args.gen,
                 "device": str(mx.default_device()), "settings": {}}
    answers: dict = {}
    for name in args.settings:
        quant = Setting(lm, SETTINGS[name])
        t = time.perf_counter()
        row = perplexity(lm.model, text, quant, args.context)
        if name in GREEDY:
            answers[name] = greedy(lm.model, prompts, quant, args.gen)
        row["seconds"] = round(time.perf_counter() - t, 1)
        if "full" in out["settings"]:
            base = out["settings"]["full"]["perplexity"]
            row["perplexity_change_pct"] = round(100 * (row["perplexity"] / base - 1), 3)
            if name in answers:
                row.update(agreement(answers[name], answers["full"], args.gen))
        if quant.quant is not None:
            row["bytes_per_position_and_head"] = quant.quant.kv_bytes(64, mx.float32)
            row["setting"] = quant.quant.label()
        if quant.kivi is not None:
            row["bytes_per_position_and_head"] = quant.kivi.kv_bytes(64)
            row["setting"] = quant.kivi.label()
            row["simulated"] = True
        out["settings"][name] = row
        print(json.dumps({name: row}), flush=True)
    print(json.dumps(out, indent=1))
    write("kv_quality", json.dumps(out, indent=1) + "\n", override=args.json)


if __name__ == "__main__":
    main()
