"""Mistral 3's and Pixtral's images (``models/image_families/mistral3.py``) on tiny random-weight
models: a picture's rows of ``[IMG]`` tokens, their ``[IMG_BREAK]`` and its ``[IMG_END]`` are one
span, each picture split from the processor's output (pictures of different sizes, padded
together) and encoded alone gives the features mlx-vlm's model computes for the whole prompt,
and a chat about a picture passes the exactness check (``exact.py``: mlx-vlm's own answer, cache
on and off, warm, restored, chunked)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from harness.tiny_mistral3 import BREAK, END, IMG, MERGE, PATCH, make_tiny_mistral3_dir
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.chat.pictures import file_of, picture
from tests.models.image_families.exact import check_image_chat, two_images

# two pictures of different sizes: 4x6 and 2x3 tokens (Mistral 3), 8x12 and 4x6 (Pixtral)
SIZES = {"a": (96, 64), "b": (40, 30)}
TWO = {k: file_of(picture(*size)) for k, size in SIZES.items()}


@pytest.fixture(scope="module", params=["mistral3", "pixtral"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> LoadedModel:
    root = tmp_path_factory.mktemp(request.param)
    return resolve_and_load(str(make_tiny_mistral3_dir(root / f"tiny-{request.param}", seed=0,
                                                       model_type=request.param)))


def pixels(images) -> dict[str, mx.array]:
    """All the prompt's pictures as the processor gives them to mlx-vlm's model: padded with
    zeros to the largest, and their sizes."""
    arrays = [im.arrays["pixel_values"] for im in images]
    h, w = max(a.shape[1] for a in arrays), max(a.shape[2] for a in arrays)
    padded = [mx.pad(a, [(0, 0), (0, h - a.shape[1]), (0, w - a.shape[2])]) for a in arrays]
    return {"pixel_values": mx.stack(padded),
            "image_sizes": mx.concatenate([im.arrays["image_sizes"] for im in images])}


def call(vlm, ids: list[int], prompt) -> mx.array:
    """mlx-vlm's Mistral 3/Pixtral over the whole sequence: all pictures in one call."""
    return vlm(mx.array(ids)[None], mask=None, **pixels(prompt.images.images)).logits[0, -1]


def token_side(vlm: LoadedModel) -> int:
    """The pixels a side of an image token covers (the processor brings a picture's sides up to
    multiples of it)."""
    return PATCH * (MERGE if vlm.model.vlm.config.model_type == "mistral3" else 1)


def test_a_picture_s_span_covers_its_rows(vlm: LoadedModel) -> None:
    two = two_images(vlm, TWO)
    tok = vlm.processor.tokenizer
    img, brk, end = (tok.convert_tokens_to_ids(t) for t in (IMG, BREAK, END))
    side = token_side(vlm)
    tokens = np.asarray(two.tokens)
    for span, (w, h) in zip(two.spans, SIZES.values()):
        rows, cols = -(-h // side), -(-w // side)
        inside = tokens[span.start:span.end]
        assert inside[0] == img and inside[-1] == end
        assert (inside == img).sum() == rows * cols and (inside == brk).sum() == rows - 1
        assert (inside == end).sum() == 1
    # every [IMG] token lies in a span, and the spans are apart
    assert (tokens == img).sum() == sum((tokens[s.start:s.end] == img).sum() for s in two.spans)
    assert two.spans[0].end <= two.spans[1].start


def test_each_image_encoded_alone_gives_the_whole_prompt_s_features(vlm: LoadedModel) -> None:
    two = two_images(vlm, TWO)
    reader, model = two.reader, vlm.model.vlm
    side = token_side(vlm)
    assert [im.arrays["pixel_values"].shape[1:] for im in two.images] == [
        (-(-h // side) * side, -(-w // side) * side) for w, h in SIZES.values()]
    alone = mx.concatenate([reader.encode(model, im)["features"] for im in two.images])
    whole = model.get_input_embeddings(mx.array(two.tokens)[None], **pixels(two.images))
    rows = np.flatnonzero(np.asarray(two.tokens) == reader.image_token(model))
    whole = whole.inputs_embeds[0][mx.array(rows)]
    assert alone.shape == whole.shape == (rows.size, model.config.text_config.hidden_size)
    assert mx.allclose(alone, whole, rtol=1e-4, atol=1e-4)  # float32, summed in another order


def test_a_chat_about_an_image_is_exact(vlm: LoadedModel, tmp_path: Path) -> None:
    check_image_chat(vlm, tmp_path, call)
