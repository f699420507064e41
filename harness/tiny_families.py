"""Tiny random-weight models of the model families mlx-lm runs, built from mlx-lm's own code.

Each family keeps the features that decide how its cache looks, at toy size (hidden 64, 2-6
layers, the tiny tokenizer's vocabulary):

- ``llama``, ``qwen3``: full attention only (``KVCache`` per layer);
- ``gemma3_text``, ``gpt_oss``: sliding-window layers (``RotatingKVCache``, a window of
  :data:`SLIDING_WINDOW` tokens, so a few chat turns outgrow it) mixed with global layers;
  gpt_oss with its yarn rope and a few experts;
- ``gemma4_text``: sliding and global layers of different head sizes, proportional rope on the
  global ones, per-layer inputs, and KV-shared layers (the last layers reuse an earlier layer's
  keys and values, so ``make_cache`` returns fewer caches than there are layers);
- ``qwen3_5`` (gated-delta linear attention), ``lfm2`` (short convolutions), ``nemotron_h``
  (mamba2 mixers and an MLP-only layer): recurrent layers (``ArraysCache``) mixed with attention
  layers (``KVCache``); nemotron_h's MLP layer has no cache, so again fewer caches than layers.

:func:`make_tiny_family_dir` writes a model folder that ``mlx_lm.utils.load`` (and so
``mlx_kvserver.models.load_folder`` and the server's ``--model PATH``) loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes

from harness.tiny_model import CHAT_TEMPLATE, tiny_config, tiny_vocab_size, write_model_dir

FAMILIES = ("llama", "qwen3", "gemma3_text", "gpt_oss", "gemma4_text", "qwen3_5", "lfm2",
            "nemotron_h")
SLIDING_WINDOW = 16  # tokens; a 4-turn chat of the tests is several windows long
HIDDEN = 64
CONTEXT = 4096
# How much the random weights are scaled, by the first substring of a parameter's path that
# matches; the rest: matrices (projections, embeddings, heads, conv kernels) 3x, vectors (norms,
# biases, state decay and step parameters, attention sinks) as the model code initialises them.
# Chosen by looking at greedy answers: different prompts differ from the first tokens on, an
# edited earlier message changes the answer, a 4-turn chat does not fall into repeating one
# token. lfm2 at 3x gave one answer for every prompt (its MLPs drown the attention layers).
_SCALES: dict[str, dict[str, float]] = {
    "qwen3_5": {"mlp": 2.0},
    # q/k norms 2x: sharper attention (lfm2 normalises queries and keys, so their projections'
    # scale does not matter).
    "lfm2": {"q_layernorm": 2.0, "k_layernorm": 2.0, "feed_forward": 1.0, "self_attn": 4.0,
             "*": 2.0},
}


def tiny_family_config(model_type: str, vocab: int | None = None) -> dict[str, Any]:
    """The config.json of the tiny ``model_type`` model (one of :data:`FAMILIES`)."""
    vocab = vocab or tiny_vocab_size()
    attn = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    common = {"model_type": model_type, "hidden_size": HIDDEN, "vocab_size": vocab,
              "max_position_embeddings": CONTEXT}
    if model_type == "llama":
        return dict(tiny_config(num_layers=2, hidden=HIDDEN, vocab=vocab),
                    max_position_embeddings=CONTEXT)
    if model_type == "qwen3":
        return {**common, **attn, "num_hidden_layers": 2, "intermediate_size": 128,
                "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
    if model_type == "gemma3_text":  # layers: sliding, global, sliding, global
        return {**common, **attn, "num_hidden_layers": 4, "intermediate_size": 128,
                "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                "query_pre_attn_scalar": 16, "sliding_window": SLIDING_WINDOW,
                "sliding_window_pattern": 2, "rope_scaling": {"rope_type": "linear",
                                                              "factor": 8.0}}
    if model_type == "gpt_oss":  # layers: sliding, full, sliding, full
        return {**common, **attn, "num_hidden_layers": 4, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
                "sliding_window": SLIDING_WINDOW, "rope_theta": 150000,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096},
                "layer_types": ["sliding_attention", "full_attention"] * 2}
    if model_type == "gemma4_text":
        # Layers 0-3 own their KV (sliding 16-dim heads, global 32-dim heads); layers 4 and 5
        # are KV-shared: they reuse layer 3's (sliding) and layer 2's (global) keys and values.
        return {**common, "num_hidden_layers": 6, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "global_head_dim": 32, "num_kv_shared_layers": 2,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
                "sliding_window": SLIDING_WINDOW, "hidden_size_per_layer_input": 16,
                "vocab_size_per_layer_input": vocab, "rms_norm_eps": 1e-6,
                "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
                "rope_parameters": {
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                       "rope_type": "proportional"},
                    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 1e4,
                                          "rope_type": "default"}}}
    if model_type == "qwen3_5":  # layers: linear (gated delta), full, linear, full
        return {**common, **attn, "num_hidden_layers": 4, "intermediate_size": 128,
                "rms_norm_eps": 1e-6, "full_attention_interval": 2,
                "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
                "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1],
                                    "rope_theta": 1e5, "partial_rotary_factor": 0.25}}
    if model_type == "lfm2":  # layers: conv, attention, conv, attention
        return {**common, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "norm_eps": 1e-5, "conv_bias": False,
                "conv_L_cache": 3, "block_dim": HIDDEN, "block_ff_dim": 128,
                "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
                "block_auto_adjust_ff_dim": False, "rope_theta": 1e6,
                "layer_types": ["conv", "full_attention", "conv", "full_attention"]}
    if model_type == "nemotron_h":  # layers: mamba2, attention, mamba2, MLP (no cache)
        return {**common, **attn, "intermediate_size": 128, "attention_bias": False,
                "hybrid_override_pattern": ["M", "*", "M", "-"], "mamba_num_heads": 4,
                "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
                "conv_kernel": 4, "n_groups": 2, "mlp_bias": False,
                "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True}
    raise ValueError(f"no tiny config for model type {model_type!r}; have {FAMILIES}")


def _scale(model_type: str, path: str, ndim: int) -> float:
    rules = _SCALES.get(model_type, {})
    match = next((v for k, v in rules.items() if k != "*" and k in path), None)
    if match is not None:
        return match
    return rules.get("*", 3.0) if ndim >= 2 else 1.0


def make_tiny_family_model(model_type: str, seed: int = 0, vocab: int | None = None) -> nn.Module:
    """The tiny ``model_type`` model with seeded random float32 weights (``vocab``: its
    vocabulary's size, the tiny tokenizer's by default)."""
    config = tiny_family_config(model_type, vocab)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Weights scaled up so that greedy answers vary with the context, with clear winners.
    model.update(tree_map_with_path(lambda path, w: w * _scale(model_type, path, w.ndim),
                                    model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tiny_family_dir(path: str | Path, model_type: str, seed: int = 0, *,
                         chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write a complete model folder (config, weights, tiny tokenizer) and return its path."""
    return write_model_dir(path, make_tiny_family_model(model_type, seed),
                           tiny_family_config(model_type), chat_template=chat_template,
                           max_length=CONTEXT)
