"""The split attention (shared prefix + own positions) against MLX's fused kernel, the
bookkeeping that lets KV-shared layers find their reads only inside a forward pass."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from kv_cache.model import attention
from kv_cache.model.attention import split_attention
from kv_cache.model.reads import Reads


def fused(q, k, v, mask=None, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefix_and_own_positions_merge_to_ordinary_attention(with_sinks):
    """Three rows share a 40-position prefix and own 5, 9 and 2 positions (padded, masked);
    two query positions each: the result equals attention over each row's whole context."""
    mx.random.seed(0)
    H, Hkv, D, C, T = 4, 2, 16, 40, 2
    kp, vp = mx.random.normal((Hkv, C, D)), mx.random.normal((Hkv, C, D))
    sinks = mx.random.normal((H,)) if with_sinks else None
    own = [5, 9, 2]
    q = mx.random.normal((len(own), H, T, D))
    reads, want = [], []
    for i, n in enumerate(own):
        k, v = mx.random.normal((1, Hkv, n, D)), mx.random.normal((1, Hkv, n, D))
        reads.append(Reads((kp, vp), "view", k, v, C, C + n - T, 0))
        K = mx.concatenate([kp[None], k], axis=2)
        V = mx.concatenate([vp[None], v], axis=2)
        pos = mx.arange(C + n)
        mask = pos[None] <= (C + n - T + mx.arange(T))[:, None]  # causal for the T queries
        want.append(fused(q[i : i + 1], K, V, mask=mask, sinks=sinks))
    got = split_attention(q, reads, 0.3, sinks)
    assert mx.allclose(got, mx.concatenate(want), atol=2e-5).item()


@pytest.mark.parametrize("view,alone", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_long_own_keys_are_read_where_they_are(view, alone, with_sinks, monkeypatch):
    """Rows owning ``OWN_KEYS_APART`` positions or more (no view: eight clients each on its own
    file; or a view and long own parts) are computed on each row's own keys, never padded into
    one batch array. A pass padded to its longest piece (real queries 3, 1 and 2 of 3): each row's real
    queries equal attention over its whole context; with no view where rows go alone (the CPU)
    they equal the row computed alone bit for bit, its padded queries coming back as zeros
    (skipped, nobody reads them); where they do not (a GPU), only the products go apart."""
    monkeypatch.setattr(attention, "_rows_alone", lambda: alone)
    mx.random.seed(2)
    H, Hkv, D, C, T = 4, 2, 16, 40, 3
    n0 = attention.OWN_KEYS_APART + 20
    kp, vp = mx.random.normal((Hkv, C, D)), mx.random.normal((Hkv, C, D))
    sinks = mx.random.normal((H,)) if with_sinks else None
    own, real = [n0, n0 - 30, n0 + 7], [3, 1, 2]
    q = mx.random.normal((len(own), H, T, D))
    start = C if view else 0
    reads, want, single = [], [], []
    for i, (n, t) in enumerate(zip(own, real)):
        k, v = mx.random.normal((1, Hkv, n, D)), mx.random.normal((1, Hkv, n, D))
        r = Reads((kp, vp) if view else None, "view" if view else None, k, v, start,
                  start + n - t, 0)
        reads.append(r)
        K = mx.concatenate([kp[None], k], axis=2) if view else k
        V = mx.concatenate([vp[None], v], axis=2) if view else v
        pos = mx.arange(start + n)
        mask = pos[None] <= (start + n - t + mx.arange(t))[:, None]
        want.append(fused(q[i : i + 1, :, :t], K, V, mask=mask, sinks=sinks))
        single.append(split_attention(q[i : i + 1, :, :t], [r], 0.3, sinks))
    got = split_attention(q, reads, 0.3, sinks)
    for i, t in enumerate(real):
        assert mx.allclose(got[i : i + 1, :, :t], want[i], atol=2e-5).item()
        if not view and alone:
            assert mx.array_equal(got[i : i + 1, :, :t], single[i]).item()
            assert not mx.any(got[i, :, t:]).item()


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("T", [1, 4])
def test_own_keys_before_the_queries_are_read_as_a_prefix(T, view, monkeypatch):
    """Rows holding their context in their own buffers (resident sequences) read their own keys
    before their first query as a prefix of their own, a slice of their buffers, so they take a
    prefix's forms on the CPU: alone where they read no view, and still together with the rows
    of their view where they do (eight agents sharing a system prompt, each on its own file);
    the answer is attention over the whole context, with the flag on or off. A row whose keys
    before its queries are short, or with a window, is left as it is."""
    monkeypatch.setattr(attention, "_rows_alone", lambda: True)
    seen = []
    group = attention._group
    monkeypatch.setattr(attention, "_group", lambda q, rs, *a: seen.append(rs) or group(q, rs, *a))
    mx.random.seed(4)
    H, Hkv, D, P = 4, 2, 16, 48
    kp, vp = mx.random.normal((Hkv, P, D)), mx.random.normal((Hkv, P, D))
    n0 = attention.OWN_KEYS_APART
    own = [n0 + 40, n0 + 5, 30]
    q = mx.random.normal((len(own), H, T, D))
    reads, want = [], []
    for i, n in enumerate(own):
        k, v = mx.random.normal((1, Hkv, n, D)), mx.random.normal((1, Hkv, n, D))
        start = P if view else 0
        reads.append(Reads((kp, vp) if view else None, "view" if view else None, k, v, start,
                           start + n - T, 0))
        K = mx.concatenate([kp[None], k], axis=2) if view else k
        V = mx.concatenate([vp[None], v], axis=2) if view else v
        mask = mx.arange(start + n)[None] <= (start + n - T + mx.arange(T))[:, None]
        want.append(fused(q[i : i + 1], K, V, mask=mask))
    for flag in (True, False):  # always (where it pays: the next test), or never
        monkeypatch.setattr(attention, "OWN_PREFIX_FROM", 0 if flag else math.inf)
        seen.clear()
        got = split_attention(q, reads, 0.3)
        assert mx.allclose(got, mx.concatenate(want), atol=2e-5).item()
        rows = [r for rs in seen for r in rs]
        mine = [r.mine[0].shape[1] if r.mine is not None else 0 for r in rows]
        if view:  # one group: the view's rows together
            assert len(seen) == 1
            assert all(r.prefix[0] is kp for r in rows)
        if flag:
            assert mine == [own[0] - T, own[1] - T, 0]
            assert [r.keys.shape[2] for r in rows[:2]] == [T, T]
        else:
            assert mine == [0, 0, 0]
    windowed = Reads(None, None, reads[0].keys, reads[0].values, 0, own[0] - T, 64)
    assert attention._own_prefix(windowed) is windowed


@pytest.mark.parametrize("c, t, mine", [(1_900, 1, False), (2_100, 1, True), (900, 4, False),
                                         (1_100, 4, True), (600, 9, False), (700, 9, True),
                                         (200, 512, False)])
def test_own_keys_are_read_as_a_prefix_where_that_pays(c, t, mine):
    """``c`` own keys before ``t`` queries become a prefix of their own from ``c * sqrt(t) >=
    OWN_PREFIX_FROM`` (and ``OWN_KEYS_APART`` keys): below, the plain products are faster on
    x86's CPU (one query under ~2,000 keys, four under ~1,200, nine under ~600)."""
    k = mx.zeros((1, 2, c + t, 8))
    r = Reads(None, None, k, k, 0, c, 0)
    assert (attention._own_prefix(r).mine is not None) == mine


def test_a_window_reads_only_its_last_positions():
    mx.random.seed(1)
    Hkv, D, n, W = 2, 8, 12, 4
    q = mx.random.normal((1, 2, 1, D))
    k, v = mx.random.normal((1, Hkv, n, D)), mx.random.normal((1, Hkv, n, D))
    got = split_attention(q, [Reads(None, None, k, v, 0, n - 1, W)], 0.3)
    want = fused(q, k[:, :, -W:], v[:, :, -W:])
    assert mx.allclose(got, want, atol=2e-5).item()


def test_returned_keys_are_found_only_inside_a_forward_pass():
    """Outside ``forward()`` nothing is recorded (a plain mlx-lm cache's keys are never taken
    for ours); inside, a lookup needs the very array that was recorded."""
    keys, owner = mx.zeros((1, 1, 1, 1)), object()
    attention.fetched(keys, owner)  # no pass: nowhere to record it
    with attention.forward() as p:
        attention.fetched(keys, owner)
        assert p.fetched == {id(keys): (keys, owner)}
        with attention.forward() as inner:  # a pass of its own: nothing of the outer one
            assert inner.fetched == {} and inner.masks == {}
        attention.fetched(keys, owner)
        assert p.fetched == {id(keys): (keys, owner)}
    with attention.forward() as later:
        assert later.fetched == {} and later.masks == {}
    assert not any(isinstance(v, (dict, list)) and v for k, v in vars(attention).items()
                   if not k.startswith("__")), "module-level state left behind"


class _OneRead:
    """A cache whose queries read one view and own positions (what PagedLayerCache gives)."""

    def __init__(self, read: Reads):
        self.read = read

    def reads(self) -> list[Reads]:
        return [self.read]


class _NoView:
    """A cache of one sequence holding its whole context in its own buffers."""

    def reads(self) -> None:
        return None


@pytest.mark.parametrize("T, dtype, copied", [(32, mx.float32, True), (1, mx.float32, False),
                                              (4, mx.float32, False), (32, mx.bfloat16, False)])
def test_one_sequence_over_a_view_is_the_fused_kernel_where_a_copy_pays(T, dtype, copied):
    """One sequence's prompt piece over a view: in float32 with many queries, the view's keys
    and values are copied once and attention runs as for one sequence alone (bit for bit what a
    sequence with its whole context in its own buffer computes); otherwise the split path, equal
    within rounding."""
    mx.random.seed(2)
    H, Hkv, D, C, n = 4, 2, 16, 64, T + 3  # own: 3 earlier positions, then the T queries
    kp, vp = mx.random.normal((Hkv, C, D)).astype(dtype), mx.random.normal((Hkv, C, D)).astype(dtype)
    k, v = mx.random.normal((1, Hkv, n, D)).astype(dtype), mx.random.normal((1, Hkv, n, D)).astype(dtype)
    q = mx.random.normal((1, H, T, D)).astype(dtype)
    read = Reads((kp, vp), "view", k, v, C, C + n - T, 0)
    assert attention._copy_pays(q, read, "causal" if T > 1 else None) == copied
    K, V = mx.concatenate([kp[None], k], axis=2), mx.concatenate([vp[None], v], axis=2)
    mask = "causal" if T > 1 else None
    want = attention.attention(q, K, V, _NoView(), 0.3, mask)
    assert mx.allclose(want.astype(mx.float32), fused(q, K, V, mask=mask).astype(mx.float32),
                       atol=2e-5 if dtype == mx.float32 else 3e-2).item()
    got = attention.attention(q, k, v, _OneRead(read), 0.3, mask)
    if copied:
        assert mx.array_equal(got, want).item()
    else:
        tol = 2e-5 if dtype == mx.float32 else 3e-2
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol).item()


def _masks(T: int, N: int) -> dict:
    visible = mx.arange(N)[None] <= mx.arange(N - T, N)[:, None]
    window = visible & (mx.arange(N)[None] > mx.arange(N - T, N)[:, None] - 5)
    return {"none": None, "causal": "causal", "bool [T, N]": window,
            "bool [1, 1, T, N]": window[None, None],
            "additive [T, N]": mx.where(window, 0.0, -1e9).astype(mx.float32)}


@pytest.mark.parametrize("mask_name", ["none", "causal", "bool [T, N]", "bool [1, 1, T, N]",
                                       "additive [T, N]"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_one_sequence_alone_on_an_x86_cpu_skips_the_fused_kernel(mask_name, with_sinks, T,
                                                                 monkeypatch):
    """One sequence with nothing shared: on the CPU on x86 its attention is plain ops with
    ``_exp`` (the fused kernel's softmax is MLX's scalar ``exp`` there), equal to the fused
    kernel within rounding for every mask mlx-lm passes; elsewhere the fused kernel itself."""
    mx.random.seed(4)
    H, Hkv, D, N = 6, 2, 16, 40
    q = mx.random.normal((1, H, T, D))
    k, v = mx.random.normal((1, Hkv, N, D)), mx.random.normal((1, Hkv, N, D))
    sinks = mx.random.normal((H,)) if with_sinks else None
    mask = _masks(T, N)[mask_name]
    if T == 1 and mask_name == "causal":
        mask = None
    want = fused(q, k, v, mask=mask, sinks=sinks)
    calls = _count_fused(monkeypatch)
    for x86, cpu, plain_ops in [(True, True, True), (False, True, False), (True, False, False)]:
        monkeypatch.setattr(attention, "_POW_EXP", x86)
        monkeypatch.setattr(attention, "_rows_alone", lambda: cpu)
        calls.clear()
        with attention.forward():
            got = attention.attention(q, k, v, _NoView(), 0.3, mask, sinks=sinks)
        assert calls == ([] if plain_ops else [1])
        assert mx.allclose(got, want, atol=2e-5).item()


def _count_fused(monkeypatch) -> list:
    calls: list = []
    original = attention._ORIGINAL
    monkeypatch.setattr(attention, "_ORIGINAL",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


def test_a_mask_alone_cannot_read_goes_to_the_fused_kernel(monkeypatch):
    """A per-head mask, one of other lengths, or a mask name other than ``"causal"`` is left to
    mlx-lm's function."""
    monkeypatch.setattr(attention, "_POW_EXP", True)
    monkeypatch.setattr(attention, "_rows_alone", lambda: True)
    assert attention._alone_mask(mx.ones((3, 9), dtype=mx.bool_), 3, 10) is False
    assert attention._alone_mask("sliding", 3, 10) is False
    mx.random.seed(5)
    q, k, v = (mx.random.normal(s) for s in ((1, 4, 3, 8), (1, 2, 10, 8), (1, 2, 10, 8)))
    per_head = mx.arange(10)[None, None, None] <= mx.arange(4)[None, :, None, None] + 6
    per_head = mx.broadcast_to(per_head, (1, 4, 3, 10))
    calls = _count_fused(monkeypatch)
    got = attention.attention(q, k, v, _NoView(), 0.3, per_head)
    assert calls == [1]
    assert mx.allclose(got, fused(q, k, v, mask=per_head), atol=1e-6).item()


def test_rows_on_views_compute_their_real_queries_only():
    """Two rows, each alone on its own view (four of eight clients restored from their own
    entries), in a pass padded to 4 queries where row 0 has 1 real query and row 1 has 3: each
    row's real queries equal attention over its whole context; the padding is never computed
    (zeros), as a verify pass of one long draft beside short ones needs on a long prefix."""
    mx.random.seed(6)
    H, Hkv, D, C, T = 4, 2, 16, 50, 4
    q = mx.random.normal((2, H, T, D))
    reads, want = [], []
    for i, real in enumerate([1, 3]):
        kp, vp = mx.random.normal((Hkv, C, D)), mx.random.normal((Hkv, C, D))
        k, v = mx.random.normal((1, Hkv, 2 + real, D)), mx.random.normal((1, Hkv, 2 + real, D))
        reads.append(Reads((kp, vp), f"view {i}", k, v, C, C + 2, 0))
        K, V = mx.concatenate([kp[None], k], axis=2), mx.concatenate([vp[None], v], axis=2)
        mask = mx.arange(C + 2 + real)[None] <= (C + 2 + mx.arange(real))[:, None]
        want.append(fused(q[i : i + 1, :, :real], K, V, mask=mask))
    got = split_attention(q, reads, 0.3)
    for i, real in enumerate([1, 3]):
        assert mx.allclose(got[i : i + 1, :, :real], want[i], atol=2e-5).item()
        assert mx.array_equal(got[i, :, real:], mx.zeros_like(got[i, :, real:])).item()


def test_install_warms_the_cpu_forms(monkeypatch):
    """Routing a model's attention builds x86's fused ``exp`` kernels then (``cpu_forms.warm``),
    not in the middle of an answer; a model not routed warms nothing."""
    from tests.tiny_model import make_tiny_model
    warmed: list = []
    monkeypatch.setattr(attention, "warm", lambda: warmed.append(1))
    assert attention.install(make_tiny_model(seed=5))
    assert warmed == [1]

    class NotRouted:
        def named_modules(self):
            return []
    assert not attention.install(NotRouted())
    assert warmed == [1]
