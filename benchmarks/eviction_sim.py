"""Block-sparse attention study: bytes read per decode step and cache miss ratios, two KV layouts.

Decoding with MoBA-style block selection: at every decode step, in every layer, every query head
attends to a few KV blocks of ``block_size`` tokens: the first block, the current (last) block,
and the top-k of the others by a skewed score. Two layouts of the KV in memory:

  paged     units of ``[page_size, 2, num_kv_heads, head_dim]`` per layer: a block that any query
            head selects needs all its pages, with every KV head, for that layer;
  per-head  units of ``[block_size, 2, head_dim]`` per (layer, KV head): only the (layer, KV head,
            block) units that the query heads of that KV group select are read.

The score: per (layer, KV group) a Zipf popularity over the middle blocks (weight 1/rank**s), the
ranking drifting slowly (an adjacent pair of ranks swaps with probability ``drift`` per step);
each query head adds a fixed preference of its own (Gaussian, ``head_noise``), and each step adds
Gumbel noise, so top-k samples k blocks without replacement with probability ~ weight
(Gumbel-top-k). Query heads of one KV group share the group's popularity (GQA: they read the
same KV heads, and attention mass in long contexts concentrates on a few recurring blocks).

The cache: units keyed by int ids, capacity = cache bytes // unit bytes, the policy classes of
``kv_cache.pages.eviction`` (``make_policy``): a hit calls ``policy.access``, a miss evicts with
``policy.victim(lambda k: True)`` until there is room, then ``policy.insert``. Two references that
are not policies of ``kv_cache``: ``s3fifo-paper`` (S3-FIFO with the ghost queue sized to the
main queue's capacity, as in the paper) and ``opt`` (Belady's optimum, with bypass).

A run writes its tables and plot to benchmarks/results/eviction_sim/<run's UTC time>.md and .png
(a --quick run neither, unless --plot names a file).

Usage: .venv/bin/python -m benchmarks.eviction_sim [--quick] [--steps 200] [--plot FILE]
       [--doc docs/EVICTION_STUDY.md]  (rewrites the section between the results markers)
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Hashable, Sequence

import numpy as np

from benchmarks import record
from benchmarks.eviction_workloads import (
    GB, LAYOUTS, Geometry, GiB, Selection, bytes_per_step, envelope, select_blocks, trace, units)
from kv_cache.pages.eviction import EvictionPolicy, S3FIFOPolicy, make_policy

POLICIES = ("lru", "fifo", "s3fifo", "s3fifo-paper", "opt")


# -- cache simulation ---------------------------------------------------------------------------


def policy_for(name: str, capacity: int) -> EvictionPolicy:
    if name == "s3fifo-paper":  # the capacity given, as the paper sizes the ghost queue
        return S3FIFOPolicy(capacity=capacity)
    return make_policy(name)


def _always(_: Hashable) -> bool:
    return True


def simulate(keys: Sequence[int], capacity: int, policy: str,
             count_from: int = 0) -> tuple[int, int]:
    """Run ``keys`` through a cache of ``capacity`` units; returns (accesses, misses) counted
    from access index ``count_from`` on."""
    if policy == "opt":
        return belady(keys, capacity, count_from)
    keys = np.asarray(keys).tolist()
    if capacity <= 0:
        return len(keys) - count_from, len(keys) - count_from
    p = policy_for(policy, capacity)
    resident: set[int] = set()
    misses = 0
    for i, k in enumerate(keys):
        if k in resident:
            p.access(k)
            continue
        if i >= count_from:
            misses += 1
        while len(resident) >= capacity:
            v = p.victim(_always)
            assert v is not None, "a full cache found no victim"
            resident.remove(v)
        p.insert(k, ident=k)
        resident.add(k)
    return len(keys) - count_from, misses


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each access, the index of the next access to the same key (len(keys) if none)."""
    n = len(keys)
    order = np.lexsort((np.arange(n), keys))
    nxt = np.full(n, n, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady(keys: Sequence[int], capacity: int, count_from: int = 0) -> tuple[int, int]:
    """Belady's optimum (evict the unit used furthest in the future; bypass when the new unit is
    the furthest)."""
    keys = np.asarray(keys, dtype=np.int64)
    n = len(keys)
    if capacity <= 0:
        return n - count_from, n - count_from
    nxt = next_use(keys).tolist()
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    misses = 0
    for i, k in enumerate(keys.tolist()):
        if k in resident:
            resident[k] = nxt[i]
            heapq.heappush(heap, (-nxt[i], k))
            continue
        if i >= count_from:
            misses += 1
        if len(resident) >= capacity:
            while True:
                far, v = heap[0]
                if resident.get(v) == -far:
                    break
                heapq.heappop(heap)
            if -far <= nxt[i]:
                continue  # bypass: the new unit is needed last
            heapq.heappop(heap)
            del resident[v]
        resident[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return n - count_from, misses


# -- the study ----------------------------------------------------------------------------------


@dataclass
class Row:
    layout: str
    cache_gib: float
    capacity: int
    policy: str
    accesses: int
    misses: int
    seconds: float

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0


def run_study(g: Geometry, s: Selection, cache_gib: Sequence[float], policies: Sequence[str],
              log: Callable[[str], None] = print) -> tuple[dict, list[Row]]:
    sel = select_blocks(g, s)
    reads: dict[str, dict] = {}
    rows: list[Row] = []
    for layout in LAYOUTS:
        u = units(sel, g, layout)
        ub = g.unit_bytes(layout)
        b = bytes_per_step(u, ub)
        keys, step = trace(u)
        count_from = int(np.searchsorted(step, s.warmup))
        reads[layout] = {"unit_bytes": ub, "units_total": int(np.prod(u.shape[1:])),
                         "mean": float(b.mean()), "min": int(b.min()), "max": int(b.max()),
                         "accesses_per_step": float(len(keys) / s.steps)}
        log(f"{layout}: {ub} B/unit, {len(keys) / s.steps:.0f} accesses/step, "
            f"{b.mean() / GiB:.3f} GiB/step (min {b.min() / GiB:.3f}, max {b.max() / GiB:.3f})")
        for gib in cache_gib:
            cap = int(gib * GiB) // ub
            for pol in policies:
                t0 = time.perf_counter()
                acc, miss = simulate(keys, cap, pol, count_from)
                rows.append(Row(layout, gib, cap, pol, acc, miss, time.perf_counter() - t0))
                log(f"  {gib:5.2f} GiB ({cap:5d} units) {pol:12s} miss {miss / acc:6.1%} "
                    f"({rows[-1].seconds:.1f} s)")
    return reads, rows


def calibration(g: Geometry, s: Selection, top_ks: Sequence[int] = (1, 2, 3, 4),
                zipfs: Sequence[float] = (0.0, 1.1, 2.0)) -> list[tuple[int, float, float, float]]:
    """Mean GiB read per step (per-head, paged) against top_k and the Zipf exponent."""
    out = []
    short = replace(s, steps=min(s.steps, 40))
    for k in top_ks:
        for z in zipfs:
            sel = select_blocks(g, replace(short, top_k=k, zipf_s=z))
            ph = bytes_per_step(units(sel, g, "per-head"), g.head_block_bytes).mean() / GiB
            pg = bytes_per_step(units(sel, g, "paged"), g.page_bytes).mean() / GiB
            out.append((k, z, float(ph), float(pg)))
    return out


def markdown(g: Geometry, s: Selection, reads: dict, rows: list[Row],
             calib: list[tuple[int, float, float, float]], cmd: str, seconds: float) -> str:
    env = envelope(g)
    lines = [
        f"Command: `{cmd}` ({seconds:.0f} s on this machine).",
        "",
        f"Geometry: `{asdict(g)}`",
        f"Selection: `{asdict(s)}`",
        "",
        "Bytes read per decode step (one generated token, all layers):",
        "",
        "| layout | unit | unit bytes | units in context | accesses/step | mean GiB | min GiB "
        "| max GiB | mean GB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in LAYOUTS:
        r = reads[layout]
        unit = "(layer, page) all KV heads" if layout == "paged" else "(layer, KV head, block)"
        lines.append(f"| {layout} | {unit} | {r['unit_bytes']:,} | {r['units_total']:,} | "
                     f"{r['accesses_per_step']:.0f} | {r['mean'] / GiB:.3f} | "
                     f"{r['min'] / GiB:.3f} | {r['max'] / GiB:.3f} | {r['mean'] / GB:.3f} |")
    lines += ["", f"Whole context: {env['context_bytes']:,} B = {env['context_GiB']:.3f} GiB = "
              f"{env['context_GB']:.3f} GB.", "",
              "Miss ratio after warm-up (misses / unit accesses; units are equal-sized within a "
              "layout, so this is also the byte miss ratio):", ""]
    pols = list(dict.fromkeys(r.policy for r in rows))
    sizes = list(dict.fromkeys(r.cache_gib for r in rows))
    lines.append("| layout | cache GiB | units | " + " | ".join(pols) + " |")
    lines.append("|---|---:|---:|" + "---:|" * len(pols))
    for layout in LAYOUTS:
        for gib in sizes:
            rs = {r.policy: r for r in rows if r.layout == layout and r.cache_gib == gib}
            cap = next(iter(rs.values())).capacity
            lines.append(f"| {layout} | {gib:g} | {cap} | "
                         + " | ".join(f"{rs[p].miss_ratio:.1%}" for p in pols) + " |")
    lines += ["", "Bytes fetched per decode step on a miss (GiB; miss ratio x bytes read):", "",
              "| layout | cache GiB | " + " | ".join(pols) + " |",
              "|---|---:|" + "---:|" * len(pols)]
    for layout in LAYOUTS:
        for gib in sizes:
            rs = {r.policy: r for r in rows if r.layout == layout and r.cache_gib == gib}
            lines.append(f"| {layout} | {gib:g} | " + " | ".join(
                f"{rs[p].miss_ratio * reads[layout]['mean'] / GiB:.2f}" for p in pols) + " |")
    lines += ["", "Calibration (mean GiB read per step over 40 steps, first + last + top_k):", "",
              "| top_k | zipf s | per-head GiB | paged GiB |", "|---:|---:|---:|---:|"]
    lines += [f"| {k} | {z:g} | {ph:.3f} | {pg:.3f} |" for k, z, ph, pg in calib]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], reads: dict, path: Path, title: str) -> None:
    """Miss ratio against cache size: one line per policy and layout (a panel per layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    look = {"lru": ("C0", "o", 7), "fifo": ("C1", "s", 5), "s3fifo": ("C2", "^", 4),
            "s3fifo-paper": ("C3", "v", 4), "opt": ("k", ".", 4)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    for ax, layout in zip(axes, LAYOUTS):
        for pol in dict.fromkeys(r.policy for r in rows):
            rs = [r for r in rows if r.layout == layout and r.policy == pol]
            color, marker, ms = look.get(pol, (None, "o", 4))
            ax.plot([r.cache_gib for r in rs], [100 * r.miss_ratio for r in rs], "-",
                    color=color, marker=marker, ms=ms, mfc="none" if ms > 5 else color,
                    label=f"{pol} ({layout})" + (" *" if pol in ("s3fifo-paper", "opt") else ""))
        mean = reads[layout]["mean"] / GiB
        ax.axvline(mean, color="grey", ls="--", lw=0.8)
        ax.text(mean, 50, f" read/step {mean:.2f} GiB", color="grey", fontsize=8, rotation=90,
                va="center", ha="right")
        ax.set_title(f"{layout} layout: {reads[layout]['unit_bytes'] >> 20} MiB units",
                     fontsize=10)
        ax.set_xlabel("cache size (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="* reference, not in kv_cache", title_fontsize=7)
    axes[0].set_ylabel("miss ratio after warm-up (%)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small settings, a few seconds")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--top-k", type=int, default=Selection.top_k)
    ap.add_argument("--zipf", type=float, default=Selection.zipf_s)
    ap.add_argument("--drift", type=float, default=Selection.drift)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-gib", type=float, nargs="+")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--plot", type=Path, help="default: benchmarks/results/eviction_sim/<run's "
                    "UTC time>.png (none with --quick)")
    ap.add_argument("--doc", type=Path, help="markdown file whose results section to rewrite")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    g = Geometry()
    if a.quick:
        s = Selection(steps=a.steps or 40, warmup=8)
        sizes = a.cache_gib or [1.0, 2.0, 3.0, 4.0]
    else:
        s = Selection(steps=a.steps or 200)
        sizes = a.cache_gib or [0.5, 1.0, 1.5, 2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 4.0]
    s = replace(s, top_k=a.top_k, zipf_s=a.zipf, drift=a.drift, seed=a.seed)
    env = envelope(g)
    print(f"whole context: {env['context_bytes']:,} B = {env['context_GiB']:.3f} GiB; "
          f"independent p={env['p_select']}: per-head {env['per_head_GiB']:.3f} GiB")
    reads, rows = run_study(g, s, sizes, a.policies)
    calib = calibration(g, s)
    cmd = ".venv/bin/python -m benchmarks.eviction_sim" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    text = markdown(g, s, reads, rows, calib, cmd.strip(), time.perf_counter() - t0)
    print(text)
    title = (f"Block-sparse decode, {g.layers} layers, {g.q_heads}q/{g.kv_heads}kv heads, dim "
             f"{g.head_dim}, ctx {g.context}, top-{s.top_k}, {s.steps} steps")
    record.write_study("eviction_sim", text, lambda path: plot(rows, reads, path, title),
                       a.quick, a.plot, a.doc)
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
