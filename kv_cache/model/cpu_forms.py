"""Attention's products and ``exp`` in the forms MLX's CPU backend on x86 runs fastest: its BLAS
there is OpenBLAS, and it has no SIMD type for x86, so its transcendental functions run one
element at a time. Everywhere else (Metal, CUDA, Arm's CPU) each function is the plain op.

- ``exp``: ``2 ** (x * log2(e))`` (``power``, ~8 ns an element) where MLX's ``exp`` takes ~28,
  with the same error (both scale by log2(e) first: up to 31 units in the last place over
  [-40, 0] against float64, mean 5.6, for both); attention's ``exp`` is a large part of a wide
  pass there.
- ``exp`` of a prefix's scores kept keys first, from ``POLY_KEYS`` keys (``poly_exp``): ``2 ** (x
  * log2(e))`` with the power of two split in two, ``2 ** n`` written into the float's exponent
  bits and ``2 ** f`` (``-1 < f <= 0``) a polynomial of degree 5 (relative error under 2.7e-7;
  the whole the same error as ``power``'s and MLX's ``exp``'s, which scaling by log2(e) sets),
  all in elementwise ops (~4 ns an element in all against ``power``'s ~8 here). Only there:
  its ~15 ops cost more than they save on a few thousand elements, and keep two more arrays of
  the scores' size alive (a prompt's scores are large); chosen by the keys alone, so a plain
  step and a verify pass at one context take the same ``exp``. Its ops and the difference
  before them are compiled (``poly_exp_of_difference``): MLX fuses them into three kernels
  built once a machine with its C++ compiler (``warm``, at ``attention.install``), the same
  values bit for bit as the ops one by one, which is what runs where there is no compiler.
- A few query rows against a shared prefix's thousands of keys (``keys_first``): the scores
  computed as ``keys @ q^T`` and kept that way round, keys first (OpenBLAS's kernel for ``q @
  keys^T``, a few rows against a transposed matrix of thousands, runs at a quarter of the
  memory's speed), the softmax taken down the keys, and the weighted sum of values as a sum over
  pieces of keys small enough for OpenBLAS's small-matrix kernel (``rows x keys x head_dim <=
  SMALL_GEMM``), which a verify pass's 6-12 rows a head leave; one product where it fits, or
  where pieces would be short.

Measured in whole passes of the default model, eight sequences each reading its own ~3,700-position
prefix view (the next turns of eight agents), the forms on and off taking turns in one process
(``scripts/bench_cpu_forms.py``, docs/BENCHMARKS.md section 17): a plain step 419 -> 353 ms, passes
two, three and four tokens wide 646 -> 504, 793 -> 691, 958 -> 812. Sequences that hold their whole
context (resident ones, no view) take the same forms over their own keys before their queries
(``attention.OWN_PREFIX_FROM``; ``--toggle own``): their passes two, three and four wide
~550/670/780 -> ~370/485/530 ms, a view's figures; behind a shared view as well
(``--shared-head``), and only where that pays (not for short contexts). ``poly_exp`` then
(``--toggle exp``, MLX's limits as the server sets them): passes three and four wide 672 -> 614 and
802 -> 758 ms, a plain step the same within the spread. Fused (``--toggle fused``): passes two,
three and four wide 501 -> 435, 647 -> 538, 710 -> 585 ms, a plain step 361 -> 353.
"""

from __future__ import annotations

import logging
import math
import platform
import threading
from typing import Callable

import mlx.core as mx

log = logging.getLogger("kv_cache.model")

_LOG2E = math.log2(math.e)
X86 = platform.machine().lower() in ("x86_64", "amd64")
SCORES_ROWS = 48  # query rows a head up to which the scores are kept keys first
SMALL_GEMM = 1_000_000  # OpenBLAS's small-matrix kernel on x86: m * n * k at most this
PIECE_MIN = 1024  # the weighted sum is never cut into pieces of fewer keys than this
PRODUCTS = True  # the prefix's products keys first (scripts/bench_cpu_forms.py: off and on)
POLY_EXP = True  # poly_exp where it is used (bench_cpu_forms.py --toggle exp: off and on)
POLY_KEYS = 2048  # a prefix of this many keys or more takes poly_exp
FUSED = True  # poly_exp of a prefix's differences compiled (bench_cpu_forms.py --toggle fused)
# 2 ** f on (-1, 0]: 1 exactly at 0, then a least-maximum-relative-error fit (float32)
_EXP2 = (0.0009449036442674696, 0.00920579768717289, 0.0552973598241806, 0.2401801496744156,
         0.6931437253952026)


def on_x86_cpu() -> bool:
    """Whether arrays are computed by MLX's CPU backend on x86 (where these forms pay)."""
    return X86 and mx.default_device().type == mx.DeviceType.cpu


def exp(x: mx.array) -> mx.array:
    """``exp(x)``; on the CPU on x86 as ``2 ** (x * log2(e))`` (module docstring)."""
    if on_x86_cpu():
        return mx.power(2.0, x * _LOG2E)
    return mx.exp(x)


def poly_exp(x: mx.array) -> mx.array:
    """``exp(x)`` for ``x <= 0`` (a softmax's differences; -inf gives 0, NaN stays NaN) without
    a transcendental op, for float32 on the CPU on x86 (module docstring); else ``exp``."""
    if x.dtype != mx.float32 or not on_x86_cpu():
        return exp(x)
    y = mx.maximum(x * _LOG2E, -127.0)  # -127: 0 exactly (the exponent bits all 0)
    n = y.astype(mx.int32)  # toward 0: y = n + f, -1 < f <= 0
    f = y - n.astype(mx.float32)
    p = _EXP2[0] * f + _EXP2[1]
    for c in _EXP2[2:]:
        p = p * f + c
    p = p * f + 1.0
    return mx.view(mx.view(p, mx.int32) + mx.left_shift(n, 23), mx.float32)


class Compiled:
    """``mx.compile(fn)`` for arrays of any shape, its traces kept for at most ``limit`` shapes:
    MLX keeps one trace per shape of a function compiled with shapes (``shapeless`` cannot
    trace ``view``) and looks a call's shape up one trace at a time, so after 3,000 shapes a
    call took 3x as long; past ``limit`` the function is compiled afresh (dropping it drops its
    traces). A call only builds the graph; MLX fuses its elementwise ops into kernels it builds
    with the machine's C++ compiler once (kept under the temporary folder), or runs them one by
    one where there is none. One lock: MLX's compile cache is not for two threads at once."""

    def __init__(self, fn: Callable, limit: int = 256) -> None:
        self.fn, self.limit = fn, limit
        self._lock = threading.Lock()
        self._shapes: set = set()
        self._compiled = mx.compile(fn)

    def __call__(self, *args: mx.array) -> mx.array:
        shape = tuple((a.shape, a.dtype) for a in args)
        with self._lock:
            if shape not in self._shapes:
                if len(self._shapes) >= self.limit:
                    self._shapes.clear()
                    self._compiled = mx.compile(self.fn)
                self._shapes.add(shape)
            return self._compiled(*args)

    @property
    def traces(self) -> int:
        """Shapes traced by the function as now compiled."""
        return len(self._shapes)


def _poly_exp_of_difference(s: mx.array, m: mx.array) -> mx.array:
    return poly_exp(s - m)


# poly_exp(s - m) fused (measured: 2.4x faster than its ops one by one on a verify pass's scores)
poly_exp_of_difference = Compiled(_poly_exp_of_difference)


def warm() -> bool:
    """Builds the fused kernels of a prefix's ``exp`` now, on x86's CPU backend, so no answer
    waits for the C++ compiler (~2 s once a machine); where building fails (a broken
    toolchain), the ops run one by one from now on. True: fused."""
    global FUSED
    if not FUSED or not on_x86_cpu():
        return False
    try:  # the kernels' names keep the dimensions a pass's arrays keep: 1 or more key heads,
        for heads, rows in ((2, 2), (1, 2), (1, 1)):  # 1 or more rows
            k = mx.zeros((heads, POLY_KEYS, 4))
            mx.eval(keys_first_weighted(*keys_first_scores(mx.zeros((heads, rows, 4)), k), k))
    except RuntimeError as e:
        FUSED = False
        log.warning("attention's exp runs unfused on this CPU: %s", str(e).splitlines()[0])
    return FUSED


def piece(rows: int, keys: int, dim: int) -> int:
    """The keys of each piece the weighted sum of values goes in (``keys``: one product)."""
    if rows * keys * dim <= SMALL_GEMM:
        return keys
    p = 1 << max(0, (SMALL_GEMM // max(1, rows * dim)).bit_length() - 1)
    return p if PIECE_MIN <= p < keys else keys


def keys_first(q: mx.array, keys: mx.array) -> bool:
    """Whether the scores of ``q [..., rows, dim]`` over a prefix's ``keys [..., n, dim]`` are
    computed and kept keys first, ``[..., n, rows]`` (``keys_first_scores``): on the CPU on x86,
    float32 keys, up to ``SCORES_ROWS`` rows (module docstring)."""
    return (PRODUCTS and q.shape[-2] <= SCORES_ROWS and keys.dtype == mx.float32
            and on_x86_cpu())


def keys_first_scores(q: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
    """(scores ``keys @ q^T`` ``[..., n, rows]``, each row's maximum ``[..., rows, 1]``)."""
    s = keys @ q.swapaxes(-1, -2)
    return s, s.max(axis=-2, keepdims=True).swapaxes(-1, -2)


def keys_first_weighted(s: mx.array, m: mx.array,
                        values: mx.array) -> tuple[mx.array, mx.array]:
    """For scores kept keys first (``s [..., n, rows]``) and maxima ``m [..., rows, 1]`` at
    least each row's: (``exp(s - m)``'s weighted sum of ``values [..., n, dim]``, ``[..., rows,
    dim]``; its sum over the keys, ``[..., rows, 1]``). The sum of values in pieces of
    ``piece(rows, n, dim)`` keys; ``exp`` through ``poly_exp`` from ``POLY_KEYS`` keys (module
    docstring)."""
    n = values.shape[-2]
    if POLY_EXP and n >= POLY_KEYS and s.dtype == mx.float32:
        e = (poly_exp_of_difference if FUSED else _poly_exp_of_difference)(
            s, m.swapaxes(-1, -2))
    else:
        e = exp(s - m.swapaxes(-1, -2))
    denom = e.sum(axis=-2, keepdims=True).swapaxes(-1, -2)
    p = piece(e.shape[-1], n, values.shape[-1])
    out = e[..., :p, :].swapaxes(-1, -2) @ values[..., :p, :]
    for a in range(p, n, p):
        out = out + e[..., a : a + p, :].swapaxes(-1, -2) @ values[..., a : a + p, :]
    return out, denom
