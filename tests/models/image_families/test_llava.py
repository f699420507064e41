"""LLaVA's images (``models/image_families/llava.py``) on the tiny random-weight model: two
pictures next to each other in a prompt are two images of equal length; each encoded alone
gives the features mlx-vlm's model computes for the whole prompt; a chat about an image passes
the exactness check (``exact.py``: mlx-vlm's own answer, cache on and off, warm, restored,
chunked)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from harness.tiny_llava import make_tiny_llava_dir
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.models.image_families.exact import check_image_chat, two_images


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("llava")
    return resolve_and_load(str(make_tiny_llava_dir(root / "tiny-llava", seed=0)))


def pixels(prompt) -> mx.array:
    return mx.concatenate([im.arrays["pixel_values"] for im in prompt.images.images])


def call(vlm, ids: list[int], prompt) -> mx.array:
    """mlx-vlm's LLaVA over the whole sequence: all pictures in one call."""
    return vlm(mx.array(ids)[None], pixels(prompt), mask=None).logits[0, -1]


def test_each_image_encoded_alone_gives_the_whole_prompt_s_features(vlm: LoadedModel) -> None:
    two = two_images(vlm)
    model, token = vlm.model.vlm, vlm.model.vlm.config.image_token_index
    tokens = np.asarray(two.tokens)
    a, b = two.spans
    # the chat template puts the two pictures next to each other: one run, cut in two
    assert a.end == b.start and a.length == b.length == 36
    assert (tokens[a.start:b.end] == token).all() and (tokens == token).sum() == 72
    alone = mx.concatenate([two.reader.encode(model, im)["features"] for im in two.images])
    ids = mx.array(two.tokens)[None]
    whole = model.get_input_embeddings(ids, mx.concatenate(
        [im.arrays["pixel_values"] for im in two.images])).inputs_embeds[0, a.start:b.end]
    assert alone.shape == whole.shape == (72, model.config.text_config.hidden_size)
    # but for float rounding (the tower over a batch of two or one; features up to ~50)
    assert mx.allclose(alone, whole, atol=1e-4)
    # the features are the image's, not the token's embedding
    assert not mx.allclose(alone, model.language_model.model.embed_tokens(ids)[0, a.start:b.end])


def test_a_chat_about_an_image_is_exact(vlm: LoadedModel, tmp_path: Path) -> None:
    check_image_chat(vlm, tmp_path, call)
