"""Grammar libraries for constrained decoding, measured on the default model's 49k vocabulary.

For each library that is installed (llguidance, outlines-core, xgrammar):
  install   size on disk of the package and the dependencies it pulls (beyond numpy);
  tokenizer time to build the library's view of the vocabulary (once per model);
  schema    compile time of a structured-output JSON schema;
  mask      per decode step: the token mask of that schema's grammar along random walks
            (mean / p50 / p99, microseconds); for llguidance also the whole Matcher.apply
            (mask + numpy unpack + one mx.where on the logits, evaluated);
  tools     compile time of a forced tool call over 25 agent tools (harness/agent_tools.py,
            ~63 KB of JSON): cold (llguidance: median of --repeat), and again through Grammars'
            cache (equal tools, new objects); Matcher.apply along its first steps.
outlines-core's 25-tool compile runs in a child process under --tools-timeout.

Usage: .venv/bin/python -m benchmarks.grammar [--steps 600] [--repeat 5] [--tools-timeout 120]
           [--json FILE]
The result goes to benchmarks/results/grammar/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib
import importlib.util
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.record import OVERRIDE_HELP, write
from mlx_kvserver.chat.constraints import Grammars
from mlx_kvserver.chat.conversation import ResponseFormat, ToolChoice
from mlx_kvserver.models.tokenizer import ChatTokenizer
from mlx_kvserver.models.loading import resolve_and_load
from harness.agent_tools import agent_tool_objects, agent_tools

SCHEMA = {  # a structured answer: nested object, enums, an array of objects, bounded numbers
    "type": "object", "additionalProperties": False,
    "required": ["title", "category", "priority", "steps", "owner"],
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "category": {"type": "string", "enum": ["bug", "feature", "docs", "refactor", "test"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "steps": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["action", "done"],
            "properties": {"action": {"type": "string", "maxLength": 30},
                           "done": {"type": "boolean"}}}},
        "owner": {"type": "object", "additionalProperties": False, "required": ["name"],
                  "properties": {"name": {"type": "string", "maxLength": 20},
                                 "email": {"type": ["string", "null"], "maxLength": 30}}}}}


def install_size(dist: str) -> tuple[float, list[str]]:
    """MB on disk of ``dist`` and its installed requirements (numpy excluded: MLX brings it)."""
    seen: set[str] = set()
    todo, total = [dist], 0
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen or name == "numpy":
            continue
        seen.add(name)
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        total += sum((f.size or 0) for f in d.files or [])
        for req in d.requires or []:
            if "extra ==" not in req:
                todo.append(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0]
                            .split("=")[0].split("!")[0].split("~")[0].strip())
    return total / 1e6, sorted(seen - {dist})


def stats_us(xs: list[float]) -> dict[str, float]:
    a = np.array(xs) * 1e6
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "n": len(xs)}


def bonus_of(tok: ChatTokenizer, n: int) -> np.ndarray:
    """+4 on JSON punctuation tokens: random walks close what they open (as in the tests)."""
    b = np.zeros(n, np.float32)
    for i in range(tok.vocab_size):
        text = tok.decode([i], skip_special_tokens=False)
        if text.strip() and all(c in '{}[]",: ' for c in text):
            b[i] = 4.0
    return b


# -- llguidance (through mlx_kvserver.chat.constraints) -----------------------------------------

def cold(g: Grammars, compile_: Any, repeat: int) -> tuple[Any, float]:
    """The result of a compile and its median time in ms over ``repeat`` runs, cache emptied."""
    times = []
    for _ in range(repeat):
        g._cache.clear()
        t = time.perf_counter()
        out = compile_()
        times.append((time.perf_counter() - t) * 1e3)
    return out, statistics.median(times)


def bench_llguidance(tok: ChatTokenizer, vocab: int, steps: int, bonus: np.ndarray,
                     repeat: int) -> dict:
    import llguidance

    out: dict[str, Any] = {"version": llguidance.__version__}
    out["install_mb"], out["deps"] = install_size("llguidance")
    g = Grammars(tok, vocab)
    t = time.perf_counter()
    g._tokenizer("bench")
    out["tokenizer_s"] = time.perf_counter() - t
    fmt = ResponseFormat("json_schema", schema=SCHEMA)
    grammar, out["schema_compile_ms"] = cold(g, lambda: g.compile_response_format(fmt), repeat)
    rng = np.random.default_rng(0)
    fill, walks = [], []
    while len(fill) < steps:  # the library's mask alone, along random walks
        m, ids = grammar.matcher(), []
        while not m.finished and len(fill) < steps:
            t0 = time.perf_counter()
            m._ll.unsafe_compute_mask_ptr(m._bits.ctypes.data, m._ll_bytes)
            fill.append(time.perf_counter() - t0)
            allow = np.unpackbits(m._bits.view(np.uint8), count=tok.vocab_size, bitorder="little")
            logits = rng.standard_normal(tok.vocab_size) + bonus[:tok.vocab_size]
            tokn = int(np.where(allow.astype(bool), logits, -np.inf).argmax())
            if tokn in g.eos_ids:
                break
            m._ll.consume_token(tokn)
            ids.append(tokn)
        walks.append(ids)
    apply_ = []
    for ids in walks:  # the same walks again through Matcher.apply (mask + unpack + mx.where)
        m = grammar.matcher()
        for tokn in ids:
            logits = mx.array(rng.standard_normal(vocab).astype(np.float32))
            mx.eval(logits)
            t0 = time.perf_counter()
            mx.eval(m.apply(logits))
            apply_.append(time.perf_counter() - t0)
            m.advance(tokn)
    out["mask_us"], out["apply_us"] = stats_us(fill), stats_us(apply_)
    tools = agent_tool_objects()
    args = (ToolChoice("required"), "<tool_call>", "</tool_call>", True)
    tg, out["tools_compile_ms"] = cold(g, lambda: g.compile_tool_calls(tools, *args), repeat)
    cached = []
    for _ in range(repeat):
        fresh = agent_tool_objects()  # equal content, new objects
        t = time.perf_counter()
        assert g.compile_tool_calls(fresh, *args) is tg
        cached.append((time.perf_counter() - t) * 1e3)
    out["tools_cached_ms"] = statistics.median(cached)
    tm, first = [], []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        m = tg.matcher()
        for k in range(60):
            logits = mx.array(rng.standard_normal(vocab).astype(np.float32) + bonus)
            t0 = time.perf_counter()
            masked = m.apply(logits)
            mx.eval(masked)
            (first if seed == 0 and k == 0 else tm).append(time.perf_counter() - t0)
            tokn = int(mx.argmax(masked).item())
            if tokn in g.eos_ids or m.finished:
                break
            m.advance(tokn)
    out["tools_first_step_ms"] = first[0] * 1e3
    out["tools_apply_us"] = stats_us(tm)
    return out


# -- outlines-core ----------------------------------------------------------------------------

def _outlines_vocab(tok: ChatTokenizer) -> Any:
    import outlines_core as oc
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    u2b = {v: k for k, v in bytes_to_unicode().items()}
    m: dict[bytes, list[int]] = {}
    for s, i in tok.hf.get_vocab().items():
        if i in tok.eos_token_ids:
            continue
        try:
            b = bytes(u2b[c] for c in s)
        except KeyError:
            b = s.encode()
        m.setdefault(b, []).append(i)
    return oc.Vocabulary(min(tok.eos_token_ids), m)


def _tools_schema() -> str:
    return json.dumps({"oneOf": [{
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": f["function"]["name"]},
                       "arguments": f["function"]["parameters"]}} for f in agent_tools()]})


def _outlines_tools_child(q: Any) -> None:
    import outlines_core as oc
    tok = resolve_and_load("default").tokenizer
    v = _outlines_vocab(tok)
    try:
        t = time.perf_counter()
        rx = oc.json_schema.build_regex_from_schema(_tools_schema(), "[ ]?")
        t1 = time.perf_counter()
        oc.Index(rx, v)
        q.put({"regex_s": t1 - t, "total_s": time.perf_counter() - t, "regex_chars": len(rx)})
    except Exception as e:  # noqa: BLE001 - reported in the table
        q.put({"error": f"{type(e).__name__}: {e}"[:200]})


def bench_outlines(tok: ChatTokenizer, vocab: int, steps: int, bonus: np.ndarray,
                   tools_timeout: float) -> dict:
    import outlines_core as oc

    out: dict[str, Any] = {"version": md.version("outlines-core")}
    out["install_mb"], out["deps"] = install_size("outlines-core")
    t = time.perf_counter()
    v = _outlines_vocab(tok)
    out["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), "[ ]?"), v)
    out["schema_compile_ms"] = (time.perf_counter() - t) * 1e3
    bits = np.zeros((tok.vocab_size + 31) // 32, np.int32)
    rng, fill = np.random.default_rng(0), []
    eos = min(tok.eos_token_ids)
    while len(fill) < steps:
        guide = oc.Guide(index)
        while not guide.is_finished() and len(fill) < steps:
            t0 = time.perf_counter()
            guide.write_mask_into(bits.ctypes.data, bits.size, 4)
            fill.append(time.perf_counter() - t0)
            allow = np.unpackbits(bits.view(np.uint8), count=tok.vocab_size, bitorder="little")
            logits = rng.standard_normal(tok.vocab_size) + bonus[:tok.vocab_size]
            tokn = int(np.where(allow.astype(bool), logits, -np.inf).argmax())
            if tokn == eos:
                break
            guide.advance(tokn)
    out["mask_us"] = stats_us(fill)
    q: Any = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_outlines_tools_child, args=(q,))
    p.start()
    p.join(tools_timeout)
    if p.is_alive():
        p.kill()
        out["tools"] = f"not done after {tools_timeout:.0f} s"
    else:
        r = q.get() if not q.empty() else {"error": f"child exit {p.exitcode}"}
        out["tools"] = r.get("error") or f"{r['total_s'] * 1e3:.0f} ms"
        out["tools_detail"] = r
    return out


def bench_xgrammar() -> dict:
    try:
        importlib.import_module("xgrammar")
    except Exception as e:  # noqa: BLE001 - e.g. it imports torch
        return {"error": f"import failed: {type(e).__name__}: {e}"[:160]}
    return {"error": "installed; not measured here (needs torch)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--tools-timeout", type=float, default=120.0)
    ap.add_argument("--repeat", type=int, default=5, help="llguidance compiles (median)")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    a = ap.parse_args()
    lm = resolve_and_load("default")
    tok, vocab = lm.tokenizer, int(lm.model.args.vocab_size)
    bonus = bonus_of(tok, vocab)
    res: dict[str, Any] = {"vocab": vocab, "tools_json_bytes": len(json.dumps(agent_tools()))}
    res["llguidance"] = bench_llguidance(tok, vocab, a.steps, bonus, a.repeat)
    res["outlines-core"] = (bench_outlines(tok, vocab, a.steps, bonus, a.tools_timeout)
                            if importlib.util.find_spec("outlines_core") else
                            {"error": "not installed (pip install outlines-core)"})
    res["xgrammar"] = (bench_xgrammar() if importlib.util.find_spec("xgrammar") else
                       {"error": "not installed (pip install xgrammar pulls torch)"})

    print(f"vocab {vocab}, 25 tools = {res['tools_json_bytes']:,} bytes of JSON")
    print(f"{'library':<14}{'install MB':>11}{'tokenizer s':>12}{'schema ms':>10}"
          f"{'mask us mean/p50/p99':>24}{'25 tools':>12}")
    for name in ("llguidance", "outlines-core", "xgrammar"):
        r = res[name]
        if "error" in r:
            print(f"{name:<14}  {r['error']}")
            continue
        mk = r["mask_us"]
        tools = f"{r['tools_compile_ms']:.0f} ms" if "tools_compile_ms" in r else r["tools"]
        print(f"{name:<14}{r['install_mb']:>11.1f}{r['tokenizer_s']:>12.2f}"
              f"{r['schema_compile_ms']:>10.1f}"
              f"{mk['mean']:>10.0f}/{mk['p50']:.0f}/{mk['p99']:.0f}".ljust(71) + f"{tools:>12}")
    ll = res["llguidance"]
    print(f"llguidance 25 tools: cold {ll['tools_compile_ms']:.1f} ms, cached "
          f"{ll['tools_cached_ms']:.2f} ms, first mask {ll['tools_first_step_ms']:.1f} ms, "
          f"then Matcher.apply {ll['tools_apply_us']['mean']:.0f}/{ll['tools_apply_us']['p50']:.0f}"
          f"/{ll['tools_apply_us']['p99']:.0f} us; schema Matcher.apply (mask+where) "
          f"{ll['apply_us']['mean']:.0f}/{ll['apply_us']['p50']:.0f}/{ll['apply_us']['p99']:.0f}"
          " us (mean/p50/p99)")
    print(json.dumps(res, indent=1, default=str))
    write("grammar", json.dumps(res, indent=1, default=str), override=a.json)


if __name__ == "__main__":
    main()
