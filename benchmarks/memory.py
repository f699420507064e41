"""Resident KV bytes when conversations share a prefix: paged pool vs mlx-lm copies vs no sharing.

Two cases, on the default model's geometry (30 layers, 3 KV heads, head_dim 64, float32, pages of
32 tokens); the model's keys and values are faked with random arrays fed through each layer's
``update_and_fetch`` (no model is needed: only shapes and token ids matter):

  shared prefix  N conversations (1, 2, 4, 8, 16) after a 2,000-token prefix, 100 own tokens each
                 (a user message, prefilled in one chunk);
  branching      n branches (1, 2, 4, 8) after 2,000 tokens, 128 generated tokens each (decoded one
                 token at a time).

Three ways of holding them:

  paged          this project's ``PagePool``: a ``PagedSequence`` for the prefix, ``fork()`` per
                 conversation, own tokens committed (copy-on-write of the shared tail page), the
                 working buffers dropped; ``pool.stats().used_bytes`` (whole pages) and the bytes
                 of the page arrays (tokens actually stored);
  mlx-lm         one ``mlx_lm.models.cache.KVCache`` per layer per conversation (its prompt cache
                 keeps a separate copy per conversation), fed in the same chunks as mlx-lm feeds
                 them (prefill in steps of 2,048, buffers grown in steps of 256): ``nbytes``;
  no sharing     exact bytes of every conversation's tokens, summed.

A run writes its raw result (the geometry and every row, in bytes) to
benchmarks/results/memory/<run's UTC time>.json, its tables (.md) and plot (.png) beside it (a
--quick run none of them, unless --plot names a file).

Usage: .venv/bin/python -m benchmarks.memory [--quick] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from benchmarks import record
from kv_cache.pages.pool import PagePool
from kv_cache.model.sequence import PagedSequence

MB = 10**6
PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size


@dataclass(frozen=True)
class Geometry:
    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64
    page_size: int = 32
    dtype: mx.Dtype = mx.float32

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.size

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token


@dataclass(frozen=True)
class Result:
    n: int  # conversations or branches
    tokens: int  # tokens held, counting each conversation's copy of the prefix
    exact: int  # no sharing: every conversation's tokens, exactly
    mlx_lm: int  # one KVCache per layer per conversation
    paged: int  # pool.stats().used_bytes
    paged_data: int  # bytes of the pool's page arrays (tokens actually stored)
    ideal: int  # the prefix once plus every conversation's own tokens, exactly
    pages: int


def _kv(g: Geometry, n: int) -> tuple[mx.array, mx.array]:
    shape = (1, g.kv_heads, n, g.head_dim)
    return mx.random.normal(shape).astype(g.dtype), mx.random.normal(shape).astype(g.dtype)


def _feed(caches, g: Geometry, n: int) -> None:
    """Fake a forward pass over ``n`` tokens: every layer gets keys and values."""
    k, v = _kv(g, n)
    for c in caches:
        c.update_and_fetch(k, v)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])


def _dt(g: Geometry) -> str:
    return str(g.dtype).rsplit(".", 1)[-1]


def chunks(n: int, step: int) -> list[int]:
    return [min(step, n - s) for s in range(0, n, step)]


def exact_bytes(g: Geometry, tokens: int) -> int:
    return tokens * g.bytes_per_token


def mlx_lm_bytes(g: Geometry, prefix: int, own: int, decode: bool) -> int:
    """``nbytes`` of one conversation's mlx-lm cache: the prefix prefilled in steps of 2,048, then
    ``own`` tokens in one chunk (``decode=False``) or one at a time (``decode=True``)."""
    caches = [KVCache() for _ in range(g.layers)]
    for n in chunks(prefix, PREFILL_STEP) + ([1] * own if decode else chunks(own, PREFILL_STEP)):
        _feed(caches, g, n)
    assert caches[0].offset == prefix + own
    return sum(c.nbytes for c in caches)


def paged_bytes(g: Geometry, prefix: int, own: int, n: int, seed: int = 0) -> tuple[int, int, int]:
    """(used_bytes, page-array bytes, pages) of a pool holding ``n`` forks of one ``prefix``-token
    sequence, each with ``own`` tokens of its own."""
    rng = np.random.default_rng(seed)
    P = g.page_size
    room = -(-prefix // P) + n * (-(-(own + P) // P) + 1)  # never the limit; never evicts
    pool = PagePool(g.layers, g.kv_heads, g.head_dim, page_size=P, dtype=g.dtype,
                    max_bytes=room * g.page_bytes)
    root = PagedSequence(pool)
    ids = rng.integers(0, 32000, prefix).tolist()
    _feed(root.layers, g, prefix)
    root.append_tokens(ids)
    root.commit()
    forks = [root.fork() for _ in range(n)]
    root.close()  # the conversations hold the prefix now
    for seq in forks:
        _feed(seq.prepare(), g, own)
        seq.append_tokens(rng.integers(0, 32000, own).tolist())  # distinct tokens per fork
        seq.commit()
        seq.drop_buffers()
    st = pool.stats()
    assert st.evictions == 0, "the pool evicted pages: its budget is too small"
    data = sum(pool.data(b).nbytes for b in pool.ref_counts())
    for seq in forks:
        seq.close()
    return st.used_bytes, data, st.used_pages


def run(g: Geometry, prefix: int, own: int, ns: Sequence[int], decode: bool) -> list[Result]:
    one_mlx = mlx_lm_bytes(g, prefix, own, decode)  # every conversation's copy has this shape
    out = []
    for n in ns:
        used, data, pages = paged_bytes(g, prefix, own, n)
        out.append(Result(n=n, tokens=n * (prefix + own), exact=n * exact_bytes(g, prefix + own),
                          mlx_lm=n * one_mlx, paged=used, paged_data=data,
                          ideal=exact_bytes(g, prefix + n * own), pages=pages))
    return out


def raw(g: Geometry, prefix: int, cases: dict[str, tuple[int, list[Result]]]) -> dict:
    """The run's raw result: the geometry, and per case its own tokens and every row in bytes."""
    geometry = {"layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
                "page_size": g.page_size, "dtype": _dt(g), "bytes_per_token": g.bytes_per_token,
                "page_bytes": g.page_bytes}
    return {"geometry": geometry, "prefix": prefix,
            **{name: {"own": own, "rows": [asdict(r) for r in rows]}
               for name, (own, rows) in cases.items()}}


def table(results: Sequence[Result], label: str) -> str:
    lines = [f"| {label} | tokens held | no sharing MB | mlx-lm copies MB | paged pool MB "
             "| paged data MB | ideal MB | pages | paged / mlx-lm | paged / no sharing |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.n} | {r.tokens:,} | {r.exact / MB:.1f} | {r.mlx_lm / MB:.1f} | "
                     f"{r.paged / MB:.1f} | {r.paged_data / MB:.1f} | {r.ideal / MB:.1f} | "
                     f"{r.pages} | {r.paged / r.mlx_lm:.3f} | {r.paged / r.exact:.3f} |")
    return "\n".join(lines) + "\n"


def plot(cases: dict[str, tuple[str, list[Result]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.2))
    for ax, (name, (xlabel, rs)) in zip(np.atleast_1d(axes), cases.items()):
        x = [r.n for r in rs]
        for attr, label, style in (("mlx_lm", "mlx-lm KVCache copies", "o-"),
                                   ("exact", "no sharing (exact)", "s--"),
                                   ("paged", "paged pool (used)", "^-"),
                                   ("ideal", "ideal (prefix once)", "k:")):
            ax.plot(x, [getattr(r, attr) / MB for r in rs], style, label=label, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("resident KV (MB)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller prefix and fewer conversations")
    ap.add_argument("--plot", type=Path, help="default: benchmarks/results/memory/<run's UTC "
                    "time>.png (none with --quick)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    mx.random.seed(0)
    g = Geometry()
    if a.quick:
        prefix, own, branch, ns, bs = 500, 100, 128, (1, 2, 4), (1, 2)
    else:
        prefix, own, branch, ns, bs = 2000, 100, 128, (1, 2, 4, 8, 16), (1, 2, 4, 8)
    shared = run(g, prefix, own, ns, decode=False)
    branches = run(g, prefix, branch, bs, decode=True)
    cmd = " ".join([".venv/bin/python -m benchmarks.memory",
                    *(sys.argv[1:] if argv is None else argv)])
    text = (
        f"Command: `{cmd}` ({time.perf_counter() - t0:.0f} s). Geometry: {g.layers} layers, "
        f"{g.kv_heads} KV heads, head_dim {g.head_dim}, {_dt(g)}, pages of {g.page_size} tokens: "
        f"{g.bytes_per_token:,} B per token, {g.page_bytes:,} B per page. MB = 10^6 bytes.\n\n"
        f"N conversations sharing a {prefix:,}-token prefix, {own} own tokens each:\n\n"
        + table(shared, "N")
        + f"\nn-way branching after {prefix:,} tokens, {branch} decoded tokens per branch:\n\n"
        + table(branches, "n")
    )
    print(text)
    if not a.quick:
        record.write("memory", json.dumps(raw(g, prefix, {"shared_prefix": (own, shared),
                                                          "branching": (branch, branches)}),
                                          indent=1) + "\n")
    cases = {"shared prefix": ("conversations N", shared), "branching": ("branches n", branches)}
    title = (f"Resident KV bytes, {prefix:,}-token prefix ({g.layers} layers, {g.kv_heads} KV "
             f"heads, dim {g.head_dim}, {_dt(g)}, page {g.page_size})")
    record.write_study("memory", text, lambda path: plot(cases, path, title), a.quick, a.plot)
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
