"""A tiny random-weight Qwen2.5-VL model and a complete model folder that ``mlx_vlm.load``
accepts offline.

Built from mlx-vlm's own ``qwen2_5_vl`` classes with a small config: a language model of hidden
size 64 and 2 layers (M-RoPE sections 2, 3, 3 over its 16-wide heads), a vision tower of depth 2
with 8-pixel patches merged 2 by 2 (a 256x256 image is 256 image tokens). The tokenizer is the
tiny byte-level BPE of ``harness.tiny_model`` with Qwen's special tokens; the folder has a
Qwen2-VL image processor config and a chat template that places an image part as
``<|vision_start|><|image_pad|><|vision_end|>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map_with_path

from harness.tiny_model import SPECIALS, make_tiny_tokenizer, write_model_dir

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


def tiny_vlm_config() -> dict[str, Any]:
    """The config.json of the tiny Qwen2.5-VL (token ids from its tokenizer)."""
    tok = make_tiny_tokenizer(VISION_SPECIALS)
    ids = {t: tok.token_to_id(t) for t in VISION_SPECIALS}
    hidden = 64
    return {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": hidden, "num_hidden_layers": 2, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True), "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "vision_token_id": ids["<|vision_pad|>"],
        "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"],
        "vision_config": {
            "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
            "out_hidden_size": hidden, "num_heads": 2, "in_chans": 3, "in_channels": 3,
            "patch_size": PATCH, "spatial_patch_size": PATCH, "spatial_merge_size": MERGE,
            "temporal_patch_size": 2, "window_size": 4 * PATCH * MERGE,
            "fullatt_block_indexes": [1], "tokens_per_second": 2,
        },
    }


def preprocessor_config() -> dict[str, Any]:
    """The Qwen2-VL image processor config of the tiny model."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
        "min_pixels": (PATCH * MERGE) ** 2, "max_pixels": 512 * 512,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True,
    }


def make_tiny_vlm(seed: int = 0):
    """An mlx-vlm ``qwen2_5_vl.Model`` with seeded random float32 weights."""
    from mlx_vlm.models import qwen2_5_vl
    from mlx_vlm.utils import update_module_configs

    config = tiny_vlm_config()
    # as mlx_vlm.load builds it (from_dict puts the text config into ``config``)
    args = update_module_configs(qwen2_5_vl.ModelConfig.from_dict(config), qwen2_5_vl, config,
                                 ["text", "vision"])
    mx.random.seed(seed)
    model = qwen2_5_vl.Model(args)
    # As the tiny text model: weights scaled up (greedy answers then vary with the context,
    # with clear winners), norms at 1.
    model.update(tree_map_with_path(
        lambda path, w: mx.ones_like(w) if "norm" in path else w * 3.0, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tiny_vlm_dir(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL as a complete model folder (config, weights, tokenizer, image
    processor config, chat template) and return its path."""
    path = write_model_dir(path, make_tiny_vlm(seed), tiny_vlm_config(),
                           chat_template=CHAT_TEMPLATE, max_length=4096,
                           specials=VISION_SPECIALS)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=1))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path
