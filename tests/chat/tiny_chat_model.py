"""Tiny random-weight model folders whose tokenizer and chat template are a real family's
(Qwen3's thinking template with ``<think>``/``<tool_call>`` tokens, ...): what the server's chat
features run on in tests, with no network."""

from __future__ import annotations

import json
from pathlib import Path

from tests.chat.templates import _SPECS
from tests.tiny_model import make_tiny_model, tiny_config, write_model_dir


def make_tiny_chat_model_dir(path: str | Path, family: str, seed: int = 0,
                             template: str | None = None) -> Path:
    """A complete MLX model folder: the tiny llama with ``family``'s tokens and template."""
    from tests.chat.templates import make_chat_tokenizer

    tok = make_chat_tokenizer(family, template)
    vocab = len(tok.hf)
    cfg = tiny_config(vocab=vocab)
    path = write_model_dir(path, make_tiny_model(seed, vocab=vocab), cfg,
                           chat_template=tok.chat_template)
    (path / "tokenizer.json").write_text(tok.hf.backend_tokenizer.to_str())
    tpl, added, special, bos, eos = _SPECS[family]
    cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.update({"eos_token": eos, "bos_token": bos})
    cfg_path.write_text(json.dumps(tok_cfg, indent=1))
    return path
