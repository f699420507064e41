"""Pieces shared by the tiny random-weight vision-language folders of each family
(``harness/tiny_qwen3_vl.py``, ``harness/tiny_llava.py``): an mlx-vlm model of a family built as
``mlx_vlm.load`` builds it, with seeded random weights, and a folder ``mlx_vlm.load`` reads
offline (config, weights, the tiny tokenizer with the family's special tokens, the processor's
config files, the chat template)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map_with_path

from harness.tiny_model import make_tiny_tokenizer, write_model_dir


def token_ids(specials: tuple[str, ...]) -> dict[str, Any]:
    """The tiny tokenizer's vocabulary size (``"vocab_size"``) and the id of each of
    ``specials``."""
    tok = make_tiny_tokenizer(specials)
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
            **{t: tok.token_to_id(t) for t in specials}}


def random_vlm(config: dict[str, Any], seed: int = 0, scale: float = 1.0):
    """mlx-vlm's model of ``config["model_type"]`` for ``config`` (its ``text_config`` and
    ``vision_config`` read as ``mlx_vlm.load`` reads them) with seeded random float32 weights:
    norms at 1, the rest times ``scale`` (as the tiny text model: greedy answers then vary with
    the context, with clear winners)."""
    from mlx_vlm.utils import update_module_configs

    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    config = json.loads(json.dumps(config))  # from_dict may change the dicts it reads
    args = update_module_configs(module.ModelConfig.from_dict(config), module, config,
                                 ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(args)
    model.update(tree_map_with_path(
        lambda path, w: mx.ones_like(w) if "norm" in path else w * scale, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def write_vlm_dir(path: str | Path, config: dict[str, Any], *, chat_template: str,
                  specials: tuple[str, ...], files: dict[str, dict[str, Any]], seed: int = 0,
                  scale: float = 1.0, max_length: int = 4096) -> Path:
    """A complete folder of :func:`random_vlm` of ``config``: weights, config, the tiny tokenizer
    with ``specials``, ``chat_template`` (in the tokenizer config and chat_template.json) and
    the processor's config ``files`` (name -> JSON); its path."""
    path = write_model_dir(path, random_vlm(config, seed, scale), config,
                           chat_template=chat_template, max_length=max_length, specials=specials)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=1))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))
    return path
