"""Attention that reads a shared prefix once: the one place that hooks mlx-lm's attention.

Sequences whose contexts start with the same sealed pages share one ``PrefixView``: the keys and
values of those pages, one contiguous copy per layer for everyone (``PrefixViews`` owns them, in
``kv_cache.model.views``; each view holds its pages in the pool, so block ids stay meaningful
while it lives). A running sequence's layers keep only their *own* positions (after the view) in
working buffers. Attention for a group of sequences on one view is computed as

    scores over the prefix, for every query of the group at once   (one GEMM per layer)
    scores over each sequence's own positions (padded, masked)     (one batched GEMM, or one
                                                                    per sequence: NOTE)
    one row max across both, exp once, sums, and the two weighted sums of values

which is ordinary softmax attention split in two and merged by its log-sum-exp (the shared max
and the two sums), so no sequence needs a contiguous copy of the shared prefix. One sequence
alone on a view with a long prompt piece is the exception where it pays (``_copy_pays``: the
CPU backend in float32): its layer copies the view's keys and values once before its own and
runs mlx-lm's function over them, which computes bit for bit what a sequence holding its whole
context in its own buffers does.

NOTE: the fused kernel returns no log-sum-exp, so the split path is plain MLX ops; a sequence
alone with no view goes through mlx-lm's function (the fused kernel). Own keys of
``OWN_KEYS_APART`` positions or more (sequences that read no view, or read long past it: eight
clients each on its own file) are never padded into one batch array, which copied every
sequence's keys and values once a layer and step (on the CPU half of a step of eight
2,000-token sequences): each sequence's products run on its own buffers, and on the CPU a row
that reads no view takes its softmax alone over its real queries (a verify pass pads drafts to
the longest; the padding is skipped). Measured on the CPU only (an earlier run of
benchmarks/pass_width.py, in docs/BENCHMARKS.md's git history); on a GPU a row alone is a dozen
more kernel launches a layer, so there only the products go apart.

A model may pass a ``masks.Bidirectional`` as the ``mask`` of a prompt piece whose runs of
tokens attend to each other both ways (Gemma 3's images): each layer then makes its own mask
from what it reads (causal, within its window, or in the same run) over its own keys; a shared
prefix is all before the piece, so every query reads it whole. A cache not ours cannot honour it
(``TypeError``).

``install(model)`` points every model module that imported mlx-lm's
``scaled_dot_product_attention`` at ``attention()`` below; calls whose cache is not one of ours
go to mlx-lm's function untouched. The language models of mlx-vlm (vision-language models)
import mlx-vlm's function instead, which is mlx-lm's plus mlx-vlm's own TurboQuant caches: their
modules are pointed at ``attention()`` too (NOTE: a call with a TurboQuant cache would then reach
mlx-lm's function, which does not know it; a server never makes one).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models import base as mlx_base

from kv_cache.model import prefix_part
from kv_cache.model.masks import Bidirectional, build_mask as _build_mask, ragged_index
from kv_cache.model.prefix_part import prefix_length
from kv_cache.model.reads import Reads, pad

_ORIGINAL = mlx_base.scaled_dot_product_attention
OWN_KEYS_APART = 256  # own keys from this many on: each row's products apart (docstring: NOTE)


# -- attention ----------------------------------------------------------------------------------


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` with our caches: a batch of sequences, or one
    sequence with a shared prefix, takes the split path; everything else is mlx-lm's."""
    owner = cache if getattr(cache, "reads", None) is not None else None
    if owner is None:
        # a layer that reuses another layer's keys (KV sharing): found by the keys themselves
        p = _PASS.get()
        entry = p.fetched.get(id(keys)) if p is not None else None
        owner = entry[1] if entry is not None and entry[0] is keys else None
    if owner is None:
        if isinstance(mask, Bidirectional):
            raise TypeError("a Bidirectional mask needs the paged caches (kv_cache.model.masks)")
        return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    rs = owner.reads()
    ragged = getattr(owner, "ragged", None)
    if ragged is not None:
        return _ragged(queries, rs, ragged, scale, sinks)
    if isinstance(mask, Bidirectional):  # runs of the piece that attend both ways
        rs = [replace(r, blocks=tuple((r.q_start + a, r.q_start + b) for a, b in mask.blocks))
              for r in (rs or [owner.read()])]
        if rs[0].prefix is None and len(rs) == 1:  # the layer's own mask, with the runs in it
            N = keys.shape[2]
            own = _build_mask(rs, [N], queries.shape[2], N)[:, 0].astype(queries.dtype)
            return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=own,
                             sinks=sinks)
        return split_attention(queries, rs, scale, sinks)
    if rs is None:  # one sequence, nothing shared: the model's mask over its keys
        return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if len(rs) == 1 and _copy_pays(queries, rs[0], mask):
        # one sequence reading a view: its keys and values after the view's, one copy
        k, v = rs[0].prefix
        k = mx.concatenate([k[None], rs[0].keys], axis=2)
        v = mx.concatenate([v[None], rs[0].values], axis=2)
        return _ORIGINAL(queries, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return split_attention(queries, rs, scale, sinks)


def _ragged(queries: mx.array, reads: list[Reads], lengths: list[int], scale: float,
            sinks: mx.array | None) -> mx.array:
    """A ragged pass (``kv_cache.model.batch.ragged_caches``): ``queries [R, heads, 1, dim]``,
    ``lengths[i]`` rows of sequence ``i`` one after the other. Each sequence's rows become its
    queries ``[1, heads, n, dim]`` (stacked to the longest, as a padded pass's: the split path
    reads each row's real queries), and its outputs go back to its rows."""
    S, T = len(lengths), max(lengths)
    _, H, _, D = queries.shape
    p, key = _PASS.get(), ("ragged", tuple(lengths))  # the same for every layer of the pass
    idx, back = p.masks[key] if p is not None and key in p.masks else ragged_index(lengths)
    if p is not None:
        p.masks[key] = idx, back
    q = queries[idx].reshape(S, T, H, D).transpose(0, 2, 1, 3)
    out = split_attention(q, reads, scale, sinks).transpose(0, 2, 1, 3).reshape(S * T, H, D)
    return out[back][:, :, None, :]


def _copy_pays(queries: mx.array, r: Reads, mask) -> bool:
    """Whether one sequence's prompt piece costs less as one sequence alone (mlx-lm's function)
    over one copy of the view's keys and values than through the split path (CPU, measured per
    layer with the fused kernel by benchmarks/split_attention.py, an earlier run in
    docs/BENCHMARKS.md's git history): in float32 once the scores outnumber the keys and values
    about 1.5 to 1 (repeats of a key's head x queries >= 3 x head_dim); in float16 and bfloat16
    and for one query the split path wins. Metal, CUDA: the split path (not measured there)."""
    _, Hq, T, D = queries.shape
    rep = Hq // r.keys.shape[1]
    return (T > 1 and isinstance(r.prefix, tuple) and r.own_start == r.prefix[0].shape[1]
            and r.q_start + T == r.own_start + r.keys.shape[2]
            and r.keys.dtype == mx.float32 and rep * T >= 3 * D and not r.copies
            and (mask is None or isinstance(mask, str)
                 or mask.shape[-1] == r.own_start + r.keys.shape[2])
            and mx.default_device().type == mx.DeviceType.cpu)


class Pass:
    """What one forward pass shares between its layers: what each cache's ``update_and_fetch``
    returned (``fetched``: id -> (the array, held, the cache)), so a layer that reuses another's
    keys (KV sharing) finds its reads; and the own-position masks, built once."""

    __slots__ = ("fetched", "masks")

    def __init__(self) -> None:
        self.fetched: dict[int, tuple[mx.array, Any]] = {}
        self.masks: dict[tuple, mx.array | None] = {}


# The pass running in this thread (or task): set by ``forward()`` only, for its duration.
_PASS: ContextVar[Pass | None] = ContextVar("kv_cache_forward_pass", default=None)


def fetched(keys: mx.array, owner: Any) -> None:
    """Record what ``owner.update_and_fetch`` returned, inside a ``forward()`` (else nothing:
    a plain mlx-lm cache's keys are never taken for ours)."""
    p = _PASS.get()
    if p is not None:
        p.fetched[id(keys)] = (keys, owner)


@contextmanager
def forward() -> Iterator[Pass]:
    """One forward pass over our caches, with its own ``Pass`` (per thread: models running on
    different threads never share one); nothing of it is kept after."""
    p = Pass()
    token = _PASS.set(p)
    try:
        yield p
    finally:
        _PASS.reset(token)


def split_attention(queries: mx.array, reads: list[Reads], scale: float,
                    sinks: mx.array | None = None) -> mx.array:
    """Attention for ``queries [B, heads, T, head_dim]``; ``reads[i]`` says what row ``i``
    reads. Rows sharing a prefix view are computed together, over their real queries only (a
    padded or ragged pass's later ones come back as zeros: nobody reads them)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reads):
        key = (id(r.view), prefix_length(r.prefix)) if r.prefix is not None else (None, 0)
        groups.setdefault(key, []).append(i)
    parts = []
    for key, rows in groups.items():  # long own keys and no prefix: each row alone (NOTE)
        alone = key[0] is None and len(rows) > 1 and _rows_alone() \
            and max(reads[i].keys.shape[2] for i in rows) >= OWN_KEYS_APART
        parts += [[i] for i in rows] if alone else [rows]
    if len(parts) == 1:
        return _rows(queries, parts[0], reads, scale, sinks)
    out: list[mx.array | None] = [None] * queries.shape[0]
    for rows in parts:
        o = _rows(queries, rows, reads, scale, sinks)
        for j, i in enumerate(rows):
            out[i] = o[j : j + 1]
    return mx.concatenate(out, axis=0)


def _rows_alone() -> bool:
    """Whether rows reading no view take their softmax one by one (module docstring: NOTE)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _rows(queries: mx.array, rows: list[int], reads: list[Reads], scale: float,
          sinks: mx.array | None) -> mx.array:
    """``rows`` of ``queries`` together over the most real queries any of them has."""
    T = queries.shape[2]
    rs = [reads[i] for i in rows]
    t = max(min(T, max(1, r.own_start + r.keys.shape[2] - r.copies - r.q_start)) for r in rs)
    q = queries if len(rows) == queries.shape[0] else queries[rows[0] : rows[0] + 1] \
        if len(rows) == 1 else queries[mx.array(rows)]
    return pad(_group(q[:, :, :t] if t < T else q, rs, scale, sinks), T)


def _own_mask(reads: list[Reads], T: int, N: int) -> mx.array | None:
    """Additive mask ``[B, 1, 1, T, N]`` over the padded own keys, or None when every key is
    visible to every query."""
    lens = [r.keys.shape[2] for r in reads]
    p = _PASS.get()
    if p is None:
        return _build_mask(reads, lens, T, N)
    key = (T, N, tuple(lens), tuple((r.own_start, r.q_start, r.window, r.block, r.float_from,
                                     r.copies, r.blocks) for r in reads))
    if key not in p.masks:
        p.masks[key] = _build_mask(reads, lens, T, N)
    return p.masks[key]


def _group(queries: mx.array, reads: list[Reads], scale: float,
           sinks: mx.array | None) -> mx.array:
    B, Hq, T, D = queries.shape
    Hkv = reads[0].keys.shape[1]
    rep = Hq // Hkv
    q = (queries * scale).reshape(B, Hkv, rep * T, D)
    N = max(r.keys.shape[2] for r in reads)
    apart = B > 1 and N >= OWN_KEYS_APART
    if apart:  # each row's own keys where they are (module docstring: NOTE)
        s_own = mx.concatenate([pad(q[i : i + 1] @ r.keys.swapaxes(-1, -2), N, -1)
                                for i, r in enumerate(reads)]).astype(mx.float32)
    else:
        if B == 1:
            ko, vo = reads[0].keys, reads[0].values
        else:
            kv = [r.padded(N) for r in reads]
            ko = mx.concatenate([k for k, _ in kv], axis=0)
            vo = mx.concatenate([v for _, v in kv], axis=0)
        s_own = (q @ ko.swapaxes(-1, -2)).astype(mx.float32)  # [B, Hkv, rep*T, N]
    mask = _own_mask(reads, T, N)
    if mask is not None:
        s_own = (s_own.reshape(B, Hkv, rep, T, N) + mask).reshape(B, Hkv, rep * T, N)
    m = s_own.max(axis=-1, keepdims=True)
    prefix = reads[0].prefix  # [Hkv, c, D], the same for every row of the group
    if prefix is not None:
        shared = prefix_part.scores(q.transpose(1, 0, 2, 3).reshape(Hkv, B * rep * T, D), prefix)
        m = mx.maximum(m, shared.maxima.reshape(Hkv, B, rep * T, 1).transpose(1, 0, 2, 3))
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1),
                               (1, Hkv, rep, T)).reshape(1, Hkv, rep * T, 1)
        m = mx.maximum(m, sink)
    e_own = mx.exp(s_own - m)
    denom = e_own.sum(axis=-1, keepdims=True)
    if apart:
        out = mx.concatenate([e_own[i : i + 1, ..., : r.keys.shape[2]].astype(r.values.dtype)
                              @ r.values for i, r in enumerate(reads)])
    else:
        out = e_own.astype(vo.dtype) @ vo  # [B, Hkv, rep*T, D]
    if prefix is not None:
        out_p, denom_p = prefix_part.weighted(
            shared, m.transpose(1, 0, 2, 3).reshape(Hkv, B * rep * T, 1))
        out = out + out_p.reshape(Hkv, B, rep * T, D).transpose(1, 0, 2, 3)
        denom = denom + denom_p.reshape(Hkv, B, rep * T, 1).transpose(1, 0, 2, 3)
    if sinks is not None:
        denom = denom + mx.exp(sink - m)
    out = out / denom.astype(out.dtype)
    return out.reshape(B, Hq, T, D).astype(queries.dtype)


# -- the hook -----------------------------------------------------------------------------------


def install(model) -> bool:
    """Route ``model``'s attention through ``attention()`` (each of its modules whose
    ``scaled_dot_product_attention`` is mlx-lm's or mlx-vlm's: module docstring); False: not
    routed (one sequence a pass)."""
    vlm = sys.modules.get("mlx_vlm.models.base")  # loaded where a vision model was built
    originals = (_ORIGINAL, getattr(vlm, "scaled_dot_product_attention", _ORIGINAL))
    names = {type(m).__module__ for _, m in model.named_modules()}
    hooked = False
    for name in names:
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if any(fn is f for f in originals):
            setattr(mod, "scaled_dot_product_attention", attention)
        hooked = hooked or fn is attention or any(fn is f for f in originals)
    return hooked
