"""SmolVLM's and Idefics3's images (``models/image_families/idefics3.py``) on tiny random-weight
models: a picture split into tiles and a global view is one span from its first marker to its
closing one, each picture split from the processor's output and encoded alone gives the features
mlx-vlm's model computes for the whole prompt, and a chat about a picture passes the exactness
check (``exact.py``: mlx-vlm's own answer, cache on and off, warm, restored, chunked), for
SmolVLM with the pictures split into tiles and for Idefics3 without splitting."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from harness.tiny_smolvlm import FAKE, GLOBAL, IMAGE, TOKENS, make_tiny_smolvlm_dir
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.models.image_families.exact import check_image_chat, two_images

FOLDERS = {"smolvlm": {"model_type": "smolvlm", "splitting": True},
           "idefics3": {"model_type": "idefics3", "splitting": False}}


@pytest.fixture(scope="module", params=list(FOLDERS))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> LoadedModel:
    root = tmp_path_factory.mktemp(request.param)
    return resolve_and_load(str(make_tiny_smolvlm_dir(root / f"tiny-{request.param}", seed=0,
                                                      **FOLDERS[request.param])))


def pixels(images) -> dict[str, mx.array]:
    """All the prompt's tiles, as mlx-vlm's model takes them: ``[1, tiles, C, H, W]``."""
    return {k: mx.concatenate([im.arrays[k] for im in images])[None]
            for k in ("pixel_values", "pixel_attention_mask")}


def call(vlm, ids: list[int], prompt) -> mx.array:
    """mlx-vlm's SmolVLM/Idefics3 over the whole sequence: all tiles in one call."""
    return vlm(mx.array(ids)[None], **pixels(prompt.images.images)).logits[0, -1]


def test_a_picture_s_span_covers_its_tiles_and_markers(vlm: LoadedModel) -> None:
    two = two_images(vlm)
    tok, splitting = vlm.processor.tokenizer, vlm.model.vlm.model_type == "smolvlm"
    fake, image, glob = (tok.convert_tokens_to_ids(t) for t in (FAKE, IMAGE, GLOBAL))
    tiles = [im.arrays["pixel_values"].shape[0] for im in two.images]
    assert tiles == ([5, 5] if splitting else [1, 1])  # 2x2 tiles and the global view
    tokens = np.asarray(two.tokens)
    for span, n in zip(two.spans, tiles):
        inside = tokens[span.start:span.end]
        assert inside[0] == inside[-1] == fake  # from the opening marker to the closing one
        assert (inside == image).sum() == n * TOKENS and (inside == glob).sum() == 1
        assert (inside == fake).sum() == n + 1
    # every image token lies in a span, and the spans are apart
    assert (tokens == image).sum() == sum(tiles) * TOKENS
    assert two.spans[0].end <= two.spans[1].start


def test_each_image_encoded_alone_gives_the_whole_prompt_s_features(vlm: LoadedModel) -> None:
    two = two_images(vlm)
    reader, model = two.reader, vlm.model.vlm
    alone = mx.concatenate([reader.encode(model, im)["features"] for im in two.images])
    whole = model.get_input_embeddings(mx.array(two.tokens)[None], **pixels(two.images))
    rows = np.flatnonzero(np.asarray(two.tokens) == reader.image_token(model))
    whole = whole.inputs_embeds[0][mx.array(rows)]
    assert alone.shape == whole.shape == (rows.size, model.config.text_config.hidden_size)
    assert mx.allclose(alone, whole, atol=1e-5)


def test_a_chat_about_an_image_is_exact(vlm: LoadedModel, tmp_path: Path) -> None:
    check_image_chat(vlm, tmp_path, call)
