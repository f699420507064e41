"""A tiny random-weight LLaVA folder that ``mlx_vlm.load`` reads offline.

Built from mlx-vlm's own ``llava`` classes with a small config: a Llama language model of hidden
size 64 and 2 layers, a CLIP vision tower of 3 layers over 48x48 pictures in 8-pixel patches
(its second-to-last layer's patch states, the class token dropped: the ``default`` feature
strategy), and LLaVA's two-layer projector, so every picture is 36 image tokens. The tokenizer
is the tiny byte-level BPE with ``<image>`` as a special token; the folder has a
CLIPImageProcessor config (resize to 48 pixels on the short side, centre crop 48x48) and the
LlavaProcessor's processor_config.json (patch size, feature strategy, the class token), and the
chat template of the tiny Qwen2.5-VL with ``<image>`` for an image part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.tiny_model import SPECIALS
from harness.tiny_vlm import CHAT_TEMPLATE as QWEN_CHAT_TEMPLATE
from harness.tiny_vlm_build import token_ids, write_vlm_dir

LLAVA_SPECIALS = (*SPECIALS, "<image>")
CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                           "<image>")
IMAGE = 48  # pixels per side of the vision tower's input
PATCH = 8
HIDDEN = 64
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def tiny_llava_config() -> dict[str, Any]:
    """The config.json of the tiny LLaVA (token ids from its tokenizer)."""
    ids = token_ids(LLAVA_SPECIALS)
    ends = {"eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]}
    return {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "vocab_size": ids["vocab_size"], "image_token_index": ids["<image>"],
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu", "tie_word_embeddings": False, **ends,
        "text_config": {
            "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": ids["vocab_size"], "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, **ends},
        "vision_config": {
            "model_type": "clip_vision_model", "num_hidden_layers": 3, "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "image_size": IMAGE,
            "patch_size": PATCH, "projection_dim": 32, "num_channels": 3,
            "layer_norm_eps": 1e-5},
    }


def llava_processor_files() -> dict[str, dict[str, Any]]:
    """The CLIPImageProcessor's preprocessor_config.json and the LlavaProcessor's
    processor_config.json of the tiny LLaVA."""
    image = {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": IMAGE}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": IMAGE, "width": IMAGE},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True,
    }
    processor = {"processor_class": "LlavaProcessor", "image_token": "<image>",
                 "patch_size": PATCH, "vision_feature_select_strategy": "default",
                 "num_additional_image_tokens": 1}
    return {"preprocessor_config.json": image, "processor_config.json": processor}


def make_tiny_llava_dir(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny LLaVA as a complete model folder and return its path."""
    return write_vlm_dir(path, tiny_llava_config(), chat_template=CHAT_TEMPLATE,
                         specials=LLAVA_SPECIALS, files=llava_processor_files(), seed=seed,
                         scale=3.0)
