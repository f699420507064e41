"""Keys per channel over a page (``kv_cache.layout.channel_keys``): what a sealed page's key
rows hold and read back."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache.layout import channel_keys
from kv_cache.layout.quant import KVQuant
from benchmarks.kivi_sim import kivi_round_trip

P = 4


def test_the_codec_reads_back_what_it_gave_and_keeps_each_key_within_half_a_step():
    mx.random.seed(0)
    x = mx.random.normal((2, 3, 3 * P, 32)) * 4 + mx.arange(32) * 0.7  # channel offsets
    read, words = channel_keys.seal(x, 4, P)
    assert words.shape == (2, 3, 3 * P, 4 + 8)  # 4 words of codes, 32 channels' pairs / 4 rows
    assert mx.array_equal(channel_keys.decode(words, 4, P, mx.float32, 32), read).item()
    lo = x.reshape(2, 3, 3, P, 32).min(axis=-2)
    hi = x.reshape(2, 3, 3, P, 32).max(axis=-2)
    step = ((hi - lo) / 15).reshape(2, 3, 3, 1, 32)
    err = mx.abs(read - x).reshape(2, 3, 3, P, 32)
    assert (err <= step * 0.5 + 1e-3).all().item()
    # a last page that is not full has no codes: it reads as zeros
    part = channel_keys.decode(words[..., : 2 * P + 1, :], 4, P, mx.float32, 32)
    assert mx.array_equal(part[..., : 2 * P, :], read[..., : 2 * P, :]).item()
    assert not part[..., 2 * P :, :].any().item()
    with pytest.raises(ValueError, match="whole pages"):
        channel_keys.seal(x[..., :5, :], 4, P)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_what_the_model_reads_is_the_simulations_and_the_words_read_back_bit_for_bit(dtype):
    mx.random.seed(1)
    x = (mx.random.normal((2, 96, 64)) * 3 + mx.arange(64) * 0.5).astype(dtype)
    read, words = channel_keys.seal(x, 4, 32)
    assert words.shape == (2, 96, 8 + 2)  # 64 channels' pairs over 32 rows: 2 words a row
    assert mx.array_equal(channel_keys.decode(words, 4, 32, dtype, 64), read).item()
    if dtype == mx.float32:
        assert mx.array_equal(read, kivi_round_trip(x, 32, 4)[0]).item()


def test_a_page_in_its_quant_has_even_rows_and_a_setting_of_its_own():
    q, plain = KVQuant(4, 64, key_block=32), KVQuant(4, 64)
    assert q.key_words(64, mx.float32) == 8 + 2 and plain.key_words(64, mx.float32) == 9
    assert q.kv_bytes(64, mx.float32) == 80 and plain.kv_bytes(64, mx.float32) == 72
    assert q.words(64, mx.float32) == 10
    assert q.describe() != plain.describe() and KVQuant.from_description(q.describe()) == q
    assert q.label() == "4/channel"
    keys = mx.random.normal((1, 2, 40, 64))
    values = mx.random.normal((1, 2, 40, 64))
    rows = q.encode(mx.stack([keys, values], axis=1))  # one whole page and 8 open positions
    got = q.decode(rows, mx.float32, 64)
    k, v, _, _ = q.seal(keys[..., :32, :], values[..., :32, :])
    assert mx.array_equal(got[:, 0, :, :32], k).item()
    assert mx.array_equal(got[:, 1, :, :32], v).item()
    kw, vw = q.split(rows, 64, mx.float32)
    assert not kw[..., 32:, :].any().item() and not vw[..., 32:, :].any().item()
