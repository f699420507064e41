"""Shared prefixes in bits read as their pages store them (``--kv-attention packed``): the
quantized products equal the decoded ones within rounding, a restored turn reads the same bytes
the same way as the warm one (bit for bit), and the answers are those of the decoded views (a
batch on a packed view reads what each member alone reads: tests/kv_cache/test_kv_bits.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache.layout.quant import KVQuant
from kv_cache.model.attention import install
from kv_cache.model.packed_attention import PackedKV, packed_layers, packed_pays
from kv_cache.model.views import PrefixViews
from tests.kv_cache.test_kv_bits import greedy_on, manager
from tests.tiny_model import make_tiny_model

SETTINGS = [8, 4, "8,4"]


@pytest.fixture(scope="module")
def model():
    m = make_tiny_model(seed=3, hidden=128, heads=4)
    assert install(m)
    return m


def test_the_mode_packs_on_a_gpu_or_when_asked():
    q = KVQuant(4)
    assert packed_pays("packed", q) and not packed_pays("decoded", q)
    assert not packed_pays("packed", None)  # full precision pages: nothing to pack
    assert packed_pays("auto", q) == (mx.default_device().type == mx.DeviceType.gpu)
    with pytest.raises(ValueError, match="--kv-attention"):
        packed_pays("fast", q)


@pytest.mark.parametrize("rotate", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize("bits", SETTINGS)
def test_quantized_products_equal_the_decoded_values_within_rounding(bits, rotate):
    from kv_cache.layout.spec import GroupSpec
    from kv_cache.layout.kinds import FullAttention
    from kv_cache.layout.quant import make_quant

    quant = make_quant(bits, 32, rotate)
    group = GroupSpec(FullAttention(), (0, 1), 2, 64, "float32", quant)
    key = mx.random.key(4)
    kv = mx.random.normal((2, 2, 2, 40, 64), key=key)  # layers, k/v, heads, positions, dim
    kv = kv.at[:, :, :, :, 5].multiply(20.0)  # an outlier channel, as real keys have
    rows = quant.encode(kv)
    decoded = quant.decode(rows, mx.float32, 64)
    q = mx.random.normal((2, 3, 64), key=mx.random.split(key)[0])
    p = mx.softmax(mx.random.normal((2, 3, 40), key=mx.random.split(key)[1]), axis=-1)
    for layer, packed in enumerate(packed_layers(group, rows)):
        assert isinstance(packed, PackedKV) and packed.length == 40
        k, v = decoded[layer, 0], decoded[layer, 1]
        scores = q @ k.swapaxes(-1, -2)
        assert mx.allclose(packed.scores(q), scores, atol=1e-3, rtol=1e-4).item()
        assert mx.allclose(packed.weighted_values(p), p @ v, atol=1e-4, rtol=1e-4).item()
        head = packed.head(17)
        assert mx.allclose(head.scores(q), scores[..., :17], atol=1e-3, rtol=1e-4).item()
    # packed: codes, scales and biases take less than float32 would
    assert sum(x.nbytes for x in packed_layers(group, rows)) < decoded.nbytes / 2


def _turn(model, m, tokens, history, n):
    seq, match = m.start(tokens, ["k"])
    assert match.tokens == history
    assert seq.view is not None and seq.view.length == 24
    assert all(isinstance(kv, PackedKV) for kv in seq.view.kv.values())
    out = greedy_on(model, seq, tokens[history:], n)
    seq.close()
    return out


@pytest.mark.parametrize("bits", SETTINGS)
def test_a_restored_turn_reads_the_packed_view_as_the_warm_one(model, tmp_path, bits):
    tokens = list(range(40, 76))
    m = manager(model, bits, 32, tmp_path)
    m.views = PrefixViews(m.pool, mode="packed")
    seq, _ = m.start(tokens[:26], [])
    greedy_on(model, seq, tokens[:26], 1)
    m.save("k", seq)
    seq.close()
    warm_tokens, warm = _turn(model, m, tokens, 26, 6)  # its pages in memory
    m.close()
    m = manager(model, bits, 32, tmp_path)  # a restart: the pages from disk
    m.views = PrefixViews(m.pool, mode="packed")
    restored_tokens, restored = _turn(model, m, tokens, 26, 6)
    assert restored_tokens == warm_tokens and mx.array_equal(restored, warm).item()
    m.close()
    m = manager(model, bits, 32, tmp_path)  # the same pages read decoded: the same answer
    m.views = PrefixViews(m.pool, mode="decoded")
    seq, _ = m.start(tokens, ["k"])
    assert not any(isinstance(kv, PackedKV) for kv in seq.view.kv.values())
    decoded_tokens, decoded = greedy_on(model, seq, tokens[26:], 6)
    assert decoded_tokens == warm_tokens
    assert mx.allclose(decoded, warm, atol=1e-3).item()
    seq.close()
    m.close()
