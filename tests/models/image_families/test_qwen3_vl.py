"""Qwen3-VL's images (``models/image_families/qwen3_vl.py``) on the tiny random-weight model:
each image encoded alone gives the features and deepstack features mlx-vlm's model computes for
the whole prompt; a prompt run in pieces (text, then a piece holding the image after the cached
text, then the rest) gives mlx-vlm's logits over the whole sequence, and not without the
deepstack; a chat about an image passes the exactness check (``exact.py``)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from harness.tiny_qwen3_vl import make_tiny_qwen3_vl_dir
from mlx_kvserver.engine.request import Prompt
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.models.image_families.exact import PICTURES, check_image_chat, prompt_of, two_images
# mlx-vlm's model over the whole sequence, all pixels and grids in one call: Qwen3-VL's as Qwen2.5-VL's
from tests.models.image_families.test_qwen_vl import call


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("qwen3-vl")
    return resolve_and_load(str(make_tiny_qwen3_vl_dir(root / "tiny-qwen3_vl", seed=0)))


def test_each_image_encoded_alone_gives_the_whole_prompt_s_features(vlm: LoadedModel) -> None:
    two = two_images(vlm)
    reader, model = two.reader, vlm.model.vlm
    alone = [reader.encode(model, im) for im in two.images]
    features, deepstack = model.vision_tower(
        mx.concatenate([im.arrays["pixel_values"] for im in two.images]),
        mx.array([im.grid for im in two.images]))
    tokens = sum(s.length for s in two.spans)
    assert features.shape == (tokens, model.config.text_config.hidden_size)
    assert mx.allclose(mx.concatenate([a["features"] for a in alone]), features, atol=1e-5)
    assert len(deepstack) == 2  # the tiny tower's deepstack blocks
    assert mx.allclose(mx.concatenate([a["deepstack"] for a in alone], axis=1),
                       mx.stack(deepstack), atol=1e-5)


def pieces(lm: LoadedModel, prompt: Prompt, cuts: list[int], deepstack: bool = True) -> mx.array:
    """The logits of the prompt's last token, the prompt run in pieces ending at ``cuts`` on one
    cache (without the deepstack where ``deepstack`` is false)."""
    model, tokens = lm.model, list(prompt.tokens)
    cache = make_prompt_cache(model)
    start = 0
    for end in cuts:
        ids = tokens[start:end]
        kwargs = prompt.images.inputs(model, ids, start)
        if not deepstack:
            kwargs.pop("deepstack_visual_embeds", None)
            kwargs.pop("visual_pos_masks", None)
        logits = model(mx.array(ids)[None], cache=cache, **kwargs)
        start = end
    return logits[0, -1]


def test_a_piece_holding_the_image_after_cached_text_is_exact(vlm: LoadedModel) -> None:
    prompt = prompt_of(vlm, PICTURES["a"])
    span, n = prompt.spans[0], len(prompt.tokens)
    assert 0 < span.start and span.end < n - 2
    cuts = [span.start - 1, span.end + 2, n]  # the image in the middle of the second piece
    expected = call(vlm.model.vlm, list(prompt.tokens), prompt)
    got = pieces(vlm, prompt, cuts)
    assert mx.allclose(got, expected, atol=1e-4)
    # the deepstack features change the answer: without them the logits differ
    assert not mx.allclose(pieces(vlm, prompt, cuts, deepstack=False), expected, atol=1e-2)


def test_a_chat_about_an_image_is_exact(vlm: LoadedModel, tmp_path: Path) -> None:
    check_image_chat(vlm, tmp_path, call)
