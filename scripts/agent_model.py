"""Make an MLX model folder for trying coding agents (Claude Code, Codex CLI, OpenCode) locally.

Agents send prompts of 7,000-24,000 tokens before the first user word. The default model
(SmolLM2-135M-Instruct) has an 8,192-token context, and on a small CPU a 24,000-token prefill
of it takes minutes. This writes a folder with the default model's real tokenizer and chat
template and either

- small random weights of the same family (llama, same 49,152-token vocabulary): prefill is fast
  and the text is nonsense, which is enough to check the protocol (routes, streaming, tools,
  cache reuse across turns and restarts); or
- ``--real-weights``: the default model's own weights, with only its context raised (past its
  trained 8,192 tokens the answers degrade, but they are real text).

  python scripts/agent_model.py --out /tmp/agent-model [--layers 2 --hidden 64] [--context 65536]
  python scripts/agent_model.py --out /tmp/agent-model-real --real-weights
  mlx-kvserver --model /tmp/agent-model --model-alias '*=default' ...

Random answers would run to the request's ``max_tokens`` (Claude Code asks for 32,000), so the
end-of-turn token gets a larger output row (``--eos-boost``): answers end after tens of tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

from mlx_kvserver.models.convert import save_mlx_folder
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load


def random_config(base: dict[str, Any], *, layers: int, hidden: int, heads: int, kv_heads: int,
                  context: int) -> dict[str, Any]:
    """``base`` (the default model's config) shrunk to a small random model of its family."""
    if hidden % heads or heads % kv_heads:
        raise ValueError("--hidden must be a multiple of --heads, --heads of --kv-heads")
    keep = ("model_type", "rms_norm_eps", "vocab_size", "rope_theta", "rope_traditional",
            "attention_bias", "mlp_bias")
    cfg = {k: base[k] for k in keep if base.get(k) is not None}
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
               num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=hidden // heads, max_position_embeddings=context,
               tie_word_embeddings=False)
    return cfg


def random_model(cfg: dict[str, Any], eos_ids: list[int], *, seed: int,
                 eos_boost: float) -> llama.Model:
    """A llama model with seeded random float32 weights whose end-of-turn logits are boosted."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # Untied, scaled-up weights make greedy answers vary with the context (as in
    # harness/tiny_model.py).
    model.update(tree_map(lambda w: w * 3.0, model.parameters()))
    for layer in model.model.layers:
        layer.input_layernorm.weight = mx.ones_like(layer.input_layernorm.weight)
        layer.post_attention_layernorm.weight = mx.ones_like(layer.post_attention_layernorm.weight)
    model.model.norm.weight = mx.ones_like(model.model.norm.weight)
    head = model.lm_head.weight
    for i in eos_ids:  # a longer EOS row: its logit has a larger spread, so it wins now and then
        head[i] = head[i] * eos_boost
    model.lm_head.weight = head
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def write_random_folder(lm: LoadedModel, out: Path, *, layers: int, hidden: int, heads: int,
                        kv_heads: int, context: int, seed: int, eos_boost: float) -> Path:
    """Write the random model with ``lm``'s tokenizer and chat template under ``out``."""
    save_mlx_folder(lm, out)  # tokenizer files and template (the weights are replaced below)
    base = {k: v for k, v in dataclasses.asdict(lm.model.args).items() if v is not None}
    cfg = random_config(base, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        context=context)
    eos = sorted(lm.tokenizer.eos_token_ids)
    cfg["eos_token_id"] = eos
    model = random_model(cfg, eos, seed=seed, eos_boost=eos_boost)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def raise_context(out: Path, context: int) -> None:
    """Set ``max_position_embeddings`` (and the tokenizer's ``model_max_length``) to ``context``."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = context
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tok_path = out / "tokenizer_config.json"
    if tok_path.exists():
        tok = json.loads(tok_path.read_text())
        tok["model_max_length"] = context
        tok_path.write_text(json.dumps(tok, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="scripts/agent_model.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder to write (created)")
    p.add_argument("--model", default="default",
                   help="whose tokenizer and template (and --real-weights) to use")
    p.add_argument("--context", type=int, default=65536, help="max_position_embeddings")
    p.add_argument("--real-weights", action="store_true",
                   help="the model's own weights (float32 on the CPU) with the context raised")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-boost", type=float, default=2.5,
                   help="scale of the end-of-turn tokens' output rows (1: no boost)")
    args = p.parse_args(argv)
    if args.context < 1:
        p.error("--context must be positive")
    if args.real_weights:
        lm = resolve_and_load(args.model)  # dequantized on MLX's CPU backend, as served there
        save_mlx_folder(lm, args.out)
    else:
        lm = resolve_and_load(args.model, dequantize=False)  # only its tokenizer is used
        write_random_folder(lm, args.out, layers=args.layers, hidden=args.hidden,
                            heads=args.heads, kv_heads=args.kv_heads, context=args.context,
                            seed=args.seed, eos_boost=args.eos_boost)
    raise_context(args.out, args.context)
    print(args.out)


if __name__ == "__main__":
    main()
