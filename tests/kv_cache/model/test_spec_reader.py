"""kv_cache/model/spec_reader.py: cache specs read off each family's own caches, JSON round trips,
and a clear load-time error for caches the server cannot page or snapshot."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from kv_cache.layout.kinds import FULL, STATE, SlidingWindow
from kv_cache.layout.spec import CacheSpec, GroupSpec, UnsupportedCacheError
from kv_cache.model.spec_reader import spec_from_caches, spec_of_model
from mlx_kvserver.models.loading import resolve_and_load
from harness.tiny_families import SLIDING_WINDOW, make_tiny_family_dir, make_tiny_family_model
from harness.tiny_model import make_tiny_model, make_tiny_model_dir


def test_llama_spec():
    spec = spec_of_model(make_tiny_model(), "llama")
    assert spec == CacheSpec(2, (GroupSpec(FULL, (0, 1), 2, 16, "float32"),))


def test_gemma3_sliding_and_global_layers_are_two_groups():
    spec = spec_of_model(make_tiny_family_model("gemma3_text"), "gemma3_text")
    assert spec.groups == (
        GroupSpec(SlidingWindow(SLIDING_WINDOW), (0, 2), 2, 16, "float32"),
        GroupSpec(FULL, (1, 3), 2, 16, "float32"),
    )
    assert spec.has_window and not spec.has_state
    g = spec.groups[0].kind
    # A query after 40 positions reads positions 25..40: the window's last 16 (itself included).
    assert g.first_needed(40) == 40 - SLIDING_WINDOW + 1 and g.first_needed(3) == 0
    assert spec.groups[1].kind.first_needed(40) == 0
    # Pages of 8: it reads pages 3..4 (positions 24..39), keeps from 24, releases pages 0..2.
    assert g.pages(40, 8) == slice(3, 5) and g.keep_from(40, 8) == 24
    assert g.holds([None] * 3 + [1, 2], 40, 8) and not g.holds([None] * 4 + [2], 40, 8)
    assert not g.holds([None] * 3 + [1], 40, 8)  # the last page is missing
    assert g.cut(list(range(6)), 40, 8) == [None] * 3 + [3, 4]
    full = spec.groups[1].kind
    assert full.pages(40, 8) == slice(0, 5) and full.cut(list(range(6)), 33, 8) == [0, 1, 2, 3, 4]


def test_the_cache_spec_json_names_kinds_as_it_always_has():
    """The canonical JSON is part of the model fingerprint and of every file header: kinds are
    written as the strings ``"full"`` / ``"sliding"`` with the window beside them."""
    spec = spec_of_model(make_tiny_family_model("gemma3_text"), "gemma3_text")
    assert spec.to_json() == (
        '{"groups":[{"dtype":"float32","head_dim":16,"kind":"sliding","layers":[0,2],'
        '"num_kv_heads":2,"window":16},{"dtype":"float32","head_dim":16,"kind":"full",'
        '"layers":[1,3],"num_kv_heads":2,"window":0}],"num_slots":4,"states":[]}')
    assert CacheSpec.from_json(spec.to_json()) == spec


def test_gemma4_groups_by_head_size_and_shares_kv_layers():
    spec = spec_of_model(make_tiny_family_model("gemma4_text"), "gemma4_text")
    assert spec.num_slots == 4  # 6 layers, the last 2 reuse earlier layers' keys and values
    kinds = {(g.kind, g.head_dim) for g in spec.groups}
    assert kinds == {(SlidingWindow(SLIDING_WINDOW), 16), (FULL, 32)}
    assert sorted(i for g in spec.groups for i in g.layers) == [0, 1, 2, 3]


@pytest.mark.parametrize("family,states,full", [
    ("qwen3_5", (0, 2), (1, 3)), ("lfm2", (0, 2), (1, 3)), ("nemotron_h", (0, 2), (1,))])
def test_recurrent_layers_are_state_slots(family, states, full):
    spec = spec_of_model(make_tiny_family_model(family), family)
    assert tuple(s.layer for s in spec.states) == states
    assert spec.groups[0].layers == full and spec.has_state
    assert all(s.nbytes > 0 for s in spec.states)
    assert all(s.kind == STATE for s in spec.states)


def test_json_round_trip():
    spec = spec_of_model(make_tiny_family_model("qwen3_5"), "qwen3_5")
    assert CacheSpec.from_json(spec.to_json()) == spec
    assert spec.to_json() == CacheSpec.from_json(spec.to_json()).to_json()


def _probed(cache):
    cache.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    return cache


@pytest.mark.parametrize("cache,what", [
    (CacheList(KVCache(), KVCache()), "CacheList"),
    (QuantizedKVCache(), "QuantizedKVCache"),
    (RotatingKVCache(max_size=8, keep=4), "keeps its first 4 positions"),
    (object(), "object"),
])
def test_unsupported_caches_are_named_with_model_type_and_layer(cache, what):
    caches = [_probed(KVCache()), cache]
    with pytest.raises(UnsupportedCacheError) as e:
        spec_from_caches(caches, "somemodel")
    assert "somemodel" in str(e.value) and "layer 1" in str(e.value) and what in str(e.value)


def test_unsupported_cache_fails_at_load_time(tmp_path, monkeypatch):
    from mlx_lm.models import llama

    path = make_tiny_model_dir(tmp_path / "m")
    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [
        CacheList(KVCache(), KVCache()) for _ in self.layers], raising=False)
    with pytest.raises(UnsupportedCacheError, match="llama: layer 0 keeps a CacheList"):
        resolve_and_load(str(path))


def test_fingerprint_includes_the_spec(tmp_path):
    a = resolve_and_load(str(make_tiny_family_dir(tmp_path / "a", "gemma3_text")))
    assert a.cache_spec.has_window
    # Same weights and config, served as if every layer were global: another fingerprint.
    from mlx_kvserver.models import loading as models

    other = models._fingerprint(a.model, [tmp_path / "a" / "model.safetensors"], {}, a.tokenizer,
                                CacheSpec.plain(4, 2, 16, mx.float32))
    same = models._fingerprint(a.model, [tmp_path / "a" / "model.safetensors"], {}, a.tokenizer,
                               a.cache_spec)
    assert other != same
