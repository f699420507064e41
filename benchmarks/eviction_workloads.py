"""The workload of the eviction study (``benchmarks/eviction_sim.py``): which cache units a
block-sparse decode reads at every step, in either KV layout.

At every decode step, in every layer, every query head attends to the first block, the last
block and the top-k of the middle blocks by a skewed score (a drifting Zipf popularity per
(layer, KV group), a fixed preference per query head, Gumbel noise per step). ``units`` turns
the blocks selected into the units a layout reads (pages with every KV head, or (KV head, block)
units), ``trace`` into the access order a cache sees, and ``envelope`` gives the closed-form
figures of the back-of-the-envelope case the study compares with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GiB = 1 << 30
GB = 10**9
LAYOUTS = ("paged", "per-head")


@dataclass(frozen=True)
class Geometry:
    """Model and cache geometry (the back-of-the-envelope case by default)."""

    layers: int = 28
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 1024
    page_size: int = 32
    block_size: int = 512
    context: int = 4096
    dtype_bytes: int = 2  # bf16

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads (GQA groups)")
        if self.context % self.block_size or self.block_size % self.page_size:
            raise ValueError("context must be whole blocks and a block whole pages")

    @property
    def n_blocks(self) -> int:
        return self.context // self.block_size

    @property
    def n_pages(self) -> int:
        return self.context // self.page_size

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def page_bytes(self) -> int:
        """One paged unit: one layer's page, every KV head, keys and values."""
        return self.page_size * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def head_block_bytes(self) -> int:
        """One per-head unit: one layer's block of one KV head, keys and values."""
        return self.block_size * 2 * self.head_dim * self.dtype_bytes

    @property
    def context_bytes(self) -> int:
        """The whole context, every layer and KV head."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.context * self.dtype_bytes

    def unit_bytes(self, layout: str) -> int:
        return self.page_bytes if layout == "paged" else self.head_block_bytes


@dataclass(frozen=True)
class Selection:
    """How query heads choose blocks, and for how long."""

    top_k: int = 2  # middle blocks per query head, besides the first and the last
    zipf_s: float = 1.1  # with top_k=2 this gives ~2.24 GiB per step, per-head (the reported)
    head_noise: float = 0.5  # std of each query head's fixed preference (log-score units)
    temperature: float = 1.0  # scale of the per-step Gumbel noise
    drift: float = 0.05  # probability per step that two adjacent ranks swap, per (layer, group)
    steps: int = 200
    warmup: int = 25  # steps not counted in miss ratios
    seed: int = 0


# -- selection (vectorized) ---------------------------------------------------------------------


def select_blocks(g: Geometry, s: Selection) -> np.ndarray:
    """Selected blocks, boolean ``[steps, layers, q_heads, n_blocks]``."""
    rng = np.random.default_rng(s.seed)
    n, m = g.n_blocks, g.n_blocks - 2
    sel = np.zeros((s.steps, g.layers, g.q_heads, n), dtype=bool)
    sel[..., 0] = sel[..., n - 1] = True
    if m <= 0:
        return sel
    if s.top_k >= m:
        sel[..., 1 : n - 1] = True
        return sel
    # order[l, grp, r] = the middle block of popularity rank r (0 = most popular)
    order = np.argsort(rng.random((g.layers, g.kv_heads, m)), axis=-1)
    zipf = -s.zipf_s * np.log(np.arange(1, m + 1))  # log-weight by rank
    own = s.head_noise * rng.standard_normal((g.layers, g.q_heads, m))
    li, gi = np.indices((g.layers, g.kv_heads))
    grp_of_head = np.arange(g.q_heads) // g.group
    for t in range(s.steps):
        # drift: swap ranks r and r+1 in some (layer, group) rankings
        swap = rng.random((g.layers, g.kv_heads)) < s.drift
        r = rng.integers(0, m - 1, (g.layers, g.kv_heads))
        a, b = order[li, gi, r], order[li, gi, r + 1]
        order[li, gi, r] = np.where(swap, b, a)
        order[li, gi, r + 1] = np.where(swap, a, b)
        logw = np.empty((g.layers, g.kv_heads, m))
        np.put_along_axis(logw, order, np.broadcast_to(zipf, order.shape), axis=-1)
        gumbel = -np.log(-np.log(rng.random((g.layers, g.q_heads, m))))
        score = logw[:, grp_of_head, :] + own + s.temperature * gumbel
        top = np.argpartition(-score, s.top_k - 1, axis=-1)[..., : s.top_k]
        np.put_along_axis(sel[t, :, :, 1 : n - 1], top, True, axis=-1)
    return sel


def units(sel: np.ndarray, g: Geometry, layout: str) -> np.ndarray:
    """The units read per step: ``[steps, layers, n_pages]`` (paged) or
    ``[steps, layers, kv_heads, n_blocks]`` (per-head), boolean."""
    T, L, H, n = sel.shape
    if layout == "paged":
        return np.repeat(sel.any(axis=2), g.block_size // g.page_size, axis=-1)
    if layout == "per-head":
        return sel.reshape(T, L, g.kv_heads, g.group, n).any(axis=3)
    raise ValueError(f"unknown layout {layout!r}")


def trace(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit keys in access order (step, then layer, KV head, position) and each access's step."""
    idx = np.nonzero(u)
    step = idx[0]
    key = np.ravel_multi_index(idx[1:], u.shape[1:])
    return key.astype(np.int64), step.astype(np.int64)


def bytes_per_step(u: np.ndarray, unit_bytes: int) -> np.ndarray:
    return u.reshape(u.shape[0], -1).sum(axis=1).astype(np.int64) * unit_bytes


# -- the back of the envelope -------------------------------------------------------------------


def envelope(g: Geometry) -> dict[str, float]:
    """The closed-form figures: whole context; per-head bytes if each query head picks each block
    independently with probability p = 0.4 (union over a GQA pair: 1 - 0.6**2 = 0.64)."""
    p = 0.4
    union = 1 - (1 - p) ** g.group
    return {
        "context_bytes": g.context_bytes,
        "context_GiB": g.context_bytes / GiB,
        "context_GB": g.context_bytes / GB,
        "p_select": p,
        "union_fraction": union,
        "per_head_bytes": union * g.context_bytes,
        "per_head_GiB": union * g.context_bytes / GiB,
    }
