"""A tiny random-weight llama model and a complete MLX model folder (no network).

The tokenizer is a byte-level BPE trained in-process on a few sentences (256 byte tokens, three
ChatML specials and a few dozen merges), so any text round-trips, including multi-byte UTF-8.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
_CORPUS = [
    "The capital of France is Paris.",
    "Hello world, hello there! How are you today?",
    "héllo wörld, naïve café, 🙂 smile",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "You are a helpful assistant. user assistant system",
] * 4


@functools.lru_cache(maxsize=4)
def _tokenizer_json(specials: tuple[str, ...] = tuple(SPECIALS)) -> str:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_CORPUS, trainer=trainer)
    return tk.to_str()


def make_tiny_tokenizer(specials: tuple[str, ...] = tuple(SPECIALS)) -> Tokenizer:
    """A fresh copy of the tiny byte-level BPE tokenizer (``tokenizers.Tokenizer``), with
    ``specials`` as its first tokens."""
    return Tokenizer.from_str(_tokenizer_json(tuple(specials)))


def tiny_vocab_size() -> int:
    """Number of tokens of the tiny tokenizer (the tiny model's default vocab)."""
    return make_tiny_tokenizer().get_vocab_size(with_added_tokens=True)


def tiny_config(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int | None = None) -> dict[str, Any]:
    """The config.json of the tiny model."""
    return {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
        "vocab_size": vocab or tiny_vocab_size(), "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
    }


def make_tiny_model(seed: int = 0, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, vocab: int | None = None) -> llama.Model:
    """An mlx-lm ``llama.Model`` with seeded random float32 weights."""
    cfg = tiny_config(num_layers, hidden, heads, kv_heads, vocab)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # A separate output head and weights scaled up make greedy answers vary with the context
    # (tied, small random weights just repeat the last token), with clear winners.
    model.update(tree_map(lambda w: w * 3.0, model.parameters()))
    for layer in model.model.layers:  # norms stay at 1
        layer.input_layernorm.weight = mx.ones_like(layer.input_layernorm.weight)
        layer.post_attention_layernorm.weight = mx.ones_like(layer.post_attention_layernorm.weight)
    model.model.norm.weight = mx.ones_like(model.model.norm.weight)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def write_model_dir(path: str | Path, model, config: dict[str, Any], *,
                    chat_template: str = CHAT_TEMPLATE, max_length: int = 2048,
                    specials: tuple[str, ...] = tuple(SPECIALS)) -> Path:
    """Write ``model`` with ``config`` and the tiny tokenizer (with ``specials``) as a complete
    MLX model folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (path / "tokenizer.json").write_text(_tokenizer_json(tuple(specials)))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": chat_template,
        "model_max_length": max_length, "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    return path


def make_tiny_model_dir(path: str | Path, seed: int = 0, *, chat_template: str = CHAT_TEMPLATE,
                        **model_kw: Any) -> Path:
    """Write a complete MLX model folder (config, weights, tokenizer) and return its path."""
    keys = ("num_layers", "hidden", "heads", "kv_heads", "vocab")
    cfg = tiny_config(**{k: model_kw[k] for k in keys if k in model_kw})
    return write_model_dir(path, make_tiny_model(seed, **model_kw), cfg,
                           chat_template=chat_template)
