"""Gemma 3: an image is one fixed-size picture (the processor resizes it) that the SigLIP vision
tower reads in patches and the projector pools to ``mm_tokens_per_image`` tokens (256 in the
real model), written ``<start_of_image>``, the image tokens, ``<end_of_image>``; the span is the
run of image tokens (the two markers are text). The features go in divided by the square root
of the hidden size, as mlx-vlm's ``prepare_inputs_for_multimodal`` does, since its language
model multiplies all its input embeddings by it. Positions are the index.

An image's tokens attend to each other both ways (Hugging Face's Gemma 3: bidirectional inside
each image, causal elsewhere, in the full and the sliding-window layers alike), so a piece
holding images passes the language model a ``kv_cache.hooks.Bidirectional`` mask over their
runs, which its layers hand to the cache's attention. (mlx-vlm 0.7.10's own Gemma 3 does not:
its generation is causal throughout and its ``__call__`` passes the processor's all-ones mask
as an additive one, so every token sees every other.)"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from kv_cache.hooks import Bidirectional

from .base import ImageFamily, ImageInput, scatter_features


class Gemma3(ImageFamily):
    model_types = ("gemma3",)

    def split(self, vlm: Any, out: dict[str, Any], n: int) -> list[ImageInput]:
        pixels = np.asarray(out["pixel_values"])  # [images, channels, height, width]
        return [ImageInput({"pixel_values": mx.array(pixels[i : i + 1])}) for i in range(n)]

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        dtype = vlm.language_model.model.embed_tokens.weight.dtype
        pixels = image.arrays["pixel_values"].transpose(0, 2, 3, 1).astype(dtype)
        hidden, _, _ = vlm.vision_tower(pixels, output_hidden_states=True)
        return {"features": vlm.multi_modal_projector(hidden)[0]}

    def embed(self, vlm: Any, ids: Sequence[int],
              images: Sequence[tuple[int, dict[str, mx.array]]]) -> dict[str, Any]:
        scale = vlm.config.hidden_size ** 0.5
        embeds = scatter_features(self.token_embeddings(vlm, ids), ids, self.image_token(vlm),
                                  images, lambda f: f["features"] / scale)
        runs = tuple((start, start + f["features"].shape[0]) for start, f in images)
        return {"inputs_embeds": embeds, "mask": Bidirectional(runs)}
