"""Vision-language models load like text ones (mlx_kvserver/models/vision.py): the family told
from config.json, loaded through mlx-vlm from a folder, a Hugging Face id or on demand, listed by
/v1/models as taking images, and a text-only chat on one served through the paged cache exactly
(greedy: the same tokens with the cache on and off, warm turn 2 as uncached)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import huggingface_hub
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from harness.server_utils import make_engine, running_server
from harness.tiny_model import tiny_config
from harness.tiny_vlm import make_tiny_vlm_dir, tiny_vlm_config
from kv_cache.hooks import install
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from mlx_kvserver.models.vision import VisionLanguageModel, vision_family

MAX_TOKENS = 8
TURNS = ["Tell me about the sea.", "And the mountains?"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny Qwen2.5-VL folder ``tiny-vlm``."""
    root = tmp_path_factory.mktemp("vision")
    make_tiny_vlm_dir(root / "tiny-vlm", seed=0)
    return root


@pytest.fixture(scope="module")
def vlm(root: Path) -> LoadedModel:
    return resolve_and_load(str(root / "tiny-vlm"))


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here reaches the Hugging Face hub (tests that fake a hub id set their own)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda **kw: pytest.fail(f"must not reach the hub: {kw}"))


def test_the_family_is_told_from_config_json() -> None:
    assert vision_family(tiny_vlm_config()) == "qwen2_5_vl"
    assert vision_family(tiny_config()) is None  # llama: a text model
    # a type both libraries have: with a vision config it sees, without one mlx-lm keeps it
    assert vision_family({**tiny_config(), "model_type": "qwen3_5"}) is None
    assert vision_family({**tiny_config(), "model_type": "gemma3", "vision_config": {}}) \
        == "gemma3"
    assert vision_family({**tiny_config(), "model_type": "gemma3_text"}) is None
    # a vision type mlx-lm has no model for, with or without a vision config
    assert vision_family({"model_type": "idefics3"}) == "idefics3"
    assert vision_family({"model_type": "llava-qwen2", "vision_config": {}}) == "llava_bunny"
    # a vision config on a type mlx-vlm does not know: not one it can load
    assert vision_family({"model_type": "no_such_vl", "vision_config": {}}) is None
    assert vision_family({}) is None


def test_a_folder_loads_through_mlx_vlm(vlm: LoadedModel, root: Path, tiny_lm) -> None:
    import mlx_vlm

    assert vlm.takes_images and not tiny_lm.takes_images
    assert vlm.processor is not None and tiny_lm.processor is None
    assert isinstance(vlm.model, VisionLanguageModel) and vlm.model.family == "qwen2_5_vl"
    assert vlm.name == "tiny-vlm" and vlm.source == str(root / "tiny-vlm")
    assert (vlm.num_layers, vlm.num_kv_heads, vlm.head_dim) == (2, 2, 16)
    assert vlm.context_length == 4096
    assert vlm.tokenizer.eos_token_ids == {tiny_vlm_config()["eos_token_id"]}
    ids = mx.array([vlm.tokenizer.encode("Hello world, hello there!")])
    logits = vlm.model(ids)
    assert logits.shape == (1, ids.shape[1], tiny_vlm_config()["vocab_size"])
    # the same as mlx-vlm's own language model on a fresh load
    own, _ = mlx_vlm.load(str(root / "tiny-vlm"))
    assert mx.allclose(logits, own.language_model(ids).logits, atol=1e-5).item()
    # its text positions follow the cache: a prefix then the rest gives the whole's last logits
    cache = make_prompt_cache(vlm.model)
    vlm.model(ids[:, :5], cache=cache)
    tail = vlm.model(ids[:, 5:], cache=cache)
    assert mx.allclose(tail[0, -1], logits[0, -1], atol=1e-4).item()
    assert install(vlm.model)  # its attention is routed through the paged caches


def test_a_language_model_with_its_own_caches_is_read_as_mlx_lm_s() -> None:
    """Gemma 3's language model makes mlx-vlm's caches (sliding windows, full layers): the spec
    is read off mlx-lm's of the same kinds, and the paged caches go under it."""
    from mlx_vlm.models import gemma3
    from mlx_vlm.utils import update_module_configs

    from kv_cache import spec_of_model

    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16,
            "num_key_value_heads": 2, "vocab_size": 320, "sliding_window": 16,
            "sliding_window_pattern": 2, "query_pre_attn_scalar": 16, "mm_tokens_per_image": 4}
    cfg = {"model_type": "gemma3", "vocab_size": 320, "image_token_index": 319,
           "text_config": text, "vision_config": {
               "model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
               "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 8,
               "image_size": 32}}
    assert vision_family(cfg) == "gemma3"
    model = VisionLanguageModel(gemma3.Model(update_module_configs(
        gemma3.ModelConfig.from_dict(cfg), gemma3, cfg, ["text", "vision"])), "gemma3")
    spec = spec_of_model(model, "gemma3").describe()
    assert [(g["kind"], g["layers"], g["window"]) for g in spec["groups"]] == [
        ("sliding", [0, 2], 16), ("full", [1, 3], 0)]
    assert install(model)


def test_a_hugging_face_id_loads_through_the_same_resolution(
        vlm: LoadedModel, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_snapshot_download(**kw: object) -> str:
        calls.append(kw)
        return str(root / "tiny-vlm")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    m = resolve_and_load("some-org/tiny-vlm")
    assert calls[0]["repo_id"] == "some-org/tiny-vlm"
    assert m.name == "some-org/tiny-vlm" and m.takes_images
    assert m.fingerprint == vlm.fingerprint


def test_the_fingerprint_covers_the_image_processor(vlm: LoadedModel, root: Path,
                                                    tmp_path: Path) -> None:
    other = shutil.copytree(root / "tiny-vlm", tmp_path / "tiny-vlm")
    cfg = json.loads((other / "preprocessor_config.json").read_text())
    cfg["max_pixels"] //= 2  # the same weights; an image becomes other tokens
    (other / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert resolve_and_load(str(other)).fingerprint != vlm.fingerprint


def listed(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/models", timeout=30).json()["data"]}


def ask(url: str, model: str, messages: list[dict], use_cache: bool = True) -> dict:
    r = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "use_kv_cache": use_cache, "logprobs": True})
    assert r.status_code == 200, r.text
    return r.json()


def same_tokens(a: dict, b: dict) -> bool:
    """The same answer token for token: each token's text and (up to float rounding) its
    log-probability (random weights answer in bytes that decode alike, as U+FFFD)."""
    ta, tb = ([(e["token"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]
              for r in (a, b))
    return len(ta) == len(tb) > 0 and all(
        x[0] == y[0] and x[1] == pytest.approx(y[1], abs=1e-3) for x, y in zip(ta, tb))


def test_served_text_only_exactly_and_listed_as_taking_images(vlm: LoadedModel, tiny_lm,
                                                              root: Path, tmp_path: Path) -> None:
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv",
                          allow_models=[f"{root}/*"])
    engine = make_engine([vlm, tiny_lm], config)
    with running_server([vlm, tiny_lm], config, engine=engine) as url:
        history = [{"role": "user", "content": TURNS[0]}]
        first = ask(url, vlm.name, history)
        cold = ask(url, vlm.name, history, use_cache=False)
        history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": TURNS[1]}]
        warm = ask(url, vlm.name, history)
        uncached = ask(url, vlm.name, history, use_cache=False)
        # a copy of the folder, loaded by its path on request
        on_demand = str(shutil.copytree(root / "tiny-vlm", root / "on-demand"))
        loaded = ask(url, on_demand, [{"role": "user", "content": TURNS[0]}])
        models = listed(url)
    assert engine.schedulers[vlm.name].runner.batched  # attention routed, batches probed equal
    text = [r["choices"][0]["message"]["content"] for r in (first, cold, warm, uncached)]
    assert text[0] == text[1] and text[2] == text[3]
    assert same_tokens(first, cold) and same_tokens(warm, uncached)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert uncached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert loaded["choices"][0]["message"]["content"] == text[0]
    assert models[vlm.name]["capabilities"] == {"vision": True}
    assert models[vlm.name]["input_modalities"] == ["text", "image"]
    assert models[tiny_lm.name]["capabilities"] == {"vision": False}
    assert models[tiny_lm.name]["input_modalities"] == ["text"]
    assert models[on_demand]["on_demand"] and models[on_demand]["capabilities"]["vision"]


def test_a_vision_family_not_proven_exact_with_images_is_served_for_text_only(
        root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A family whose images are not read exactly here (PaliGemma's, say) loads for text, says
    so, and is not listed as taking images, so an image to it is a 400, never a wrong answer."""
    from mlx_kvserver.models import vision

    assert vision.reads_images("qwen2_5_vl") and not vision.reads_images("paligemma")
    monkeypatch.setattr(vision, "IMAGE_FAMILIES", frozenset())
    monkeypatch.setattr("mlx_kvserver.models.loading.reads_images",
                        lambda family: family in vision.IMAGE_FAMILIES)
    with caplog.at_level("WARNING", logger="mlx_kvserver.models.loading"):
        lm = resolve_and_load(str(root / "tiny-vlm"))
    assert lm.processor is not None and not lm.takes_images
    assert "served for text only" in caplog.text and "qwen2_5_vl" in caplog.text
