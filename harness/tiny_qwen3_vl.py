"""A tiny random-weight Qwen3-VL folder that ``mlx_vlm.load`` reads offline.

Built from mlx-vlm's own ``qwen3_vl`` classes with a small config: a language model of hidden
size 64 and 3 layers (interleaved M-RoPE sections 2, 3, 3 over its 16-wide heads), a vision tower
of depth 3 with 8-pixel patches merged 2 by 2 whose blocks 0 and 1 give deepstack features (added
to the image tokens' hidden states after language layers 0 and 1; layer 2 has none), so a 96x64
picture is 24 image tokens. The tokenizer is the tiny byte-level BPE with Qwen's vision special
tokens; the folder has Qwen3-VL's image and video processor configs (``size`` as its
``shortest_edge``/``longest_edge`` pixel bounds) and the chat template of the tiny Qwen2.5-VL
(an image as ``<|vision_start|><|image_pad|><|vision_end|>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.tiny_vlm import CHAT_TEMPLATE, MERGE, PATCH, VISION_SPECIALS
from harness.tiny_vlm_build import token_ids, write_vlm_dir

HIDDEN = 64


def tiny_qwen3_vl_config() -> dict[str, Any]:
    """The config.json of the tiny Qwen3-VL (token ids from its tokenizer)."""
    ids = token_ids(VISION_SPECIALS)
    ends = {"eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]}
    return {
        "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
        "vocab_size": ids["vocab_size"], "tie_word_embeddings": False, **ends,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "text_config": {
            "model_type": "qwen3_vl_text", "hidden_size": HIDDEN, "num_hidden_layers": 3,
            "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": ids["vocab_size"],
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
            "tie_word_embeddings": False, "hidden_act": "silu", **ends},
        "vision_config": {
            "model_type": "qwen3_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 64,
            "out_hidden_size": HIDDEN, "num_heads": 2, "in_channels": 3, "patch_size": PATCH,
            "spatial_merge_size": MERGE, "temporal_patch_size": 2,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
    }


def qwen3_vl_processor_files(max_pixels: int = 512 * 512) -> dict[str, dict[str, Any]]:
    """Qwen3-VL's preprocessor_config.json and video_preprocessor_config.json for the tiny
    model's patches (their pixel bounds under ``size``, as Qwen3-VL's own)."""
    image = {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
        "size": {"shortest_edge": (PATCH * MERGE) ** 2, "longest_edge": max_pixels},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True,
    }
    video = {**image, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2,
             "min_frames": 4, "max_frames": 16}
    del video["image_processor_type"]
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def make_tiny_qwen3_vl_dir(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3-VL as a complete model folder and return its path."""
    return write_vlm_dir(path, tiny_qwen3_vl_config(), chat_template=CHAT_TEMPLATE,
                         specials=VISION_SPECIALS, files=qwen3_vl_processor_files(), seed=seed,
                         scale=3.0)
