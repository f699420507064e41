"""Gemma 3's images (``models/image_families/gemma3.py``) on the tiny random-weight model, whose
first layer attends within a sliding window shorter than an image and whose second attends over
everything.

The reference is Hugging Face's Gemma 3: an image's tokens attend to each other both ways (a
query inside an image sees every token of that image, later ones included, in the full and the
sliding-window layers alike), and everything else is causal (within the window in a sliding
layer). mlx-vlm 0.7.10's own Gemma 3 does not do this: its generation runs the language model
causally throughout (the ``attention_mask_4d`` its ``get_input_embeddings`` makes is never read
there), and its ``__call__`` passes the processor's all-ones mask as an additive mask, so every
token sees every other, the text after it included. So the reference here is built from
mlx-vlm's own pieces with explicit masks: its ``get_input_embeddings`` (image features scaled as
it scales them), then its language model's layers over the whole sequence, nothing cached, each
given its Hugging Face mask (``hf_logits``); the same loop with causal masks is checked to equal
mlx-vlm's language model's own causal forward, so only the masks differ from mlx-vlm.

Checked: each image encoded alone gives the whole prompt's features; the engine's pass over a
piece holding the image (on the paged caches, after cached text) gives the reference's logits at
every position, where a position inside the image depends on a later image token (and the
causal answer differs); a chat about an image passes the exactness check (``exact.py``)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from harness.tiny_gemma3 import WINDOW, make_tiny_gemma3_dir
from kv_cache import open_cache, spec_of_model
from kv_cache.hooks import forward, install
from mlx_kvserver.engine.request import Prompt
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.models.image_families.exact import PICTURES, check_image_chat, prompt_of, two_images


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("gemma3")
    lm = resolve_and_load(str(make_tiny_gemma3_dir(root / "tiny-gemma3", seed=0)))
    install(lm.model)  # the paged caches' attention, as the engine routes it
    return lm


def hf_masks(vlm, ids: list[int], both_ways: bool = True) -> tuple[mx.array, mx.array]:
    """Hugging Face's Gemma 3 masks over ``ids`` (True: attended): the full layers' and the
    sliding-window layers'; each causal, or'ed where ``both_ways`` with "the query and the key
    are in the same image" (an image: a run of image tokens)."""
    n = len(ids)
    q, k = mx.arange(n)[:, None], mx.arange(n)[None]
    causal = k <= q
    sliding = causal & (k > q - vlm.language_model.config.sliding_window)
    if not both_ways:
        return causal, sliding
    image = np.asarray(ids) == vlm.config.image_token_index
    group = np.where(image, np.cumsum(image & ~np.r_[False, image[:-1]]), 0)
    g = mx.array(group)
    same = (g[:, None] == g[None]) & (g[:, None] > 0)
    return causal | same, sliding | same


def hf_logits(vlm, ids: list[int], embeds: mx.array, both_ways: bool = True) -> mx.array:
    """mlx-vlm's Gemma 3 language model over the whole sequence (``embeds [1, n, H]``, nothing
    cached), each layer given its Hugging Face mask (``hf_masks``): the logits ``[1, n, V]``."""
    lm = vlm.language_model
    full, sliding = hf_masks(vlm, ids, both_ways)
    h = embeds * mx.array(lm.config.hidden_size ** 0.5, mx.bfloat16).astype(embeds.dtype)
    for layer in lm.model.layers:
        h = layer(h, sliding if layer.self_attn.is_sliding else full, None)
    return lm.lm_head(lm.model.norm(h))


def embeddings(vlm, ids: list[int], prompt: Prompt) -> mx.array:
    """mlx-vlm's input embeddings of ``ids`` with the prompt's pixels (all images at once)."""
    pixels = mx.concatenate([im.arrays["pixel_values"] for im in prompt.images.images])
    x = mx.array(ids)[None]
    return vlm.get_input_embeddings(x, pixels, mask=mx.ones(x.shape, mx.int32)).inputs_embeds


def call(vlm, ids: list[int], prompt: Prompt) -> mx.array:
    """The reference over the whole sequence: the last position's logits."""
    return hf_logits(vlm, ids, embeddings(vlm, ids, prompt))[0, -1]


def engine_logits(lm: LoadedModel, prompt: Prompt, cuts: list[int],
                  change=None) -> mx.array:
    """Every position's logits ``[n, V]`` of the prompt run in pieces ending at ``cuts`` on one
    paged sequence (the engine's caches and attention), each piece with its image inputs;
    ``change(kwargs, start)`` may alter a piece's inputs."""
    model, tokens = lm.model, list(prompt.tokens)
    m = open_cache(spec_of_model(model), "gemma3-test", page_size=8, max_ram_bytes=1 << 26,
                   policy="lru", disk_dir=None, max_disk_bytes=0, max_resident=2)
    seq, _ = m.start(tokens, use_cache=False, spans=prompt.spans)
    out, start = [], 0
    for end in cuts:
        ids = tokens[start:end]
        kwargs = prompt.images.inputs(model, ids, start)
        if change is not None:
            change(kwargs, start)
        with forward():
            logits = model(mx.array(ids)[None], cache=seq.prepare(), **kwargs)[0]
            mx.eval(logits)
        seq.append_tokens(ids)
        out.append(logits)
        start = end
    seq.close()
    return mx.concatenate(out)


def test_each_image_encoded_alone_gives_the_whole_prompt_s_features(vlm: LoadedModel) -> None:
    two = two_images(vlm)
    reader, model = two.reader, vlm.model.vlm
    alone = mx.concatenate([reader.encode(model, im)["features"] for im in two.images])
    pixels = mx.concatenate([im.arrays["pixel_values"] for im in two.images])
    hidden, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
    whole = model.multi_modal_projector(hidden).reshape(-1, alone.shape[-1])
    assert alone.shape == whole.shape == (sum(s.length for s in two.spans),
                                          model.config.text_config.hidden_size)
    assert mx.allclose(alone, whole, atol=1e-5)


def test_the_reference_is_mlx_vlm_s_language_model_but_for_the_masks(vlm: LoadedModel) -> None:
    prompt = prompt_of(vlm, PICTURES["a"])
    model, ids = vlm.model.vlm, list(prompt.tokens)
    embeds = embeddings(model, ids, prompt)
    causal = hf_logits(model, ids, mx.array(embeds), both_ways=False)
    # mlx-vlm's language model scales its inputs_embeds in place: give it a copy
    own = model.language_model(mx.array(ids)[None], inputs_embeds=mx.array(embeds)).logits
    assert mx.allclose(causal, own, atol=1e-4)
    assert not mx.allclose(hf_logits(model, ids, mx.array(embeds)), own, atol=1e-2)


def test_an_image_s_tokens_attend_to_each_other_both_ways(vlm: LoadedModel) -> None:
    prompt = prompt_of(vlm, PICTURES["a"])
    span, n = prompt.spans[0], len(prompt.tokens)
    assert span.length > WINDOW  # the sliding layer's window is shorter than the image
    assert 0 < span.start and span.end < n - 2
    cuts = [span.start - 1, span.end + 2, n]  # the image inside the second piece, text cached
    model, ids = vlm.model.vlm, list(prompt.tokens)
    embeds = embeddings(model, ids, prompt)
    both = hf_logits(model, ids, mx.array(embeds))[0]
    causal = hf_logits(model, ids, mx.array(embeds), both_ways=False)[0]
    got = engine_logits(vlm, prompt, cuts)
    assert got.shape == both.shape
    assert mx.allclose(got, both, atol=1e-4)
    # inside the image the answer is the both-ways one, not the causal one
    inside = slice(span.start, span.end - 1)
    assert not mx.allclose(got[inside], causal[inside], atol=1e-2)
    assert mx.allclose(got[: span.start], causal[: span.start], atol=1e-4)  # text before: causal
    # the family's mask is what does it: without it the engine gives the causal answer
    plain = engine_logits(vlm, prompt, cuts, lambda kwargs, start: kwargs.pop("mask", None))
    assert mx.allclose(plain, causal, atol=1e-4)

    def later(kwargs, start):  # the image's last token's embedding changed
        if "inputs_embeds" in kwargs:
            e = kwargs["inputs_embeds"]
            e[0, span.end - 1 - start] = e[0, span.end - 1 - start] * -1.0
    changed = engine_logits(vlm, prompt, cuts, later)
    # the image's first token (and every one before its last) reads the later one
    for p in (span.start, span.start + span.length // 2):
        assert not mx.allclose(changed[p], got[p], atol=1e-3)
    assert mx.allclose(changed[: span.start], got[: span.start], atol=1e-6)


def test_a_chat_about_an_image_is_exact(vlm: LoadedModel, tmp_path: Path) -> None:
    check_image_chat(vlm, tmp_path, call)
