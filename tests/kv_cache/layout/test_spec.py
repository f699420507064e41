"""kv_cache/layout/spec.py: the description of a model's cache (groups, state slots, a page's
geometry and codec) and its canonical JSON, which is part of every fingerprint and file header."""

import mlx.core as mx

from kv_cache.layout.kinds import FULL, SlidingWindow
from kv_cache.layout.quant import KVQuant
from kv_cache.layout.spec import CacheSpec, GroupSpec, StateSpec, with_kv_bits


def test_plain_spec_is_one_full_group():
    spec = CacheSpec.plain(3, 2, 8, mx.float16)
    assert spec.groups == (GroupSpec(FULL, (0, 1, 2), 2, 8, "float16"),)
    assert spec.states == () and not spec.has_state and not spec.has_window
    assert spec.groups[0].page_bytes(4) == 3 * 2 * 2 * 4 * 8 * 2
    assert spec.groups[0].shape(5) == (3, 2, 2, 5, 8)
    assert spec.groups[0].window == 0 and spec.groups[0].kind.reads_all


def test_json_round_trip_of_every_part():
    spec = CacheSpec(5, (GroupSpec(SlidingWindow(16), (0, 2), 2, 16, "float32"),
                         GroupSpec(FULL, (1,), 4, 8, "bfloat16", KVQuant(8, 32))),
                     (StateSpec(3, ((1, 4), (1, 2, 8)), ("float32", "float16")),))
    assert spec.has_window and spec.has_state
    again = CacheSpec.from_json(spec.to_json())
    assert again == spec and again.to_json() == spec.to_json()
    assert spec.states[0].nbytes == 4 * 4 + 16 * 2


def test_kv_bits_change_the_pages_and_the_fingerprint_only_when_set():
    spec = CacheSpec.plain(2, 2, 64, mx.float16)
    assert with_kv_bits(spec, "fp", None) == (spec, "fp")
    q8, fp8 = with_kv_bits(spec, "fp", 8)
    q4, fp4 = with_kv_bits(spec, "fp", 4)
    assert len({"fp", fp8, fp4}) == 3
    assert q8.groups[0].quant == KVQuant(8, 64) and q4.groups[0].quant == KVQuant(4, 64)
    assert q8.groups[0].stored_dtype == "uint32"
    assert q4.groups[0].page_bytes(16) < q8.groups[0].page_bytes(16) < spec.groups[0].page_bytes(16)
    # keys and values in their own bits, and the rotation, are settings of their own
    q84, fp84 = with_kv_bits(spec, "fp", "8,4")
    assert q84.groups[0].quant == KVQuant(8, 64, 4) and with_kv_bits(spec, "fp", (8, 4))[1] == fp84
    plain, fp_plain = with_kv_bits(spec, "fp", 8, rotate=False)
    assert len({fp8, fp84, fp_plain}) == 3 and plain.groups[0].quant == KVQuant(8, rotate=False)
    assert q4.groups[0].page_bytes(16) < q84.groups[0].page_bytes(16) < q8.groups[0].page_bytes(16)
    for s in (q84, plain):
        assert CacheSpec.from_json(s.to_json()) == s
    g = q84.groups[0]
    assert g.stored_shape(5) == (2, 2, 2, 5, (64 + 4 + 32 + 4) // 8)
