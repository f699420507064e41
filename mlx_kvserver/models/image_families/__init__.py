"""How each vision-language family's images become tokens, features and embeddings: one module
per family (``qwen_vl.py``, ...), each an :class:`~.base.ImageFamily` registered here by the
mlx-vlm model types it reads. A family not listed is served for text only (``models/vision.py``).
"""

from __future__ import annotations

from .base import ImageFamily, ImageInput
from .gemma3 import Gemma3
from .idefics3 import Idefics3
from .llava import Llava
from .mistral3 import Mistral3
from .qwen3_vl import Qwen3VL
from .qwen_vl import QwenVL

READERS: dict[str, ImageFamily] = {}
for _family in (QwenVL(), Qwen3VL(), Llava(), Idefics3(), Gemma3(), Mistral3()):
    for _name in _family.model_types:
        READERS[_name] = _family


def reader_of(model_type: str | None) -> ImageFamily | None:
    """The :class:`ImageFamily` that reads images for mlx-vlm's ``model_type`` (None: none)."""
    return READERS.get(model_type or "")


__all__ = ["READERS", "ImageFamily", "ImageInput", "reader_of"]
