"""Qwen3-VL: an image is read as Qwen2.5-VL's (its patches and grid, 2x2 patches merged into
one token, M-RoPE positions from ``get_rope_index``), plus deepstack: the vision tower also gives
features from some of its blocks (one ``[tokens, H]`` array per deepstack block), and mlx-vlm's
language model adds the ``i``-th of them to the image tokens' hidden states after its layer
``i`` (``visual_pos_masks``: where the image tokens are; ``deepstack_visual_embeds``: their rows
in order). A prompt piece is given both for itself (its own mask, the rows of the images it
holds), so its place in the prompt does not matter: the language model aligns a mask with the
cache's offset only when the mask is longer than the piece."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .base import ImageInput
from .qwen_vl import QwenVL


class Qwen3VL(QwenVL):
    model_types = ("qwen3_vl",)

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        """``features [tokens, H]`` and, where the tower has deepstack blocks, ``deepstack
        [blocks, tokens, H]``."""
        tower = vlm.vision_tower
        pixels = image.arrays["pixel_values"].astype(tower.patch_embed.proj.weight.dtype)
        features, deepstack = tower(pixels, image.arrays["image_grid_thw"])
        out = {"features": features}
        if deepstack:
            out["deepstack"] = mx.stack(deepstack)
        return out

    def embed(self, vlm: Any, ids: Sequence[int],
              images: Sequence[tuple[int, dict[str, mx.array]]]) -> dict[str, Any]:
        """The default ``inputs_embeds`` plus, when the piece holds images, the piece's
        ``visual_pos_masks [1, n]`` and each deepstack block's rows of its images' tokens in
        order (``deepstack_visual_embeds``)."""
        out = super().embed(vlm, ids, images)
        stacks = [f["deepstack"] for _, f in sorted(images, key=lambda i: i[0])
                  if "deepstack" in f]
        if not images or not stacks:
            return out
        if len(stacks) != len(images):
            raise ValueError("some images of a piece have deepstack features and some not")
        mask = np.asarray(list(ids)) == self.image_token(vlm)
        deepstack = mx.concatenate(stacks, axis=1)
        if int(mask.sum()) != deepstack.shape[1]:
            # mlx-vlm's language model skips the deepstack of a row whose counts differ
            raise ValueError(f"a piece has {int(mask.sum())} image tokens for "
                             f"{deepstack.shape[1]} deepstack rows")
        out["visual_pos_masks"] = mx.array(mask)[None]
        out["deepstack_visual_embeds"] = list(deepstack)
        return out
