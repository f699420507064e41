"""Keys per channel over a page (the default of ``--kv-bits``) through the whole cache, tiny random
models, pages of 4: the model reads what the reference (``benchmarks.kivi_sim.KiviCache``: earlier
pages decoded, its own page float, each page coded once) reads, in any chunking, batched or
alone, after trims and dropped buffers; a restored turn equals the warm one bit for bit; reuse
starts at a page boundary; a page's key codes are written once it is full."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from kv_cache.layout import channel_keys
from kv_cache.layout.quant import KVQuant
from kv_cache.layout.spec import CacheSpec, with_kv_bits
from kv_cache.model.channel_cache import ChannelKeysCache
from kv_cache.opening import open_cache
from benchmarks.kivi_sim import KiviCache
from tests.kv_cache.test_kv_bits import model, spec_of  # noqa: F401 (model: a fixture)

P = 4


def manager(model, disk: Path | None = None, key_block: int = P, bits=4, max_resident=0):
    spec, fp = with_kv_bits(spec_of(model), "tiny", bits, key_block=key_block)
    return open_cache(spec, fp, page_size=P, max_ram_bytes=1 << 24, policy="lru",
                      disk_dir=disk, max_disk_bytes=1 << 26, max_resident=max_resident)


def reference(model, tokens, n, bits=4) -> tuple[list[int], mx.array]:
    """``n`` greedy tokens through the simulation's mlx-lm cache, and the first logits."""
    cache = [KiviCache(P, bits, KVQuant(bits, 32), open_values=True) for _ in model.layers]
    x, out, first = mx.array(tokens)[None], [], None
    for _ in range(n):
        logits = model(x, cache=cache)[0, -1]
        first = logits if first is None else first
        out.append(mx.argmax(logits).item())
        x = mx.array([[out[-1]]])
    return out, first


def run(model, seq, new, n, chunk: int = 0) -> tuple[list[int], mx.array]:
    """Read ``new`` into ``seq`` (in pieces of ``chunk``), then ``n`` greedy tokens."""
    out, first, x = [], None, list(new)
    for _ in range(n):
        step = chunk or len(x)
        for i in range(0, len(x), step):
            logits = model(mx.array(x[i : i + step])[None], cache=seq.prepare())[0, -1]
            seq.append_tokens(x[i : i + step])
        first = logits if first is None else first
        out.append(mx.argmax(logits).item())
        x = [out[-1]]
    return out, first


@pytest.mark.parametrize("chunk", [0, 3, 5], ids=["one-pass", "pieces-of-3", "pieces-of-5"])
def test_greedy_with_the_cache_equals_the_reference_in_any_chunking(model, chunk):
    turn1, turn2 = list(range(40, 62)), list(range(70, 79))
    m = manager(model)
    seq, _ = m.start(turn1, [])
    answer, first = run(model, seq, turn1, 8, chunk)
    want, want_first = reference(model, turn1, 8)
    assert answer == want and mx.allclose(first, want_first, atol=1e-4).item()
    m.save("a1", seq)
    seq.close()
    prompt = turn1 + answer + turn2
    seq, match = m.start(prompt, ["a1"])
    assert match.tokens == 28 and match.source == "entry:a1"  # 29 cached: a page boundary
    again, _ = run(model, seq, prompt[match.tokens:], 8, chunk)
    assert again == reference(model, prompt, 8)[0]
    seq.close()
    m.close()


def test_the_layout_changes_what_is_read(model):
    """Per position (today's 4 bits) the first logits differ from per channel: the reference
    above tells the two apart."""
    tokens = list(range(40, 62))
    outs = []
    for block in (P, 0):
        m = manager(model, key_block=block)
        seq, _ = m.start(tokens, [])
        outs.append(run(model, seq, tokens, 1)[1])
        seq.close()
        m.close()
    assert not mx.allclose(outs[0], outs[1], atol=1e-4).item()


@pytest.mark.parametrize("views", [False, True], ids=["buffers", "prefix-views"])
def test_a_restored_turn_equals_the_warm_one_bit_for_bit(model, tmp_path, views):
    from kv_cache.model.attention import install
    from kv_cache.model.views import PrefixViews

    tokens = list(range(40, 116))
    m = manager(model, tmp_path)
    if views:
        assert install(model)
        m.views = PrefixViews(m.pool)
    seq, _ = m.start(tokens[:26], [])
    run(model, seq, tokens[:26], 1)
    m.save("k", seq)
    seq.close()
    seq, match = m.start(tokens, ["k"])  # warm: the pages in memory
    assert (match.tokens, match.source) == (24, "entry:k")
    warm_tokens, warm = run(model, seq, tokens[24:], 6)
    seq.close()
    m.close()
    m = manager(model, tmp_path)  # a restart
    if views:
        m.views = PrefixViews(m.pool)
    seq, match = m.start(tokens, ["k"])
    assert (match.tokens, match.source) == (24, "disk:k")
    if views:
        assert seq.view is not None and seq.view.length == 24
    restored_tokens, restored = run(model, seq, tokens[24:], 6)
    assert mx.array_equal(restored, warm).item() and restored_tokens == warm_tokens
    assert restored_tokens == reference(model, tokens, 6)[0]
    seq.close()
    m.close()


def key_rows(m, block) -> mx.array:
    """The keys a page's rows give back, ``[layers, kv_heads, n, head_dim]``."""
    kw, _ = m.pool.groups[0].quant.split(m.pool.data(block), 32, mx.float32)
    return channel_keys.decode(kw, 4, P, mx.float32, 32)


def test_a_page_gets_its_codes_once_full_from_its_float_keys_and_values(model):
    m = manager(model)
    seq, _ = m.start([], [])
    run(model, seq, list(range(30, 36)), 1)  # 6 positions: page 0 full, page 1 open
    seq.commit()
    layer = seq.group_layers[0][0]
    assert isinstance(layer, ChannelKeysCache) and layer.sealed == P
    open_rows = m.pool.data(seq.table.blocks[1])
    assert open_rows.shape[3] == 2 and not open_rows.any().item()  # an open page: no codes yet
    run(model, seq, [40, 41], 1)  # positions 6, 7: page 1 is full
    fk, fv = mx.array(layer.keys[0, :, 4:8]), mx.array(layer.values[0, :, 4:8])  # still float
    seq.commit()
    block = seq.table.blocks[1]
    assert m.pool.is_sealed(block) and m.pool.num_tokens(block) == P
    quant = m.pool.groups[0].quant
    k, v, kw, vw = quant.seal(fk, fv)
    assert mx.array_equal(m.pool.data(block)[0], quant.join(kw, vw)).item()  # layer 0's rows
    assert mx.array_equal(key_rows(m, block)[0], k).item()
    assert mx.array_equal(layer.keys[0, :, 4:8], k).item()  # the buffers read the codes
    assert mx.array_equal(layer.values[0, :, 4:8], v).item()
    assert not mx.array_equal(v, fv).item()
    seq.close()
    m.close()


def test_a_trim_back_into_a_sealed_page_reads_its_float_keys_again(model):
    """Speculation's rollback: a verify pass across a page boundary, committed, then trimmed
    back into the page it completed; what follows is what reading without the draft gives."""
    tokens = list(range(50, 60))  # 10 positions: page 2 (8..11) open
    want = reference(model, tokens + [7, 8], 4)[0]
    m = manager(model)
    seq, _ = m.start([], [])
    run(model, seq, tokens, 1)
    draft = [7, 99, 98, 97, 96]  # positions 10..14: page 2 full inside the pass
    model(mx.array([draft]), cache=seq.prepare())
    seq.append_tokens(draft)
    seq.commit()
    layer = seq.group_layers[0][0]
    assert layer.sealed == 12
    assert seq.can_trim_to(11) and seq.can_trim_to(8) and not seq.can_trim_to(7)
    seq.trim(4)  # keep 11 positions: back into page 2, its float keys again
    assert layer.sealed == 8 and seq.table.num_tokens == 11
    assert run(model, seq, [8], 4)[0] == want
    seq.commit()  # page 2 written again whole, from its floats
    assert seq.table.num_tokens == 15 and m.pool.is_sealed(seq.table.blocks[2])
    assert mx.array_equal(key_rows(m, seq.table.blocks[2])[0], layer.keys[0, :, 8:12]).item()
    seq.close()
    m.close()


def test_dropped_buffers_keep_the_open_pages_float_keys(model):
    tokens = list(range(60, 70))  # page 2 open after them
    want, want_first = reference(model, tokens + [3, 4], 3)
    m = manager(model)
    seq, _ = m.start([], [])
    run(model, seq, tokens, 1)
    seq.drop_buffers()  # memory pressure: the buffers go, the open page's floats stay
    layer = seq.group_layers[0][0]
    assert layer.keys is None and layer.tail is not None and layer.tail[0] == 8
    got, first = run(model, seq, [3, 4], 3)
    assert got == want and mx.allclose(first, want_first, atol=1e-4).item()
    seq.close()
    m.close()


def test_sequences_read_together_read_what_each_reads_alone(model):
    """A prompt batch whose members cross page boundaries (decoded copies, own masks), then a
    decode step together, each against the same sequence alone."""
    from kv_cache.model.attention import install
    from kv_cache.model.views import PrefixViews
    from kv_cache.model.batch import batch_caches

    assert install(model)
    doc = list(range(40, 50))
    prompts = [doc + [90 + i] * (3 + 2 * i) for i in range(3)]
    m = manager(model)
    m.views = PrefixViews(m.pool)
    seqs = []
    for p in prompts:
        seq, match = m.start(p[:9], [])
        model(mx.array(p[match.tokens : 9])[None], cache=seq.prepare())
        seq.append_tokens(p[match.tokens : 9])
        seq.commit()
        seqs.append(seq)
    assert seqs[-1].view is not None and seqs[-1].view.length == 8
    rest = [p[9:] for p in prompts]
    width = max(len(r) for r in rest)
    x = mx.array([r + [0] * (width - len(r)) for r in rest])
    together = model(x, cache=batch_caches(seqs, [len(r) for r in rest]))
    for i, (seq, r) in enumerate(zip(seqs, rest)):
        seq.append_tokens(r)
        ref = reference(model, prompts[i], 1)[1]  # within the pieces' rounding
        assert mx.allclose(together[i, len(r) - 1], ref, atol=1e-3).item()
        assert mx.argmax(together[i, len(r) - 1]).item() == mx.argmax(ref).item()
    nxt = [mx.argmax(together[i, len(r) - 1]).item() for i, r in enumerate(rest)]
    step = model(mx.array(nxt)[:, None], cache=batch_caches(seqs))[:, -1]
    for i, seq in enumerate(seqs):
        seq.trim(1)  # back to before the step, then the same step alone
        alone = model(mx.array([[nxt[i]]]), cache=seq.prepare())[0, -1]
        assert mx.allclose(step[i], alone, atol=1e-5).item()
        seq.close()
    m.close()


def test_reuse_starts_at_a_page_boundary_and_the_setting_is_its_own(model, tmp_path):
    tokens = list(range(20, 39))  # 19 tokens
    m = manager(model, tmp_path)
    assert m.pool.spec.whole_pages
    seq, _ = m.start(tokens, [])
    run(model, seq, tokens, 1)
    m.save("e", seq)
    seq.close()
    m.close()
    other = manager(model, tmp_path, key_block=0)  # per position: another fingerprint
    assert not other.pool.spec.whole_pages
    seq, match = other.start(tokens + [1], ["e"])
    assert match.tokens == 0
    seq.close()
    other.close()
    m = manager(model, tmp_path)
    seq, match = m.start(tokens + [1], ["e"])
    assert (match.tokens, match.source) == (16, "disk:e")
    seq.close()
    m.close()


def test_only_full_attention_of_a_model_without_recurrent_state_takes_it():
    from kv_cache.layout.kinds import SlidingWindow
    from kv_cache.layout.spec import GroupSpec, StateSpec

    full = GroupSpec(CacheSpec.plain(2, 2, 32).groups[0].kind, (0, 2), 2, 32, "float32")
    window = GroupSpec(SlidingWindow(8), (1, 3), 2, 32, "float32")
    spec, _ = with_kv_bits(CacheSpec(4, (full, window)), "m", 4, key_block=P)
    assert [g.quant.key_block for g in spec.groups] == [P, 0]
    assert CacheSpec.from_json(spec.to_json()) == spec  # file headers carry it
    assert spec.groups[0].quant.describe()["kv_key_scales"] == f"channel-page-{P}"
    hybrid = CacheSpec(3, (full,), (StateSpec(1, ((1, 4),), ("float32",)),))
    with pytest.raises(ValueError, match="recurrent state"):
        with_kv_bits(hybrid, "m", 4, key_block=P)


def test_pages_in_bits_take_keys_per_channel_wherever_the_model_has_no_recurrent_state():
    from kv_cache.layout.spec import StateSpec, key_block_for

    plain = CacheSpec.plain(2, 2, 32)
    for bits in (4, "4,8", 8, "8,4"):
        assert key_block_for(plain, bits, 32) == 32
    assert key_block_for(plain, 4, 16) == 16  # over the page, whatever its size
    assert key_block_for(plain, None, 32) == 0
    hybrid = CacheSpec(3, plain.groups, (StateSpec(1, ((1, 4),), ("float32",)),))
    assert key_block_for(hybrid, 4, 32) == 0


def test_a_model_with_sliding_windows_keeps_per_position_keys_in_its_windows():
    """gemma3 (sliding, global, sliding, global; head_dim 32 here): the global layers read keys
    per channel over a page, the windows per position; each layer as its reference reads."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from kv_cache.model.spec_reader import spec_of_model
    from harness.tiny_families import _get_classes, tiny_family_config

    cfg = {**tiny_family_config("gemma3_text"), "head_dim": 32, "query_pre_attn_scalar": 32}
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(4)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(mx.float32)
    spec, fp = with_kv_bits(spec_of_model(model, "gemma3_text"), "g", 4, key_block=P)
    assert [(g.kind.reads_all, g.quant.key_block) for g in spec.groups] == [(False, 0), (True, P)]
    position = KVQuant(4, 32)

    class CodedWindow(RotatingKVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(*position.round_trip_pair(keys, values))

    ref = [KiviCache(P, 4, position, open_values=True) if type(c).__name__ == "KVCache"
           else CodedWindow(max_size=c.max_size) for c in make_prompt_cache(model)]
    m = open_cache(spec, fp, page_size=P, max_ram_bytes=1 << 24, policy="lru", disk_dir=None,
                   max_disk_bytes=0, max_resident=0)
    seq = m.new_sequence()
    tokens = list(range(3, 43))
    for i in range(0, len(tokens), 7):  # pieces across pages and the window of 16
        piece = mx.array([tokens[i : i + 7]])
        want = model(piece, cache=ref)[0]
        got = model(piece, cache=seq.prepare())[0]
        seq.append_tokens(tokens[i : i + 7])
        seq.commit()
        assert mx.allclose(got, want, atol=1e-4).item(), i
    assert isinstance(seq.layers[1], ChannelKeysCache)
    assert not isinstance(seq.layers[0], ChannelKeysCache)
    seq.close()
    m.close()


def test_a_fork_reads_the_open_pages_float_keys_as_its_parent(model):
    tokens = list(range(80, 90))  # page 2 open after them
    m = manager(model)
    seq, _ = m.start([], [])
    run(model, seq, tokens, 1)
    child = seq.fork()
    assert child.group_layers[0][0].tail[0] == 8
    want, first = run(model, seq, [5, 6], 3)
    got, child_first = run(model, child, [5, 6], 3)
    assert got == want and mx.allclose(child_first, first, atol=1e-5).item()
    child.close()
    seq.close()
    m.close()


def test_the_default_models_shape_restores_bit_for_bit_through_a_view(tmp_path):
    """head_dim 64 and pages of 32 (the default model's and server's): a key row of 10 words, a
    value row of 9 and a pad word; a restored turn read through a prefix view equals the warm
    one."""
    from kv_cache.model.attention import install
    from kv_cache.model.views import PrefixViews
    from harness.tiny_model import make_tiny_model

    wide = make_tiny_model(seed=5, hidden=256, heads=4)
    assert install(wide)
    a = wide.args
    spec = CacheSpec.plain(a.num_hidden_layers, a.num_key_value_heads, 64, mx.float32)
    spec, fp = with_kv_bits(spec, "wide", 4, key_block=32)
    assert spec.groups[0].quant.words(64, mx.float32) == 10

    def opened():
        m = open_cache(spec, fp, page_size=32, max_ram_bytes=1 << 26, policy="lru",
                       disk_dir=tmp_path, max_disk_bytes=1 << 28, max_resident=0)
        m.views = PrefixViews(m.pool)
        return m

    tokens = list(range(10, 110))
    m = opened()
    seq, _ = m.start(tokens[:75], [])
    run(wide, seq, tokens[:75], 1)
    m.save("w", seq)
    seq.close()
    seq, match = m.start(tokens, ["w"])
    assert match.tokens == 64 and seq.view is not None and seq.view.length == 64
    warm_tokens, warm = run(wide, seq, tokens[64:], 4)
    seq.close()
    m.close()
    m = opened()
    seq, match = m.start(tokens, ["w"])
    assert (match.tokens, match.source) == (64, "disk:w")
    restored_tokens, restored = run(wide, seq, tokens[64:], 4)
    assert restored_tokens == warm_tokens and mx.array_equal(restored, warm).item()
    seq.close()
    m.close()


def test_a_resident_sequence_goes_on_mid_page_and_from_a_page_boundary_further_back(model):
    """A finished sequence kept with its buffers holds its open page's floats: the next turn
    goes on from its last token; a prompt that leaves it pages back starts at a boundary."""
    tokens = list(range(40, 66))  # 26: page 6 open
    m = manager(model, max_resident=2)
    seq, _ = m.start(tokens, [])
    answer, _ = run(model, seq, tokens, 3)
    m.keep(seq)
    prompt = tokens + answer[:2] + [7, 8]  # the sequence holds tokens + answer[:2]
    seq, match = m.start(prompt, [])
    assert (match.source, match.tokens) == ("resident", 28)
    got, _ = run(model, seq, prompt[28:], 3)
    assert got == reference(model, prompt, 3)[0]
    m.keep(seq)
    other = tokens[:19] + [9, 9, 9]  # leaves it at 19: pages back, mid-page
    seq, match = m.start(other, [])
    assert (match.source, match.tokens) == ("resident", 16)
    assert run(model, seq, other[16:], 3)[0] == reference(model, other, 3)[0]
    seq.close()
    m.close()
