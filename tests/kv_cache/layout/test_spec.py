"""kv_cache/layout/spec.py: the description of a model's cache (groups, state slots, a page's
geometry and codec) and its canonical JSON, which is part of every fingerprint and file header."""

import mlx.core as mx
import pytest

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
    # keys and values in their own bits, and keys per channel over a page, are settings of
    # their own
    q84, fp84 = with_kv_bits(spec, "fp", "8,4")
    assert q84.groups[0].quant == KVQuant(8, 64, 4) and with_kv_bits(spec, "fp", (8, 4))[1] == fp84
    channel, fp_channel = with_kv_bits(spec, "fp", 8, key_block=16)
    assert len({fp8, fp84, fp_channel}) == 3 and channel.groups[0].quant == KVQuant(8, key_block=16)
    assert q4.groups[0].page_bytes(16) < q84.groups[0].page_bytes(16) < q8.groups[0].page_bytes(16)
    for s in (q84, channel):
        assert CacheSpec.from_json(s.to_json()) == s
    g = q84.groups[0]
    assert g.stored_shape(5) == (2, 2, 2, 5, (64 + 4 + 32 + 4) // 8)


def test_the_group_size_is_64_or_32_where_64_does_not_divide_head_dim():
    assert with_kv_bits(CacheSpec.plain(2, 2, 128), "fp", 4)[0].groups[0].quant.group_size == 64
    assert with_kv_bits(CacheSpec.plain(2, 2, 96), "fp", 4)[0].groups[0].quant.group_size == 32
    two = CacheSpec(2, (GroupSpec(FULL, (0,), 2, 64, "float16"),
                        GroupSpec(SlidingWindow(8), (1,), 2, 32, "float16")))
    assert {g.quant.group_size for g in with_kv_bits(two, "fp", 8)[0].groups} == {32}
    with pytest.raises(ValueError, match="multiple of 32, not 80"):
        with_kv_bits(CacheSpec.plain(2, 2, 80), "fp", 4)
    assert with_kv_bits(CacheSpec.plain(2, 2, 80), "fp", None)[1] == "fp"  # no bits: no groups


# Pages written before --kv-group-size, --kv-rotation and --kv-calibration went (the same
# codec, now picked by --kv-bits) keep their fingerprint and file headers, so they still
# restore: these are the values that code gave.
BEFORE = {
    (8, 0): "645777cdf018e3e3ca21a4d615f4fab92fe9205f9796e1a4df87e72eef2ce44c",
    (4, 32): "22ed891dfc2406a25bdc478c032278adad958701a7f4d6742a39a28c0a99dd14",
    ("8,4", 0): "2dce65e2f975be8ad4759ea3b7548506dcf063453767754c342f7c36959db03c",
    ("8,4", 32): "aa23fc00e40a448ce6096b7a067d25b17bb0d4221f840c78a7010dd7e17225f0",
}
HEADER_BEFORE = (
    '{"groups":[{"dtype":"float16","head_dim":64,"kind":"full","kv_bits":4,"kv_group_size":64,'
    '"kv_key_scales":"channel-page-32","kv_rotation":"hadamard-signs-v1","kv_scales":'
    '"affine-exact-v2","kv_value_bits":4,"layers":[0,2],"num_kv_heads":2,"window":0},'
    '{"dtype":"float16","head_dim":64,"kind":"sliding","kv_bits":4,"kv_group_size":64,'
    '"kv_rotation":"hadamard-signs-v1","kv_scales":"affine-exact-v2","kv_value_bits":4,'
    '"layers":[1],"num_kv_heads":2,"window":16}],"num_slots":3,"states":[]}')


def test_the_remaining_settings_describe_pages_as_before():
    spec = CacheSpec.plain(2, 2, 64, mx.float16)
    for (bits, block), fingerprint in BEFORE.items():
        assert with_kv_bits(spec, "fp", bits, key_block=block)[1] == fingerprint
    # head_dim 96 took --kv-group-size 32 then; groups of 32 are now picked for it
    assert with_kv_bits(CacheSpec.plain(2, 2, 96, mx.float16), "fp", 4, key_block=32)[1] == \
        "ce0aee070b5acf4d9f20d7d7c3fc11db9e39c46ded81e149364e85642389a6c5"
    mixed = CacheSpec(3, (GroupSpec(FULL, (0, 2), 2, 64, "float16"),
                          GroupSpec(SlidingWindow(16), (1,), 2, 64, "float16")))
    assert with_kv_bits(mixed, "fp", 4, key_block=32)[0].to_json() == HEADER_BEFORE


def test_descriptions_of_codecs_that_are_gone_are_refused():
    d = KVQuant(4).describe()
    for gone in ({**d, "kv_rotation": "none"}, {**d, "kv_key_shape": "v1:abc"}):
        with pytest.raises(ValueError, match="not a codec of this version"):
            KVQuant.from_description(gone)
