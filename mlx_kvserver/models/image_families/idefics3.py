"""Idefics3 and SmolVLM (whose model is Idefics3's): the image processor may split a picture
into square tiles plus a global view of the whole picture, each the vision tower's input size;
each tile's features (the vision tower's output pixel-shuffled and projected by the connector)
replace one run of ``<image>`` tokens. In the prompt each tile's run follows
``<fake_token_around_image>`` and a ``<row_r_col_c>`` marker (the global view's: ``<global-img>``),
rows of tiles end with newlines, and a ``<fake_token_around_image>`` closes the picture after
its global view. So one picture is several runs of the image token with text tokens between
them; its span goes from its first ``<fake_token_around_image>`` to its closing one.

The runs are grouped into pictures by the ``<fake_token_around_image>`` tokens between them:
inside a picture one opens the next tile; between two pictures the first's closing one and the
next's opening one (and any text) lie. The fake token's id is the token right after the last
run (every picture ends with its global view's run and the closing fake token), so no marker's
id need be known. Positions are the index."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .base import ImageFamily, ImageInput, runs


class Idefics3(ImageFamily):
    model_types = ("idefics3", "smolvlm")

    def pictures(self, vlm: Any, tokens: Sequence[int]
                 ) -> tuple[list[list[tuple[int, int]]], int | None]:
        """Each picture's runs of the image token in ``tokens`` (one a tile, in order), and the
        id of ``<fake_token_around_image>`` (None without a picture)."""
        found = runs(tokens, self.image_token(vlm))
        if not found or found[-1][1] >= len(tokens):  # no picture closed after its runs
            return [[r] for r in found], None
        fake = tokens[found[-1][1]]
        pictures = [[found[0]]]
        for before, run in zip(found, found[1:]):
            if list(tokens[before[1]:run[0]]).count(fake) == 1:  # the next tile's opening one
                pictures[-1].append(run)
            else:  # a picture's closing one, then the next picture's opening one
                pictures.append([run])
        return pictures, fake

    def spans(self, vlm: Any, tokens: Sequence[int], n: int) -> list[tuple[int, int]]:
        pictures, fake = self.pictures(vlm, tokens)
        out: list[tuple[int, int]] = []
        for p in pictures:
            start, end = p[0][0], p[-1][1]
            if fake is not None:
                # back from the first run to the picture's opening fake token
                while start > (out[-1][1] if out else 0) and tokens[start] != fake:
                    start -= 1
                end += 1  # its closing fake token
            out.append((start, end))
        return out

    def split(self, vlm: Any, out: dict[str, Any], n: int) -> list[ImageInput]:
        tokens = [int(t) for t in np.asarray(out["input_ids"])[0]]
        counts = [len(p) for p in self.pictures(vlm, tokens)[0][:n]]
        pixels = np.asarray(out["pixel_values"])[0]  # [tiles, C, H, W] of the whole prompt
        mask = out.get("pixel_attention_mask")
        mask = (np.asarray(mask)[0] if mask is not None
                else np.ones((pixels.shape[0], *pixels.shape[2:]), dtype=bool))
        ends = np.cumsum(counts)
        return [ImageInput({"pixel_values": mx.array(pixels[e - c:e]),
                            "pixel_attention_mask": mx.array(mask[e - c:e])})
                for c, e in zip(counts, ends)]

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        # mlx-vlm's own path: padding tiles dropped, the patch mask, vision tower, connector
        pixels = image.arrays["pixel_values"]
        tiles, _, height, width = pixels.shape
        patch, scale = vlm.config.vision_config.patch_size, vlm.config.scale_factor
        return self.embedded_alone(
            vlm, tiles * (height // patch) * (width // patch) // scale ** 2, pixels[None],
            pixel_attention_mask=image.arrays["pixel_attention_mask"][None])

    def token_embeddings(self, vlm: Any, ids: Sequence[int]) -> mx.array:
        return vlm.language_model.embed_tokens(mx.array(list(ids))[None])
