"""A tiny random-weight Qwen2.5-VL model and a complete model folder that ``mlx_vlm.load``
accepts offline.

Built from mlx-vlm's own ``qwen2_5_vl`` classes with a small config: a language model of hidden
size 64 and 2 layers (M-RoPE sections 2, 3, 3 over its 16-wide heads), a vision tower of depth 2
with 8-pixel patches merged 2 by 2 (a 256x256 image is 256 image tokens). The tokenizer is the
tiny byte-level BPE of ``harness.tiny_model`` with Qwen's special tokens; the folder has a
Qwen2-VL image processor config and a chat template that places an image part as
``<|vision_start|><|image_pad|><|vision_end|>``.

``make_vlm_dir`` writes any Qwen2.5-VL config the same way, e.g. ``qwen25_vl_3b_config``:
Qwen2.5-VL-3B-Instruct's shape with some of its layers (``benchmarks/vision.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.tiny_model import SPECIALS
from harness.tiny_vlm_build import random_vlm, token_ids, write_vlm_dir

VISION_SPECIALS = (*SPECIALS, "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                   "<|image_pad|>", "<|video_pad|>")
PATCH = 8  # pixels per side of a vision patch
MERGE = 2  # patches per side merged into one image token
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def vlm_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL config.json: the language model's ``text`` fields and the ``vision`` tower's,
    with the vocabulary and token ids of the tiny tokenizer."""
    ids = token_ids(VISION_SPECIALS)
    return {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "rms_norm_eps": 1e-6, "vocab_size": ids["vocab_size"],
        "tie_word_embeddings": False, **text,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "vision_token_id": ids["<|vision_pad|>"],
        "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"],
        "vision_config": {"model_type": "qwen2_5_vl", "in_chans": 3, "in_channels": 3,
                          "temporal_patch_size": 2, "tokens_per_second": 2, **vision},
    }


def tiny_vlm_config() -> dict[str, Any]:
    """The config.json of the tiny Qwen2.5-VL (token ids from its tokenizer)."""
    hidden = 64
    return vlm_config(
        {"hidden_size": hidden, "num_hidden_layers": 2, "intermediate_size": 2 * hidden,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
         "max_position_embeddings": 4096,
         "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": hidden,
         "num_heads": 2, "patch_size": PATCH, "spatial_patch_size": PATCH,
         "spatial_merge_size": MERGE, "window_size": 4 * PATCH * MERGE,
         "fullatt_block_indexes": [1]})


def qwen25_vl_3b_config(layers: int = 36, vision_depth: int = 32,
                        full_attention: bool = True) -> dict[str, Any]:
    """The config.json of Qwen2.5-VL-3B-Instruct's shape (its widths, heads, M-RoPE sections,
    14-pixel patches merged 2 by 2, 112-pixel attention windows) with the first ``layers`` of
    its 36 language layers and ``vision_depth`` of its 32 vision blocks; the tiny tokenizer's
    vocabulary. The vision tower attends over the whole image in every eighth block (the last of
    each 8, as the real model's blocks 7, 15, 23, 31), or, without ``full_attention``, only
    inside its windows."""
    full = list(range(7, vision_depth, 8)) or [vision_depth - 1]
    return vlm_config(
        {"hidden_size": 2048, "num_hidden_layers": layers, "intermediate_size": 11008,
         "num_attention_heads": 16, "num_key_value_heads": 2, "rope_theta": 1000000.0,
         "max_position_embeddings": 128000,
         "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        {"depth": vision_depth, "hidden_size": 1280, "intermediate_size": 3420,
         "out_hidden_size": 2048, "num_heads": 16, "patch_size": 14, "spatial_patch_size": 14,
         "spatial_merge_size": 2, "window_size": 112,
         "fullatt_block_indexes": full if full_attention else []})


def preprocessor_config(patch: int = PATCH, merge: int = MERGE, min_pixels: int | None = None,
                        max_pixels: int = 512 * 512) -> dict[str, Any]:
    """A Qwen2-VL image processor config (by default the tiny model's; Qwen2.5-VL's own is
    ``preprocessor_config(14, 2, 3136, 12845056)``)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": patch, "merge_size": merge, "temporal_patch_size": 2,
        "min_pixels": min_pixels or (patch * merge) ** 2, "max_pixels": max_pixels,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True,
    }


def make_tiny_vlm(seed: int = 0):
    """The tiny Qwen2.5-VL with seeded random float32 weights."""
    # As the tiny text model: weights scaled up (greedy answers then vary with the context,
    # with clear winners).
    return random_vlm(tiny_vlm_config(), seed, scale=3.0)


def make_vlm_dir(path: str | Path, config: dict[str, Any], preprocessor: dict[str, Any],
                 seed: int = 0, scale: float = 1.0) -> Path:
    """Write a Qwen2.5-VL of ``config`` with random weights (``random_vlm``) as a complete model
    folder (config, weights, tokenizer, image processor config ``preprocessor``, chat template)
    and return its path."""
    return write_vlm_dir(path, config, chat_template=CHAT_TEMPLATE, specials=VISION_SPECIALS,
                         files={"preprocessor_config.json": preprocessor}, seed=seed,
                         scale=scale, max_length=config["max_position_embeddings"])


def make_tiny_vlm_dir(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL as a complete model folder and return its path."""
    return make_vlm_dir(path, tiny_vlm_config(), preprocessor_config(), seed, scale=3.0)
