"""A tiny random-weight Gemma 3 vision-language model and a complete model folder that
``mlx_vlm.load`` accepts offline.

Built from mlx-vlm's own ``gemma3`` classes with a small config: a language model of hidden size
64 and 2 layers (the first attends within a sliding window of 12 positions, the second over
everything, as Gemma 3's layers alternate), a SigLIP vision tower of depth 2 over 32x32 images
in 4-pixel patches, pooled to 16 image tokens (``mm_tokens_per_image``; the real model has 256).
The tokenizer is the tiny byte-level BPE of ``harness.tiny_model`` with Gemma 3's image tokens;
the folder has Gemma 3's image processor and processor configs (so mlx-vlm builds its
``Gemma3Processor``, which writes an image as ``<start_of_image>``, its image tokens and
``<end_of_image>``) and a chat template that places an image part as ``<start_of_image>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map_with_path

from harness.tiny_model import SPECIALS, make_tiny_tokenizer, write_model_dir

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
GEMMA3_SPECIALS = (*SPECIALS, BOI, EOI, IMAGE)
IMAGE_SIZE, PATCH, TOKENS = 32, 4, 16  # pixels per side, pixels per patch side, tokens an image
WINDOW = 12  # the sliding window of the first layer
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '" + BOI + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_gemma3_config() -> dict[str, Any]:
    """The config.json of the tiny Gemma 3 (token ids from its tokenizer)."""
    tok = make_tiny_tokenizer(GEMMA3_SPECIALS)
    ids = {t: tok.token_to_id(t) for t in GEMMA3_SPECIALS}
    hidden, vocab = 64, tok.get_vocab_size(with_added_tokens=True)
    return {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "hidden_size": hidden, "vocab_size": vocab,
        "image_token_index": ids[IMAGE], "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI], "mm_tokens_per_image": TOKENS,
        "pad_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"]],
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": 2,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "query_pre_attn_scalar": 16, "vocab_size": vocab,
            "sliding_window": WINDOW, "sliding_window_pattern": 2,
            "rope_global_base_freq": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "mm_tokens_per_image": TOKENS, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6},
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
            "intermediate_size": 64, "num_attention_heads": 2, "patch_size": PATCH,
            "image_size": IMAGE_SIZE, "num_channels": 3, "layer_norm_eps": 1e-6},
    }


def preprocessor_config() -> dict[str, Any]:
    """Gemma 3's image processor config, at the tiny model's image size."""
    return {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "image_seq_length": TOKENS, "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": None, "do_pan_and_scan": None,
    }


def make_tiny_gemma3(seed: int = 0, scale: float = 3.0):
    """The tiny Gemma 3 (mlx-vlm's ``gemma3.Model``) with seeded random float32 weights (norms
    as mlx-vlm makes them; the rest times ``scale``, so greedy answers vary with the context)."""
    from mlx_vlm.models import gemma3
    from mlx_vlm.utils import update_module_configs

    config = tiny_gemma3_config()
    args = update_module_configs(gemma3.ModelConfig.from_dict(config), gemma3, config,
                                 ["text", "vision"])
    mx.random.seed(seed)
    model = gemma3.Model(args)
    model.update(tree_map_with_path(
        lambda path, w: w if "norm" in path else w * scale, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tiny_gemma3_dir(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 3 as a complete model folder and return its path."""
    config = tiny_gemma3_config()
    path = write_model_dir(path, make_tiny_gemma3(seed), config, chat_template=CHAT_TEMPLATE,
                           max_length=4096, specials=GEMMA3_SPECIALS)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["extra_special_tokens"] = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=1))
    (path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS}, indent=1))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path
