"""Qwen2.5-VL: an image is its patches and grid (frames, rows, columns of
patches); the vision tower merges 2x2 patches into one token; positions are M-RoPE: an image's
tokens get 3D positions from its grid and the text after it goes on from the largest position
before it plus one (``get_rope_index`` of mlx-vlm's language model). The image processor reads
each image alone, so each image's output is kept by its digest (``join``)."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .base import ImageFamily, ImageInput, concatenated


class QwenVL(ImageFamily):
    model_types = ("qwen2_5_vl",)
    # its image processor reads each image alone: the pixel rows of the images one after the
    # other, one grid row each
    join = staticmethod(concatenated)

    def split(self, vlm: Any, out: dict[str, Any], n: int) -> list[ImageInput]:
        grids = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])[:n]]
        flat = np.asarray(out["pixel_values"])
        ends = np.cumsum([g[0] * g[1] * g[2] for g in grids])
        return [ImageInput({"pixel_values": mx.array(flat[e - g[0] * g[1] * g[2]:e]),
                            "image_grid_thw": mx.array([g])}, grid=g)
                for g, e in zip(grids, ends)]

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        tower = vlm.vision_tower
        pixels = image.arrays["pixel_values"].astype(tower.patch_embed.proj.weight.dtype)
        return {"features": tower(pixels, image.arrays["image_grid_thw"],
                                  output_hidden_states=False)}

    def positions(self, vlm: Any, tokens: Sequence[int],
                  images: Sequence[ImageInput]) -> tuple[mx.array | None, int]:
        grids = mx.array([im.grid for im in images]) if images else None
        position_ids, deltas = vlm.language_model.get_rope_index(mx.array(list(tokens))[None],
                                                                 grids)
        return (position_ids[:, 0, :].astype(mx.int32),
                int(mx.array(deltas).reshape(-1)[0].item()))
