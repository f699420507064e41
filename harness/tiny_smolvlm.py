"""A tiny random-weight SmolVLM (or Idefics3) folder that ``mlx_vlm.load`` reads offline.

Built from mlx-vlm's own ``smolvlm`` (or ``idefics3``) classes with a small config: a llama-like
language model of hidden size 64 and 2 layers, a SigLIP vision tower of depth 2 over 32x32 tiles
in 8-pixel patches, pixel-shuffled 2 by 2 into 4 image tokens a tile. Idefics3's image
processor first brings a picture's longest edge to 64 pixels, then (splitting on) cuts it into
32x32 tiles and adds the whole picture squeezed to one tile, so a 96x64 picture is 2x2 tiles and
a global view: 5 runs of 4 ``<image>`` tokens, each after ``<fake_token_around_image>`` and a
``<row_r_col_c>`` (or ``<global-img>``) marker, rows ended by newlines. Without splitting a
picture is its global view alone. The tokenizer is the tiny byte-level BPE with these markers as
special tokens; the chat template places an image part as ``<image>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.tiny_model import SPECIALS
from harness.tiny_vlm import CHAT_TEMPLATE as QWEN_TEMPLATE
from harness.tiny_vlm_build import token_ids, write_vlm_dir

HIDDEN = 64
TILE, PATCH, SCALE = 32, 8, 2  # tile side and patch side in pixels; pixel-shuffle factor
TOKENS = (TILE // PATCH) ** 2 // SCALE ** 2  # image tokens a tile
LONGEST = 2 * TILE  # a picture's longest edge after the first resize
FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
SMOLVLM_SPECIALS = (*SPECIALS, FAKE, IMAGE, GLOBAL, "<end_of_utterance>",
                    *(f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)))
CHAT_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", IMAGE)


def tiny_smolvlm_config(model_type: str = "smolvlm") -> dict[str, Any]:
    """The config.json of the tiny SmolVLM (``model_type`` ``idefics3``: the tiny Idefics3),
    token ids from its tokenizer."""
    ids = token_ids(SMOLVLM_SPECIALS)
    ends = {"eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]}
    return {
        "model_type": model_type, "vocab_size": ids["vocab_size"], "scale_factor": SCALE,
        "architectures": [{"smolvlm": "SmolVLMForConditionalGeneration",
                           "idefics3": "Idefics3ForConditionalGeneration"}[model_type]],
        "image_token_id": ids[IMAGE], "tie_word_embeddings": False, **ends,
        "text_config": {
            "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": ids["vocab_size"], "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False},
        "vision_config": {
            "model_type": {"smolvlm": "smolvlm_vision", "idefics3": "idefics3"}[model_type],
            "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 2, "patch_size": PATCH, "image_size": TILE},
    }


def smolvlm_processor_files(splitting: bool = True) -> dict[str, dict[str, Any]]:
    """Idefics3's preprocessor_config.json (as SmolVLM's own, for the tiny tiles) and
    processor_config.json (the image tokens a tile)."""
    image = {
        "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
        "do_image_splitting": splitting, "max_image_size": {"longest_edge": TILE},
        "size": {"longest_edge": LONGEST}, "do_resize": True, "resample": 1,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True,
        "do_convert_rgb": True,
    }
    return {"preprocessor_config.json": image,
            "processor_config.json": {"image_seq_len": TOKENS,
                                      "processor_class": "Idefics3Processor"}}


def make_tiny_smolvlm_dir(path: str | Path, seed: int = 0, model_type: str = "smolvlm",
                          splitting: bool = True) -> Path:
    """Write the tiny SmolVLM (or Idefics3) as a complete model folder and return its path."""
    return write_vlm_dir(path, tiny_smolvlm_config(model_type), chat_template=CHAT_TEMPLATE,
                         specials=SMOLVLM_SPECIALS, files=smolvlm_processor_files(splitting),
                         seed=seed, scale=3.0)
