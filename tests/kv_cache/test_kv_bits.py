"""KV pages in 8 and 4 bits (``--kv-bits K[,V]``) through the whole cache, with tiny random
models, keys per position (what sliding windows and models with recurrent state keep; keys per
channel over a page: tests/kv_cache/model/test_channel_cache.py): greedy output with the cache
equals output without it under the same setting (keys and values in their own bits too), a turn
restored from disk (with and without prefix views) or from an export equals the warm one bit for
bit, pages of another setting are a clean miss, and the bytes a token takes (head_dim 32: groups
of 32)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kv_cache.layout.spec import CacheSpec
from kv_cache.opening import open_cache
from kv_cache.layout.spec import with_kv_bits
from kv_cache.transfer import TransferError, export_entry, import_entry
from harness.tiny_model import make_tiny_model

P = 4
SETTINGS = [8, 4, "8,4", (4, 8)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3, hidden=128, heads=4)  # head_dim 32: one group of 32


def spec_of(model) -> CacheSpec:
    a = model.args
    return CacheSpec.plain(a.num_hidden_layers, a.num_key_value_heads,
                           a.hidden_size // a.num_attention_heads, mx.float32)


def setting(model, bits) -> tuple[CacheSpec, str]:
    """The tiny model's spec and fingerprint with its pages in ``bits``."""
    return with_kv_bits(spec_of(model), "tiny", bits)


def manager(model, bits, disk: Path | None = None, ram=1 << 24, store_url=None):
    spec, fp = setting(model, bits)
    return open_cache(spec, fp, page_size=P, max_ram_bytes=ram, policy="lru", disk_dir=disk,
                      max_disk_bytes=1 << 26, max_resident=0, store_url=store_url)


def greedy_off(model, tokens, n, bits) -> list[int]:
    """``n`` greedy tokens without the paged cache: mlx-lm's own cache, whose new keys and
    values are rounded as the setting's pages hold them ("cache off, same setting")."""
    quant = setting(model, bits)[0].groups[0].quant

    class RoundTrip(KVCache):
        def update_and_fetch(self, keys, values):
            if quant is not None:
                keys, values = quant.round_trip_pair(keys, values)
            return super().update_and_fetch(keys, values)

    cache = [RoundTrip() for _ in model.layers]
    x, out = mx.array(tokens)[None], []
    for _ in range(n):
        t = mx.argmax(model(x, cache=cache)[0, -1]).item()
        out.append(t)
        x = mx.array([[t]])
    return out


def greedy_on(model, seq, new, n) -> tuple[list[int], mx.array]:
    """Read ``new`` into ``seq``, then ``n`` greedy tokens; also the first step's logits."""
    out, first, x = [], None, list(new)
    for _ in range(n):
        logits = model(mx.array(x)[None], cache=seq.prepare())[0, -1]
        seq.append_tokens(x)
        first = logits if first is None else first
        out.append(mx.argmax(logits).item())
        x = [out[-1]]
    return out, first


@pytest.mark.parametrize("bits", SETTINGS)
def test_greedy_with_the_cache_equals_without_it_under_the_same_setting(model, bits):
    turn1, turn2 = list(range(40, 62)), list(range(70, 79))
    m = manager(model, bits)
    seq, _ = m.start(turn1, [])
    answer, _ = greedy_on(model, seq, turn1, 8)
    assert answer == greedy_off(model, turn1, 8, bits)
    m.save("a1", seq)
    seq.close()
    history = turn1 + answer[:-1]  # the last answer token was not read yet
    prompt = history + [answer[-1]] + turn2
    seq, match = m.start(prompt, ["a1"])
    assert match.tokens == len(history) and match.source == "entry:a1"
    again, _ = greedy_on(model, seq, prompt[match.tokens:], 8)
    assert again == greedy_off(model, prompt, 8, bits)
    seq.close()
    m.close()


@pytest.mark.parametrize("views", [False, True], ids=["buffers", "prefix-views"])
@pytest.mark.parametrize("bits", SETTINGS)
def test_a_restored_turn_equals_the_warm_one_bit_for_bit(model, tmp_path, bits, views):
    from kv_cache.model.attention import install
    from kv_cache.model.views import PrefixViews

    # 26 tokens of history (6 full pages and 2), 50 new: enough for the view to be copied in
    # front of them in float32 on the CPU, so the whole first pass is bit for bit the warm
    # one's (as without bits: test_manager's long prompt piece); the decode steps after it
    # read the view apart, within rounding, and pick the same tokens.
    tokens = list(range(40, 116))
    m = manager(model, bits, tmp_path)
    seq, _ = m.start(tokens[:26], [])
    greedy_on(model, seq, tokens[:26], 1)
    m.save("k", seq)
    warm_tokens, warm = greedy_on(model, seq, tokens[26:], 6)
    seq.close()
    m.close()
    if views:
        assert install(model)
    m = manager(model, bits, tmp_path)  # a restart
    if views:
        m.views = PrefixViews(m.pool)
    seq, match = m.start(tokens, ["k"])
    assert (match.tokens, match.source) == (26, "disk:k")
    if views:
        assert seq.view is not None and seq.view.length == 24 and seq.view.nbytes > 0
    restored_tokens, restored = greedy_on(model, seq, tokens[26:], 6)
    assert mx.array_equal(restored, warm).item() and restored_tokens == warm_tokens
    if not views:
        assert m.pool.run_array(list(seq.tables[0].blocks[:6]), 24) is None  # values: decoded
    seq.close()
    m.close()


def test_an_export_carries_the_setting_and_another_setting_refuses_it(model, tmp_path):
    tokens = list(range(20, 39))
    m = manager(model, 8)
    seq, _ = m.start(tokens, [])
    greedy_on(model, seq, tokens, 1)
    m.save("x", seq)
    warm, first = greedy_on(model, seq, [5, 6, 7], 3)
    seq.close()
    path = tmp_path / "x.safetensors"
    path.write_bytes(export_entry(m, "x"))
    for bits in (4, None):
        with pytest.raises(TransferError, match="fingerprint"):
            import_entry(manager(model, bits), path)
    m2 = manager(model, 8)
    import_entry(m2, path)
    seq, match = m2.start(tokens + [5, 6, 7], ["x"])
    assert match.tokens == len(tokens)
    again, logits = greedy_on(model, seq, [5, 6, 7], 3)
    assert again == warm and mx.array_equal(logits, first).item()
    seq.close()


def test_pages_of_another_setting_are_a_clean_miss_and_stay(model, tmp_path):
    tokens = list(range(50, 77))
    m = manager(model, 8, tmp_path)
    seq, _ = m.start(tokens, [])
    greedy_on(model, seq, tokens, 1)
    m.save("e", seq)
    seq.close()
    m.close()
    for bits in (4, None, "8,4"):
        other = manager(model, bits, tmp_path)
        seq, match = other.start(tokens, ["e"])
        assert match.tokens == 0 and match.source == "none"
        seq.close()
        other.close()
    m = manager(model, 8, tmp_path)  # its own pages are still there
    seq, match = m.start(tokens, ["e"])
    assert match.tokens == len(tokens) - 1 and match.source == "disk:e"
    seq.close()
    m.close()


def test_bytes_per_token_in_memory_and_on_disk(model, tmp_path):
    """Head_dim 32 with groups of 32 here: a group's codes, then its float16 scale and bias
    (the default model: head_dim 64 in one group, ratios 0.27 / 0.20 / 0.14 for 8, 8,4, 4)."""
    tokens = list(range(10, 10 + 8 * P))
    sizes = {}
    for bits in (None, 8, 4, "8,4"):
        m = manager(model, bits, tmp_path / str(bits))
        seq, _ = m.start(tokens, [])
        greedy_on(model, seq, tokens, 1)
        m.save("b", seq)
        memory = (m.pool.stats().used_bytes, m.pool.page_bytes)
        seq.close()
        m.close()
        on_disk = sum(f.stat().st_size for f in (tmp_path / str(bits)).rglob("*.safetensors")
                      if "pages" in f.parts)
        sizes[bits] = (*memory, on_disk)
    full = sizes[None]
    assert full[1] == 2 * 2 * 2 * P * 32 * 4  # layers, k/v, kv heads, positions, head_dim, f32
    assert sizes[8][1] == 2 * 2 * 2 * P * (32 + 4) and sizes[8][0] == 8 * sizes[8][1]
    assert sizes[4][1] == 2 * 2 * 2 * P * (16 + 4)
    assert sizes["8,4"][1] == 2 * 2 * P * (32 + 4 + 16 + 4)
    for bits, ratio in ((8, 0.29), ("8,4", 0.22), (4, 0.16)):
        assert sizes[bits][0] <= ratio * full[0]
        assert sizes[bits][2] < 0.5 * full[2]  # file headers are a larger share of tiny pages


def test_the_shared_store_carries_pages_in_bits_and_keeps_settings_apart(model, tmp_path):
    """Two servers (own disks) on one Redis: the second restores the first's 8-bit turn bit for
    bit; a server at 4 bits finds nothing of it."""
    from harness.redis_proc import running_redis

    tokens = list(range(30, 57))
    with running_redis(tmp_path / "redis") as proc:
        a = manager(model, 8, tmp_path / "a", store_url=proc.url)
        seq, _ = a.start(tokens, [])
        greedy_on(model, seq, tokens, 1)
        a.save("m", seq)
        warm_tokens, warm = greedy_on(model, seq, [7, 8, 9], 3)
        seq.close()
        a.sync()
        a.store.shared.drain()
        for bits, want in ((8, len(tokens)), (4, 0)):
            b = manager(model, bits, tmp_path / f"b{bits}", store_url=proc.url)
            seq, match = b.start(tokens + [7, 8, 9], ["m"])
            assert match.tokens == want
            if want:
                again, logits = greedy_on(model, seq, [7, 8, 9], 3)
                assert again == warm_tokens and mx.array_equal(logits, warm).item()
            seq.close()
            b.close()
        a.close()


@pytest.mark.parametrize("bits", SETTINGS)
def test_sequences_decoded_together_read_what_each_alone_reads(model, bits):
    """A batch rounds its new keys and values once for all its members: each member's step is
    what the sequence alone computes (within the batched matmuls' rounding; the same token),
    with the shared view decoded."""
    from kv_cache.model.attention import install
    from kv_cache.model.views import PrefixViews
    from kv_cache.model.batch import batch_caches

    assert install(model)
    doc = list(range(40, 80))
    prompts = [doc + [90 + i, 100 + i] for i in range(3)]
    m = manager(model, bits)
    m.views = PrefixViews(m.pool)
    seqs, nxt = [], []
    for p in prompts:
        seq, match = m.start(p, [])
        logits = model(mx.array(p[match.tokens:])[None], cache=seq.prepare())[0, -1]
        seq.append_tokens(p[match.tokens:])
        seq.commit()
        seqs.append(seq)
        nxt.append(mx.argmax(logits).item())
    assert seqs[-1].view is not None
    together = model(mx.array(nxt)[:, None], cache=batch_caches(seqs))[:, -1]
    for i, seq in enumerate(seqs):
        seq.trim(1)  # back to before the step, then the same step alone
        alone = model(mx.array([[nxt[i]]]), cache=seq.prepare())[0, -1]
        assert mx.allclose(together[i], alone, atol=1e-5).item()
        assert mx.argmax(together[i]).item() == mx.argmax(alone).item()
        seq.close()
    m.close()
