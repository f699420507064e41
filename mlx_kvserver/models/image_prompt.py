"""A prompt with images, as a vision-language model reads it: its token ids (each image's
placeholder expanded to the image's tokens by the model's processor), where each image's tokens
are (``kv_cache.Span``: start, length, the image's pixel hash), each image's pixel values and
grid, and the M-RoPE positions of the whole prompt.

The processor (mlx-vlm's, ``LoadedModel.processor``) turns the rendered text and the images into
the expanded token ids, the pixel values (patches of all images, in order) and each image's grid
(``image_grid_thw``: frames, rows and columns of patches). The positions come from the language
model's ``get_rope_index`` over the whole prompt: an image's tokens get 3D positions and the
text after it goes on from the largest position before it plus one, so from an image on a
token's position is its index plus the prompt's ``rope_delta`` (negative: an image of ``n``
tokens takes fewer than ``n`` positions). Positions past the prompt (its answer, the next
turn's new tokens) are their index plus that delta: a function of the prompt's own tokens and
grids, known whole even when most of the prompt comes from the cache.

A piece of the prompt runs with :meth:`ImagePrompt.inputs`: its positions and, where it holds
images (whole: the scheduler never cuts an image's span), the language model's token
embeddings with those images' rows replaced by the vision tower's features for them (mlx-vlm's
``get_input_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from kv_cache import Span

from ..errors import RequestError


@dataclass
class ImagePrompt:
    """A prompt with images made ready for the model (module docstring)."""

    tokens: list[int]
    spans: tuple[Span, ...]  # (start, length, image digest) of each image's tokens
    pixels: list[mx.array]  # each image's patches
    grids: list[tuple[int, int, int]]  # each image's (frames, rows, columns) of patches
    positions: mx.array | None  # [3, len(tokens)] (M-RoPE; None: the model's own by index)
    rope_delta: int

    def inputs(self, model: Any, ids: Sequence[int], start: int) -> dict[str, mx.array]:
        """The keyword arguments of the model's pass over ``ids`` at positions ``start`` on:
        ``position_ids [3, 1, n]`` and, when images lie in it, ``inputs_embeds [1, n, H]``.
        ``model`` is the ``VisionLanguageModel``; an image it holds must lie in it whole."""
        end, n = start + len(ids), len(self.tokens)
        out = {}
        if self.positions is not None:
            pos = self.positions[:, start:min(end, n)]
            if end > n:  # past the prompt: the index plus the delta
                tail = mx.arange(max(start, n), end, dtype=mx.int32) + self.rope_delta
                pos = mx.concatenate([pos, mx.broadcast_to(tail[None], (3, tail.size))], axis=1)
            out["position_ids"] = pos[:, None, :]
        inside = [i for i, s in enumerate(self.spans) if s.start < end and s.end > start]
        if not inside:
            return out
        if any(self.spans[i].start < start or self.spans[i].end > end for i in inside):
            raise ValueError(f"a prompt piece {start}..{end} cuts an image's tokens")
        vlm = model.vlm
        features = vlm.get_input_embeddings(
            mx.array(list(ids))[None], mx.concatenate([self.pixels[i] for i in inside]),
            image_grid_thw=mx.array([self.grids[i] for i in inside]))
        out["inputs_embeds"] = features.inputs_embeds
        return out


def image_prompt(lm: Any, text: str, images: Sequence[Any]) -> ImagePrompt:
    """The prompt ``text`` (rendered, each image's placeholder where it is) with ``images``
    (``chat.conversation.Image``, in the order of their placeholders) for the vision-language
    model ``lm`` (a ``LoadedModel``); a ``RequestError`` 400 when the images and the
    placeholders do not match."""
    from PIL import Image as PILImage

    pictures = [PILImage.frombytes("RGB", (im.width, im.height), im.rgb) for im in images]
    out = lm.processor(text=[text], images=pictures or None, return_tensors="np")
    tokens = [int(t) for t in np.asarray(out["input_ids"])[0]]
    vlm = lm.model.vlm
    image_id = vlm.config.image_token_id
    runs = _runs(tokens, image_id)
    if len(runs) != len(images):
        raise RequestError(400, f"the prompt has {len(runs)} image placeholders for "
                           f"{len(images)} images (images go in user messages)",
                           param="messages", code="images_not_supported")
    grids = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])] \
        if images else []
    patches = [g[0] * g[1] * g[2] for g in grids]
    flat = mx.array(np.asarray(out["pixel_values"])) if images else None
    offsets = np.cumsum([0, *patches])
    pixels = [flat[a:b] for a, b in zip(offsets, offsets[1:])] if images else []
    spans = tuple(Span(a, b - a, im.digest) for (a, b), im in zip(runs, images))
    positions, delta = None, 0
    if hasattr(vlm.language_model, "get_rope_index"):  # M-RoPE
        position_ids, deltas = vlm.language_model.get_rope_index(
            mx.array(tokens)[None], mx.array(grids) if grids else None)
        positions = position_ids[:, 0, :].astype(mx.int32)
        delta = int(mx.array(deltas).reshape(-1)[0].item())
    mx.eval(positions, pixels)  # computed here: the engine thread runs on its own stream
    return ImagePrompt(tokens, spans, pixels, grids, positions, delta)


def _runs(tokens: list[int], token: int) -> list[tuple[int, int]]:
    """The (start, end) of each run of ``token`` in ``tokens``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
