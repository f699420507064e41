"""Tiny random-weight model folders whose tokenizer and chat template are a real family's
(Qwen3's thinking template with ``<think>``/``<tool_call>`` tokens, ...): what the server's chat
features run on in tests, with no network."""

from __future__ import annotations

import json
from pathlib import Path

from tests.chat.templates import _SPECS
from harness.tiny_families import make_tiny_family_model, tiny_family_config
from harness.tiny_model import make_tiny_model, tiny_config, write_model_dir


def make_tiny_chat_model_dir(path: str | Path, family: str, seed: int = 0,
                             template: str | None = None, model_type: str = "llama") -> Path:
    """A complete MLX model folder: a tiny ``model_type`` model (the llama, or one of
    :mod:`harness.tiny_families`) with ``family``'s tokens and template; a family with several end
    tokens lists them in ``generation_config.json`` (as gpt-oss does)."""
    from tests.chat.templates import EXTRA_EOS, make_chat_tokenizer

    tok = make_chat_tokenizer(family, template)
    vocab = len(tok.hf)
    if model_type == "llama":
        cfg, model = tiny_config(vocab=vocab), make_tiny_model(seed, vocab=vocab)
    else:
        cfg = tiny_family_config(model_type, vocab)
        model = make_tiny_family_model(model_type, seed, vocab=vocab)
    path = write_model_dir(path, model, cfg, chat_template=tok.chat_template)
    (path / "tokenizer.json").write_text(tok.hf.backend_tokenizer.to_str())
    tpl, added, special, bos, eos = _SPECS[family]
    cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.update({"eos_token": eos, "bos_token": bos})
    cfg_path.write_text(json.dumps(tok_cfg, indent=1))
    if family in EXTRA_EOS:
        ends = [tok.hf.convert_tokens_to_ids(t) for t in (eos, *EXTRA_EOS[family])]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return path
