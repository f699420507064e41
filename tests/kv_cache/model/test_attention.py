"""The split attention (shared prefix + own positions) against MLX's fused kernel, the
bookkeeping that lets KV-shared layers find their reads only inside a forward pass."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache.model import attention
from kv_cache.model.attention import split_attention
from kv_cache.model.masks import Bidirectional
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
@pytest.mark.parametrize("T", [1, 6])
def test_one_sequence_alone_is_mlx_lms_function(mask_name, T, monkeypatch):
    """One sequence with nothing shared: mlx-lm's function (the fused kernel) for every mask
    mlx-lm passes, on the CPU as on a GPU: bit for bit its answer."""
    mx.random.seed(4)
    H, Hkv, D, N = 6, 2, 16, 40
    q = mx.random.normal((1, H, T, D))
    k, v = mx.random.normal((1, Hkv, N, D)), mx.random.normal((1, Hkv, N, D))
    mask = None if T == 1 and mask_name == "causal" else _masks(T, N)[mask_name]
    calls: list = []
    original = attention._ORIGINAL
    monkeypatch.setattr(attention, "_ORIGINAL",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    for cpu in (True, False):
        monkeypatch.setattr(attention, "_rows_alone", lambda: cpu)
        calls.clear()
        with attention.forward():
            got = attention.attention(q, k, v, _NoView(), 0.3, mask)
        assert calls == [1]
        assert mx.array_equal(got, fused(q, k, v, mask=mask)).item()


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


def test_install_routes_a_models_attention_only():
    """A model whose modules call mlx-lm's attention is routed through ours; one without is
    not (it decodes one sequence a pass)."""
    from harness.tiny_model import make_tiny_model
    assert attention.install(make_tiny_model(seed=5))

    class NotRouted:
        def named_modules(self):
            return []
    assert not attention.install(NotRouted())


class _Alone(_NoView):
    """One sequence holding its whole context in its own buffers, with what it read."""

    def __init__(self, read: Reads):
        self.read = lambda: read


@pytest.mark.parametrize("view,window", [(False, 0), (False, 4), (True, 0)])
def test_a_run_that_attends_both_ways_sees_its_later_keys(view, window):
    """A prompt piece of 8 queries after 3 earlier own positions (after a 16-position view, or
    with a window of 4 and none), its queries 2..6 one run given as ``Bidirectional``: equal to
    the fused kernel over the whole context with "causal (within the window) or in the same
    run" as its mask, and not to the causal answer."""
    mx.random.seed(4)
    H, Hkv, D, T, C = 4, 2, 16, 8, 16 if view else 0
    n, q0 = 3 + T, (16 if view else 0) + 3
    kp, vp = mx.random.normal((Hkv, C, D)), mx.random.normal((Hkv, C, D))
    k, v = mx.random.normal((1, Hkv, n, D)), mx.random.normal((1, Hkv, n, D))
    q = mx.random.normal((1, H, T, D))
    read = Reads((kp, vp) if view else None, "view" if view else None, k, v, C, q0, window)
    cache = _OneRead(read) if view else _Alone(read)
    K = mx.concatenate([kp[None], k], axis=2) if view else k
    V = mx.concatenate([vp[None], v], axis=2) if view else v
    pos, qpos = mx.arange(C + n)[None], (q0 + mx.arange(T))[:, None]
    causal = (pos <= qpos) & ((pos > qpos - window) if window else True)
    run = ((pos >= q0 + 2) & (pos < q0 + 7)) & ((qpos >= q0 + 2) & (qpos < q0 + 7))
    got = attention.attention(q, k, v, cache, 0.3, Bidirectional(((2, 7),)))
    assert mx.allclose(got, fused(q, K, V, mask=causal | run), atol=2e-5).item()
    assert not mx.allclose(got, fused(q, K, V, mask=causal), atol=1e-3).item()


def test_a_bidirectional_mask_needs_the_paged_caches():
    q = mx.zeros((1, 2, 3, 4))
    with pytest.raises(TypeError):
        attention.attention(q, q, q, None, 0.3, Bidirectional(((0, 2),)))
