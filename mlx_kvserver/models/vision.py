"""Vision-language models: which folders are one, loading them through mlx-vlm, and the face
their language model shows the engine.

A folder is a vision-language model when its ``config.json`` names a model type mlx-vlm has a
model for and either has a ``vision_config`` or is a type mlx-lm does not have (mlx-lm loads the
language part of a few vision families, e.g. a text-only ``qwen3_5``; those stay with it).
mlx-vlm's model is a vision tower and projector whose features replace the image placeholder
tokens' embeddings, and a language model that takes an mlx-lm-like cache list: the paged layer
caches sit under it as under an mlx-lm model (``kv_cache.hooks.install`` routes its attention).

:class:`VisionLanguageModel` is what the engine runs: ``model(inputs, cache=caches)`` gives the
language model's logits for text tokens. Families with M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL:
their language model has ``get_rope_index``) are given their positions explicitly: for text
alone the three position ids of a token all equal its index, so they follow the cache's offsets
(one per row in a batch) exactly as a text model's rotary positions do. Left to itself, mlx-vlm's
language model keeps the positions of the last prompt it saw on the model object and reuses them
for the next one, which is wrong for a server that interleaves requests.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .image_families import READERS, reader_of
from .image_preprocessing import keep_image_outputs


def _has_module(package: str, name: str) -> bool:
    """Whether ``package.name`` exists (found on disk; nothing of it is imported)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and any(
        (Path(d) / name).is_dir() or (Path(d) / f"{name}.py").is_file()
        for d in spec.submodule_search_locations or ())


def vision_family(config: dict[str, Any]) -> str | None:
    """The mlx-vlm model type of a model whose ``config.json`` is ``config``, when it is a
    vision-language model mlx-vlm loads (module docstring); None for a text model."""
    vision = isinstance(config.get("vision_config"), dict)
    if not vision and _has_module("mlx_lm.models", str(config.get("model_type") or "")):
        return None  # a text model: mlx-vlm (and all it imports) is not loaded for it
    from mlx_vlm.utils import get_model_type

    model_type = get_model_type(config)
    return model_type if model_type and _has_module("mlx_vlm.models", model_type) else None


# The families whose images are read here: those with a reader (``image_families/``), each
# proven exact with the cache on and off by its test. A family's images follow its own rules
# (Qwen2.5-VL's M-RoPE positions and their delta after an image, ...), so any other vision
# family is served for text only: an image to it is refused (400) rather than answered wrongly.
IMAGE_FAMILIES = frozenset(READERS)


def reads_images(family: str | None) -> bool:
    """Whether images sent to a model of ``family`` are read (:data:`IMAGE_FAMILIES`)."""
    return family in IMAGE_FAMILIES


def folder_family(path: Path) -> str | None:
    """:func:`vision_family` of the folder ``path`` (None without a readable config.json)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return vision_family(config) if isinstance(config, dict) else None


class VisionLanguageModel(nn.Module):
    """An mlx-vlm model as the engine runs it: ``model(inputs, cache=caches)`` -> the language
    model's logits ``[B, L, vocab]``; ``layers`` and ``args`` are its language model's. The whole
    mlx-vlm model (``vlm``: vision tower, projector, language model) is its one child, so its
    parameters are all the weights the model holds."""

    def __init__(self, vlm: nn.Module, family: str):
        super().__init__()
        self.vlm = vlm
        self.family = family
        self.reader = reader_of(family)  # how its images are read (None: text only)
        lm = vlm.language_model
        self._mrope = hasattr(lm, "get_rope_index")
        if hasattr(lm, "make_cache"):  # mlx-lm's make_prompt_cache asks the model for its caches
            self.make_cache = lambda: [as_mlx_lm_cache(c) for c in lm.make_cache()]

    @property
    def language_model(self) -> nn.Module:
        return self.vlm.language_model

    @property
    def layers(self) -> list:
        return self.vlm.language_model.layers

    @property
    def args(self) -> Any:
        lm = self.vlm.language_model
        return getattr(lm, "args", None) or getattr(lm, "config", None)

    def __call__(self, inputs: mx.array, cache: list | None = None,
                 rope_deltas: mx.array | None = None, **kwargs: Any) -> mx.array:
        """``rope_deltas``: each row's position offset past its text (``image_prompt.py``: a
        sequence after an image); ``position_ids`` and ``inputs_embeds`` (a prompt piece with
        images, ``ImagePrompt.inputs``) go to the language model as they are."""
        if self._mrope and "position_ids" not in kwargs:
            kwargs["position_ids"] = text_positions(inputs, cache, rope_deltas)
        out = self.vlm.language_model(inputs, cache=cache, **kwargs)
        return getattr(out, "logits", out)


def as_mlx_lm_cache(cache: Any) -> Any:
    """mlx-lm's cache of the same kind as mlx-vlm's ``cache`` (a full, sliding-window or
    recurrent-state layer: what the cache spec is read from, ``kv_cache.spec_of_model``); any
    other kind as it is (the spec reader names it when it refuses it)."""
    from mlx_lm.models import cache as lm_cache

    kind = type(cache).__name__
    if kind == "KVCache":
        return lm_cache.KVCache()
    if kind == "RotatingKVCache":
        return lm_cache.RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    if kind == "ArraysCache":
        return lm_cache.ArraysCache(len(cache.cache))
    return cache


def text_positions(inputs: mx.array, cache: list | None,
                   deltas: mx.array | None = None) -> mx.array:
    """M-RoPE position ids ``[3, B, L]`` of text tokens ``inputs [B, L]`` after what ``cache``
    holds: each row's offset (one for all rows, or one per row in a batch) plus the token's
    index, plus the row's delta where ``deltas`` gives one (its text after an image), the same
    in all three sections."""
    B, L = inputs.shape[:2]
    c0 = cache[0] if cache else None
    offset = getattr(c0, "offset", 0) if c0 is not None else 0
    start = offset.reshape(-1, 1) if isinstance(offset, mx.array) else mx.array([[int(offset)]])
    if deltas is not None:
        start = start + deltas.reshape(-1, 1)
    pos = mx.broadcast_to(start.astype(mx.int32) + mx.arange(L, dtype=mx.int32)[None], (B, L))
    return mx.broadcast_to(pos[None], (3, B, L))


_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                    "video_preprocessor_config.json")


def load_vision_folder(path: Path, family: str
                       ) -> tuple[VisionLanguageModel, Any, list[int], dict[str, Any]]:
    """The model of the folder ``path`` (its :func:`vision_family` is ``family``) loaded through
    mlx-vlm, with its processor (images to pixel values and their token counts; its
    ``tokenizer`` is the model's Hugging Face tokenizer, chat template included; for a family
    with a ``join``, each image's output kept by its pixel digest: ``image_preprocessing.py``),
    its end token ids, and its config: ``config.json`` with generation_config.json's end tokens (as mlx-lm
    reads it) and, under ``"processor_files"``, the processor's configs (how an image becomes
    tokens is part of what the model's fingerprint covers)."""
    from mlx_lm.utils import load_config
    from mlx_vlm.utils import load as vlm_load

    vlm, processor = vlm_load(str(path))
    config = load_config(path)
    config["processor_files"] = {f: json.loads((path / f).read_text())
                                 for f in _PROCESSOR_FILES if (path / f).is_file()}
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    tok = getattr(processor, "tokenizer", processor)
    if eos is None:
        eos = getattr(tok, "eos_token_id", None)
    ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    model = VisionLanguageModel(vlm, family)
    if model.reader is not None:  # each image's processor output kept by its digest
        keep_image_outputs(processor, model.reader.join)
    return model, processor, ids, config


def listing_fields(takes_images: bool) -> dict[str, Any]:
    """What ``/v1/models`` says of a model's inputs: LM Studio's ``capabilities.vision`` (read by
    chat apps and agents that ask a local server whether a model sees images) and OpenRouter's
    ``input_modalities``."""
    return {"capabilities": {"vision": takes_images},
            "input_modalities": ["text", "image"] if takes_images else ["text"]}
