"""LLaVA: a picture is resized and cropped to the vision tower's one size (a CLIP or SigLIP
tower), so every image is the same number of tokens: one run of the image token, replaced row
for row by the projector's output over the tower's chosen layer (``vision_feature_layer``, the
class token dropped or kept by ``vision_feature_select_strategy``). Positions are the index.

An image's features are what mlx-vlm's own ``get_input_embeddings`` puts in place of a prompt
made of that image's tokens alone (its layer choice, projector and dtype, nothing redone here).
Images next to each other make one run of the image token; it is cut into images of equal
length."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .base import ImageFamily, ImageInput, concatenated, runs


class Llava(ImageFamily):
    model_types = ("llava",)
    join = staticmethod(concatenated)  # its image processor reads each image alone

    def split(self, vlm: Any, out: dict[str, Any], n: int) -> list[ImageInput]:
        pixels = np.asarray(out["pixel_values"])
        tokens = int((np.asarray(out["input_ids"]) == self.image_token(vlm)).sum()) // max(n, 1)
        return [ImageInput({"pixel_values": mx.array(pixels[i:i + 1])}, extra={"tokens": tokens})
                for i in range(n)]

    def spans(self, vlm: Any, tokens: Sequence[int], n: int) -> list[tuple[int, int]]:
        """Each run of the image token, cut into ``n`` images of equal length in all (a run of
        several images next to each other is cut evenly); the runs as they are where the image
        tokens do not divide evenly (then the counts disagree and the prompt is refused)."""
        found = runs(tokens, self.image_token(vlm))
        total = sum(b - a for a, b in found)
        if n <= 0 or total % n or any((b - a) % (total // n) for a, b in found):
            return found
        size = total // n
        return [(s, s + size) for a, b in found for s in range(a, b, size)]

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        ids = mx.full((1, image.extra["tokens"]), self.image_token(vlm), dtype=mx.int32)
        embeds = vlm.get_input_embeddings(ids, image.arrays["pixel_values"]).inputs_embeds
        return {"features": embeds[0]}
