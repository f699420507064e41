"""Qwen2.5-VL's images (``models/image_families/qwen_vl.py``) on the tiny random-weight model:
each image split from the processor's output and encoded alone gives the features mlx-vlm's
model computes for the whole prompt, and a chat about an image passes the exactness check
(``exact.py``: mlx-vlm's own answer, cache on and off, warm, restored, chunked)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from harness.tiny_vlm import make_tiny_vlm_dir
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.models.image_families.exact import check_image_chat, two_images


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("qwen-vl")
    return resolve_and_load(str(make_tiny_vlm_dir(root / "tiny-qwen2_5_vl", seed=0)))


def call(vlm, ids: list[int], prompt) -> mx.array:
    """mlx-vlm's Qwen2.5-VL over the whole sequence: all pixels and grids in one call."""
    images = prompt.images.images
    return vlm(mx.array(ids)[None], mx.concatenate([im.arrays["pixel_values"] for im in images]),
               image_grid_thw=mx.array([im.grid for im in images])).logits[0, -1]


def test_each_image_encoded_alone_gives_the_whole_prompt_s_features(vlm: LoadedModel) -> None:
    two = two_images(vlm)
    reader, model = two.reader, vlm.model.vlm
    alone = mx.concatenate([reader.encode(model, im)["features"] for im in two.images])
    whole = model.vision_tower(mx.concatenate([im.arrays["pixel_values"] for im in two.images]),
                               mx.array([im.grid for im in two.images]),
                               output_hidden_states=False)
    assert alone.shape == whole.shape == (sum(s.length for s in two.spans),
                                          model.config.text_config.hidden_size)
    assert mx.allclose(alone, whole, atol=1e-5)


def test_a_chat_about_an_image_is_exact(vlm: LoadedModel, tmp_path: Path) -> None:
    check_image_chat(vlm, tmp_path, call)
