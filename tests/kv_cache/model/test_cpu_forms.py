"""Attention's products and ``exp`` in the forms MLX's CPU backend on x86 runs fastest
(kv_cache/model/cpu_forms.py): the same values as the plain ops, scores kept keys first only
where measured, and pieces only where a product leaves OpenBLAS's small-matrix kernel."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.model import cpu_forms
from kv_cache.model.attention import split_attention
from kv_cache.model.reads import Reads


def test_exp_is_exp_to_a_few_units_in_the_last_place():
    """``exp`` (``power`` on x86's CPU backend, where MLX's ``exp`` is scalar) against float64:
    within MLX's own ``exp``'s error, and exactly 0 and 1 where those are the answer."""
    x = mx.concatenate([mx.linspace(-40, 0, 200_001), mx.array([-mx.inf, 0.0])])
    got = np.array(cpu_forms.exp(x)).astype(np.float64)
    ref = np.exp(np.array(x).astype(np.float64))
    ulps = np.abs(got - ref)[:-2] / np.spacing(ref[:-2].astype(np.float32))
    mine = np.abs(np.array(mx.exp(x)).astype(np.float64) - ref)[:-2] / np.spacing(
        ref[:-2].astype(np.float32))
    assert ulps.max() <= max(32.0, mine.max()) and ulps.mean() <= mine.mean() + 0.5
    assert got[-2] == 0.0 and got[-1] == 1.0


def test_poly_exp_is_exp_to_a_few_units_in_the_last_place():
    """``poly_exp`` (x86's CPU form for a prefix's scores: a polynomial and the exponent's bits)
    against float64 over a softmax's differences: MLX's own ``exp``'s error (both set by scaling
    by log2(e)) over every normal result, exactly 0 and 1 where those are the answer, NaN kept,
    the results below 2 ** -125 0 or tiny."""
    x = mx.concatenate([mx.linspace(-87, 0, 100_001), mx.array([-mx.inf, 0.0, mx.nan])])
    got = np.array(cpu_forms.poly_exp(x)).astype(np.float64)
    ref = np.exp(np.array(x).astype(np.float64))
    rel = np.abs(got[:-3] / ref[:-3] - 1)
    mine = np.abs(np.array(mx.exp(x)).astype(np.float64)[:-3] / ref[:-3] - 1)
    assert rel.max() <= 1.05 * mine.max() and rel.mean() <= 1.05 * mine.mean()
    assert got[-3] == 0.0 and got[-2] == 1.0 and np.isnan(got[-1])
    tiny = np.array(cpu_forms.poly_exp(mx.linspace(-104, -87.4, 2000)))  # 2 ** -150 to -126
    assert (tiny >= 0).all() and (tiny < 2.0 ** -125).all()


@pytest.mark.skipif(not cpu_forms.on_x86_cpu(), reason="poly_exp is x86's CPU form only")
def test_poly_exp_takes_no_transcendental_op(monkeypatch):
    """On x86's CPU backend ``poly_exp`` of float32 is arithmetic and bit operations only
    (MLX's ``exp`` and ``power`` run one element at a time there); other dtypes go to ``exp``."""
    def refused(*_a, **_k):
        raise AssertionError("a transcendental op")
    x = mx.linspace(-30, 0, 1000)
    want = np.array(cpu_forms.poly_exp(x))
    monkeypatch.setattr(mx, "power", refused)
    monkeypatch.setattr(mx, "exp", refused)
    assert np.array_equal(np.array(cpu_forms.poly_exp(x)), want)
    with pytest.raises(AssertionError):
        cpu_forms.poly_exp(x.astype(mx.bfloat16))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("keys", [cpu_forms.POLY_KEYS - 1, cpu_forms.POLY_KEYS])
def test_a_prefix_takes_poly_exp_by_its_keys_alone(keys, fused, monkeypatch):
    """The weighted sum's ``exp`` is ``poly_exp`` from ``POLY_KEYS`` keys (fused with the
    difference, or its ops one by one), whatever the rows (a plain step and a verify pass at one
    context take the same), and gives the plain softmax."""
    calls: list = []
    monkeypatch.setattr(cpu_forms, "FUSED", fused)
    if fused:
        real = cpu_forms.poly_exp_of_difference
        monkeypatch.setattr(cpu_forms, "poly_exp_of_difference",
                            lambda s, m: calls.append(s.shape) or real(s, m))
    else:
        real = cpu_forms.poly_exp
        monkeypatch.setattr(cpu_forms, "poly_exp", lambda x: calls.append(x.shape) or real(x))
    mx.random.seed(keys)
    v = mx.random.normal((3, keys, 64))
    for rows in (3, 12):
        q = mx.random.normal((3, rows, 64)) * 0.125
        k = mx.random.normal((3, keys, 64))
        s = q @ k.swapaxes(-1, -2)
        e = mx.exp(s - s.max(axis=-1, keepdims=True))
        out, denom = cpu_forms.keys_first_weighted(*cpu_forms.keys_first_scores(q, k), v)
        assert mx.allclose(denom, e.sum(axis=-1, keepdims=True), rtol=1e-5).item()
        assert mx.allclose(out, e @ v, rtol=1e-4, atol=1e-4).item()
    assert calls == ([(3, keys, 3), (3, keys, 12)] if keys >= cpu_forms.POLY_KEYS else [])


@pytest.mark.parametrize("heads,rows", [(3, 9), (1, 1), (2, 48)])
def test_fused_poly_exp_is_its_ops_bit_for_bit(heads, rows):
    """``poly_exp(s - m)`` compiled (MLX fuses its ops into kernels) gives what its ops give one
    by one, bit for bit, so a pass is the same whether the machine has a C++ compiler or not;
    -inf gives 0."""
    mx.random.seed(rows)
    s = mx.random.normal((heads, 2100, rows)) * 4
    s = mx.concatenate([s, mx.full((heads, 1, rows), -mx.inf)], axis=1)
    m = s.max(axis=-2, keepdims=True)
    got = cpu_forms.poly_exp_of_difference(s, m)
    assert mx.array_equal(got, cpu_forms.poly_exp(s - m)).item()
    assert (got[:, -1] == 0).all().item()


def test_compiled_keeps_its_traces_for_so_many_shapes():
    """``Compiled`` traces a function once a shape and is compiled afresh past ``limit`` shapes
    (MLX's traces of one function, looked up one by one, would grow with every shape); its
    answers stay right throughout."""
    traced: list = []

    def fn(a, b):
        traced.append(a.shape)
        return a * 2 + b

    f = cpu_forms.Compiled(fn, limit=3)
    for n in (4, 5, 4, 6, 7, 4):
        a = mx.arange(n, dtype=mx.float32)
        assert mx.array_equal(f(a, mx.array(1.0)), a * 2 + 1).item()
    assert traced == [(4,), (5,), (6,), (7,), (4,)]  # 7 was a fourth shape: traced afresh
    assert f.traces == 2


@pytest.mark.skipif(not cpu_forms.on_x86_cpu(), reason="the fused exp is x86's CPU form only")
def test_warm_builds_the_kernels_or_leaves_the_ops_unfused(monkeypatch, caplog):
    """``warm`` (at ``attention.install``) runs a prefix's ``exp`` once, so its kernels are built
    before any answer; where that fails, the ops run one by one from then on, with a warning."""
    monkeypatch.setattr(cpu_forms, "FUSED", True)
    assert cpu_forms.warm() is True

    def broken(*_a, **_k):
        raise RuntimeError("[Compile::eval_cpu] Failed to compile function\nmore")
    monkeypatch.setattr(cpu_forms, "keys_first_weighted", broken)
    assert cpu_forms.warm() is False and cpu_forms.FUSED is False
    assert "runs unfused" in caplog.text and "Failed to compile" in caplog.text


def test_pieces_only_where_one_product_leaves_the_small_kernel():
    """The default model's shapes (64 dimensions a head, ~3,700 keys of a prefix): a plain step
    (3 rows a head) is one product; verify passes of 6, 9 and 12 rows go in pieces that stay
    within ``SMALL_GEMM``; pieces shorter than ``PIECE_MIN`` keys are not cut (one product)."""
    assert cpu_forms.piece(3, 3745, 64) == 3745
    assert cpu_forms.piece(6, 3745, 64) == 2048
    assert cpu_forms.piece(9, 3745, 64) == 1024
    assert cpu_forms.piece(12, 3745, 64) == 1024
    assert cpu_forms.piece(18, 3745, 64) == 3745  # 512-key pieces lose
    assert cpu_forms.piece(6, 2000, 64) == 2000  # fits
    assert cpu_forms.piece(15, 1100, 64) == 1024  # 15 x 1,100 x 64 does not
    for rows in (6, 9, 12, 15):
        p = cpu_forms.piece(rows, 3745, 64)
        assert rows * p * 64 <= cpu_forms.SMALL_GEMM


@pytest.mark.parametrize("rows", [3, 6, 9, 12, 48])
def test_keys_first_gives_the_plain_softmax_and_products(rows):
    """Scores kept keys first, their maxima, and the softmax's weighted sum of values and its
    denominator (in pieces from 6 rows a head on x86's CPU backend) against the plain ops."""
    mx.random.seed(rows)
    q = mx.random.normal((3, rows, 64)) * 0.125
    k, v = mx.random.normal((3, 3745, 64)), mx.random.normal((3, 3745, 64))
    s = q @ k.swapaxes(-1, -2)
    m = s.max(axis=-1, keepdims=True)
    st, mt = cpu_forms.keys_first_scores(q, k)
    assert st.shape == (3, 3745, rows) and mx.allclose(st.swapaxes(-1, -2), s, atol=1e-4).item()
    assert mx.allclose(mt, m, atol=1e-4).item()
    e = mx.exp(s - m)
    out, denom = cpu_forms.keys_first_weighted(st, mt, v)
    assert mx.allclose(denom, e.sum(axis=-1, keepdims=True), rtol=1e-4).item()
    assert mx.allclose(out, e @ v, rtol=1e-4, atol=1e-3).item()


def test_keys_first_where_measured_only():
    """Float32 keys, up to ``SCORES_ROWS`` rows a head, MLX's CPU backend on x86."""
    q, k = mx.zeros((3, 12, 64)), mx.zeros((3, 100, 64))
    assert cpu_forms.keys_first(q, k) == cpu_forms.on_x86_cpu()
    assert not cpu_forms.keys_first(mx.zeros((3, cpu_forms.SCORES_ROWS + 1, 64)), k)
    assert not cpu_forms.keys_first(q, k.astype(mx.bfloat16))


def test_a_verify_pass_over_long_prefixes_is_ordinary_attention():
    """Two rows, each on its own 3,000-position prefix view, three queries each (12 rows a key
    head: on x86's CPU backend the prefix's scores are kept keys first and its weighted sum goes
    in pieces): equal to attention over each row's whole context."""
    mx.random.seed(3)
    H, Hkv, D, C, T = 8, 2, 64, 3000, 3
    assert cpu_forms.piece(H // Hkv * T, C, D) < C
    q = mx.random.normal((2, H, T, D))
    reads, want = [], []
    for i, n in enumerate((6, 4)):
        kp, vp = mx.random.normal((Hkv, C, D)), mx.random.normal((Hkv, C, D))
        k, v = mx.random.normal((1, Hkv, n, D)), mx.random.normal((1, Hkv, n, D))
        reads.append(Reads((kp, vp), f"view {i}", k, v, C, C + n - T, 0))
        K = mx.concatenate([kp[None], k], axis=2)
        V = mx.concatenate([vp[None], v], axis=2)
        mask = mx.arange(C + n)[None] <= (C + n - T + mx.arange(T))[:, None]
        want.append(mx.fast.scaled_dot_product_attention(q[i : i + 1], K, V, scale=0.125,
                                                         mask=mask))
    got = split_attention(q, reads, 0.125)
    assert mx.allclose(got, mx.concatenate(want), atol=2e-5).item()
