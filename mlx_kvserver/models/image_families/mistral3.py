"""Mistral 3 (Mistral-Small-3.x) and Pixtral: a picture is its pixels and size (the processor
pads a prompt's pictures to the largest; the vision tower reads each one's own size only, its
attention kept within each picture). Pixtral's vision tower gives one feature per patch;
Mistral 3's projector merges ``spatial_merge_size`` by ``spatial_merge_size`` patches into one.
In the prompt a picture is rows of ``[IMG]`` tokens, each row but the last followed by
``[IMG_BREAK]``, the picture closed by ``[IMG_END]``: several runs of the image token, its span
from its first ``[IMG]`` to its ``[IMG_END]``.

Runs one separator apart belong to one picture unless that separator is ``[IMG_END]``, whose
id is the token right after the last run (every picture ends with it), so no other id need be
known. Positions are the index."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .base import ImageFamily, ImageInput, runs


class Mistral3(ImageFamily):
    model_types = ("mistral3", "pixtral")

    def spans(self, vlm: Any, tokens: Sequence[int], n: int) -> list[tuple[int, int]]:
        found = runs(tokens, self.image_token(vlm))
        if not found or found[-1][1] >= len(tokens):  # no picture closed after its runs
            return found
        end_token = tokens[found[-1][1]]
        out = [found[0]]
        for run in found[1:]:
            last = out[-1][1]
            if run[0] == last + 1 and tokens[last] != end_token:  # after a row's [IMG_BREAK]
                out[-1] = (out[-1][0], run[1])
            else:
                out.append(run)
        return [(a, b + 1) for a, b in out]  # each with its [IMG_END]

    def split(self, vlm: Any, out: dict[str, Any], n: int) -> list[ImageInput]:
        pixels = np.asarray(out["pixel_values"])  # [images, C, H, W], padded to the largest
        sizes = [tuple(int(x) for x in s) for s in np.asarray(out["image_sizes"])[:n]]
        # each picture at its own size: what the vision tower reads of it
        return [ImageInput({"pixel_values": mx.array(pixels[i, :, :h, :w]),
                            "image_sizes": mx.array([[h, w]])})
                for i, (h, w) in enumerate(sizes)]

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        # mlx-vlm's own path: vision tower, projector, Mistral 3's patch merger
        pixels = image.arrays["pixel_values"]
        _, height, width = pixels.shape
        side = vlm.config.vision_config.patch_size * getattr(vlm.config, "spatial_merge_size", 1)
        return self.embedded_alone(vlm, (height // side) * (width // side), pixels[None],
                                   image_sizes=image.arrays["image_sizes"])
