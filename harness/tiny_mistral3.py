"""A tiny random-weight Mistral 3 (Mistral-Small-3.x's family) or Pixtral folder that
``mlx_vlm.load`` reads offline.

Built from mlx-vlm's own ``mistral3`` (or ``pixtral``) classes with a small config: a Mistral
language model of hidden size 64 and 2 layers, a Pixtral vision tower of depth 2 in 8-pixel
patches (2D rotary positions up to 96x96 pixels); Mistral 3's projector merges 2x2 patches into
one image token (Pixtral's takes each patch). The image processor brings a picture's longest
edge to at most 96 pixels and its sides up to multiples of a token's pixels, so a 96x64 picture
is 4 rows of 6 ``[IMG]`` tokens for Mistral 3, each row but the last followed by
``[IMG_BREAK]`` and the picture closed by ``[IMG_END]``. The tokenizer is the tiny byte-level BPE
with these three as special tokens; the chat template places an image part as ``[IMG]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.tiny_model import SPECIALS
from harness.tiny_vlm import CHAT_TEMPLATE as QWEN_TEMPLATE
from harness.tiny_vlm_build import token_ids, write_vlm_dir

HIDDEN, PATCH, MERGE, LONGEST = 64, 8, 2, 96
IMG, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
MISTRAL3_SPECIALS = (*SPECIALS, IMG, BREAK, END)
CHAT_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", IMG)


def tiny_mistral3_config(model_type: str = "mistral3") -> dict[str, Any]:
    """The config.json of the tiny Mistral 3 (``model_type`` ``pixtral``: the tiny Pixtral),
    token ids from its tokenizer."""
    ids = token_ids(MISTRAL3_SPECIALS)
    ends = {"eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]}
    merger = {"spatial_merge_size": MERGE, "multimodal_projector_bias": False}
    return {
        "model_type": model_type, "vocab_size": ids["vocab_size"],
        "architectures": [{"mistral3": "Mistral3ForConditionalGeneration",
                           "pixtral": "LlavaForConditionalGeneration"}[model_type]],
        "image_token_index": ids[IMG], "vision_feature_layer": -1, **ends,
        **(merger if model_type == "mistral3" else {}),
        "text_config": {
            "model_type": "mistral", "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "intermediate_size": 2 * HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": ids["vocab_size"],
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": False},
        "vision_config": {
            "model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 2,
            "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16,
            "image_size": LONGEST, "patch_size": PATCH, "rope_theta": 10000.0},
    }


def mistral3_processor_files(model_type: str = "mistral3") -> dict[str, dict[str, Any]]:
    """Pixtral's preprocessor_config.json and processor_config.json (as Mistral-Small-3.1's,
    for the tiny patches)."""
    merge = MERGE if model_type == "mistral3" else 1
    image = {
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "patch_size": {"height": PATCH, "width": PATCH}, "size": {"longest_edge": LONGEST},
        "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
    }
    return {"preprocessor_config.json": image,
            "processor_config.json": {
                "processor_class": "PixtralProcessor", "patch_size": PATCH,
                "spatial_merge_size": merge, "image_token": IMG, "image_break_token": BREAK,
                "image_end_token": END}}


def make_tiny_mistral3_dir(path: str | Path, seed: int = 0, model_type: str = "mistral3"
                           ) -> Path:
    """Write the tiny Mistral 3 (or Pixtral) as a complete model folder and return its path."""
    return write_vlm_dir(path, tiny_mistral3_config(model_type), chat_template=CHAT_TEMPLATE,
                         specials=MISTRAL3_SPECIALS, files=mistral3_processor_files(model_type),
                         seed=seed, scale=3.0)
