"""The tiny random-weight Qwen2.5-VL folder (harness/tiny_vlm.py): built offline, loaded by
mlx-vlm with nothing downloaded, its images read by its own vision tower."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from PIL import Image

from harness.tiny_vlm import MERGE, PATCH, VISION_SPECIALS, make_tiny_vlm_dir, tiny_vlm_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm_dir(tmp_path_factory.mktemp("vlm") / "tiny-vlm", seed=0)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Hugging Face hub: any download attempt fails."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_download(*a: object, **kw: object) -> None:
        raise AssertionError(f"a download was attempted: {a} {kw}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)


def picture(seed: int, size: int = 256) -> Image.Image:
    return Image.fromarray(
        (np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8))


def test_the_folder_has_what_mlx_vlm_reads(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "chat_template.json"} <= names


def test_loads_offline_and_reads_images(folder: Path, offline: None) -> None:
    import mlx.core as mx
    import mlx_vlm

    model, processor = mlx_vlm.load(str(folder))
    cfg = tiny_vlm_config()
    assert type(model).__module__.startswith("mlx_vlm.models.qwen2_5_vl")
    tok = processor.tokenizer
    for special in VISION_SPECIALS:  # one token each, the ids the config names
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg["image_token_id"]
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg["vision_start_token_id"]

    messages = [{"role": "user", "content": [{"type": "image"},
                                              {"type": "text", "text": "What is this?"}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?" in prompt
    inputs = [processor(text=[prompt], images=[picture(seed)], return_tensors="np")
              for seed in (1, 2)]
    ids = inputs[0]["input_ids"][0].tolist()
    per_side = 256 // PATCH // MERGE
    assert ids.count(cfg["image_token_id"]) == per_side * per_side  # 256 image tokens
    assert inputs[0]["image_grid_thw"].tolist() == [[1, 256 // PATCH, 256 // PATCH]]

    def last_logits(x: dict) -> mx.array:
        ids = mx.array(x["input_ids"])
        emb = model.get_input_embeddings(ids, mx.array(x["pixel_values"]),
                                         image_grid_thw=mx.array(x["image_grid_thw"]))
        out = model.language_model(ids, inputs_embeds=emb.inputs_embeds,
                                   position_ids=emb.position_ids, rope_deltas=emb.rope_deltas)
        return out.logits[0, -1]
    a, b = last_logits(inputs[0]), last_logits(inputs[1])
    assert mx.isfinite(a).all().item()
    assert not mx.allclose(a, b).item()  # the picture decides the answer, not its token ids
