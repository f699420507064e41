"""KIVI-style keys, SIMULATED for ``benchmarks/kv_quality.py``: the reference that the page format
of keys per channel over a page (``kv_cache.layout.channel_keys``, ``kv_cache.model.channel_cache``)
was built from and is tested against (``tests/kv_cache/model/test_channel_cache.py``).

KIVI (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache")
quantizes keys **per channel along tokens** and values per token along ``head_dim``. Here:

- keys: ``bits``-bit affine codes per (layer, kv head, channel) over blocks of ``block``
  consecutive absolute positions, page-aligned (0..block-1, block..2*block-1, ...): each channel
  of each head gets its own scale and bias per block (``kivi_round_trip``), a float16 bias
  rounded down and a float16 scale rounded up so that the block's range is covered (no clipping:
  every key is within ``scale / 2`` of its decoded value);
- values: the server's own page codec (``KVQuant``: rotation, groups of 64 along
  ``head_dim``), as ``--kv-bits 4`` holds them;
- the most recent, incomplete block stays in full precision (a page is coded only when it is
  sealed, so a partial page is float).

What the model reads (``KiviCache``): a query at position ``t`` reads the **decoded** keys of
every block that was complete before ``t``'s own block began, and the **float** keys of its own
block up to ``t`` (the block is still open when ``t`` is produced). That is exactly what a
token-by-token decode through a paged cache coded this way would read, for every position, so
the figures do not depend on how a text is cut into prompt pieces; each block is quantized once,
when it is complete, from its float keys, and its decoded keys are kept and reused
(``KiviCache.sealed``). It is done with one attention call per layer: the keys passed on are
``[decoded keys of the blocks before the piece's first block; float keys from that block's start
to the end]`` with a boolean mask (``make_mask``) that gives each query its own view.

The control ``per_channel=False``: the same cache with each sealed block's keys coded per
position by the page codec instead (``KVQuant(bits)``: rotation, groups of 64 along
``head_dim``), the open block float as well: what the float tail alone gives.

An mlx-lm cache, not the pages: it keeps every key in float beside the decoded blocks, and is
not restorable; the pages hold the codes only, and a reuse starts at a page boundary.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kv_cache.layout.quant import KVQuant
from kv_cache.layout.channel_keys import quantize


def kivi_round_trip(x: mx.array, block: int, bits: int = 4
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Keys ``[..., n, head_dim]`` (``n`` a multiple of ``block``) quantized per channel over
    each block of ``block`` consecutive positions: (decoded keys ``[..., n, head_dim]`` in
    ``x.dtype``, scales and biases ``[..., n // block, 1, head_dim]`` in float32, each a float16
    value). ``|x - decoded| <= scale / 2`` (up to float32 rounding of the decode)."""
    *lead, n, d = x.shape
    if n % block:
        raise ValueError(f"{n} positions are not a whole number of blocks of {block}")
    y = x.astype(mx.float32).reshape(*lead, n // block, block, d)
    codes, scale, bias = quantize(y, bits, mx.float16)  # the page codec's own (channel_keys)
    read = (codes * scale + bias).reshape(x.shape).astype(x.dtype)
    return read, scale, bias


class KiviCache(KVCache):
    """An mlx-lm ``KVCache`` whose attention reads KIVI-coded keys (see the module's note):
    float keys and page-coded values are kept as usual; ``sealed`` holds the decoded keys of the
    complete blocks, each coded once."""

    def __init__(self, block: int = 32, bits: int = 4, values: KVQuant | None = None,
                 per_channel: bool = True, open_values: bool = False):
        """``open_values``: values too are read as float in their own block (coded when the
        block is complete), as the pages hold them; else coded as they arrive."""
        super().__init__()
        # NOTE: not `bits`: mlx-lm reads a cache with `bits` as its own quantized cache
        self.block, self.key_bits, self.value_codec = block, bits, values
        self.per_token = None if per_channel else KVQuant(bits)
        self.sealed: mx.array | None = None  # decoded keys of positions [0, n_sealed)
        self.open_values = open_values
        self.sealed_v: mx.array | None = None  # with open_values: decoded values, the same
        self.n_sealed = 0

    def _start(self, t: int) -> int:
        return t // self.block * self.block

    def make_mask(self, n: int, return_array: bool = False, window_size=None, **_) -> mx.array:
        """``[n, width]`` bool: which of the keys ``update_and_fetch`` passes on each of the
        ``n`` new queries (positions ``offset .. offset + n - 1``) reads."""
        if window_size is not None:
            raise ValueError("KIVI simulation: no sliding windows")
        p0, end = self.offset, self.offset + n
        lo = self._start(p0)  # the first query's own block: float from here
        quantized = self._start(end - 1)  # the last query's block: decoded keys before it
        t = mx.arange(p0, end)[:, None]
        own = (t // self.block) * self.block
        jq = mx.arange(quantized)[None]
        jf = mx.arange(lo, end)[None]
        return mx.concatenate([jq < own, (jf >= own) & (jf <= t)], axis=1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        p0 = self.offset
        if self.value_codec is not None and not self.open_values:
            values = self.value_codec.round_trip(values)
        k, v = super().update_and_fetch(keys, values)
        end = self.offset
        complete = end // self.block * self.block
        if complete > self.n_sealed:  # code each newly complete block once, from float keys
            new = k[..., self.n_sealed:complete, :]
            read = (self.per_token.round_trip(new) if self.per_token is not None
                    else kivi_round_trip(new, self.block, self.key_bits)[0])
            self.sealed = read if self.sealed is None else mx.concatenate(
                [self.sealed, read], axis=2)
            if self.open_values:
                nv = v[..., self.n_sealed:complete, :]
                nv = self.value_codec.round_trip(nv) if self.value_codec is not None else nv
                self.sealed_v = nv if self.sealed_v is None else mx.concatenate(
                    [self.sealed_v, nv], axis=2)
            self.n_sealed = complete
        lo, quantized = self._start(p0), self._start(end - 1)
        kq = self.sealed[..., :quantized, :] if quantized else k[..., :0, :]
        vq = v[..., :quantized, :]
        if self.open_values:
            vq = self.sealed_v[..., :quantized, :] if quantized else v[..., :0, :]
        return (mx.concatenate([kq, k[..., lo:end, :]], axis=2),
                mx.concatenate([vq, v[..., lo:end, :]], axis=2))

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.sealed

    @state.setter
    def state(self, v):
        raise NotImplementedError("KIVI simulation cache: not restorable")


class KiviSim:
    """A ``benchmarks.kv_quality`` setting (a SIMULATION, not usable for pages): keys per channel
    over blocks of ``block`` positions at ``bits``, values through the page codec ``values``
    (None: float)."""

    simulated = True

    def __init__(self, block: int = 32, bits: int = 4, values: KVQuant | None = None,
                 per_channel: bool = True, open_values: bool = False):
        self.block, self.bits, self.values = block, bits, values
        self.per_channel, self.open_values = per_channel, open_values

    def make_cache(self) -> KiviCache:
        return KiviCache(self.block, self.bits, self.values, self.per_channel, self.open_values)

    def kv_bytes(self, head_dim: int) -> float:
        """Bytes of one position of one head, key and value, once the block is sealed: codes,
        a float16 scale and bias per channel a block; the values' page bytes."""
        k = head_dim * self.bits / 8 + (head_dim * 4 / self.block if self.per_channel
                                        else KVQuant(self.bits).kv_bytes(head_dim, mx.float32)
                                        / 2 - head_dim * self.bits / 8)
        v = (self.values.side_words(self.values.value_bits, head_dim, mx.float32) * 4
             if self.values is not None else head_dim * 4)
        return k + v

    def label(self) -> str:
        vals = "float" if self.values is None else self.values.label()
        if not self.per_channel:
            return (f"SIMULATED control: keys as --kv-bits {self.bits} per position, the open "
                    f"block of {self.block} float, values as --kv-bits {vals}")
        return (f"SIMULATED KIVI keys {self.bits} bits per channel over blocks of {self.block} "
                f"(trailing block float), values as --kv-bits {vals}")
