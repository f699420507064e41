"""Write a loaded model as an MLX model folder that ``mlx_lm.load`` (and mlx-lm's own server)
can read: ``config.json``, ``model.safetensors`` and the tokenizer files with the chat template.

  python -m mlx_kvserver.models.convert --model default --out ./smollm2-mlx [--keep-quantized]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .loading import LoadedModel, resolve_and_load


def _quantization(model: nn.Module) -> dict | None:
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return {"group_size": module.group_size, "bits": module.bits}
    return None


def save_mlx_folder(lm: LoadedModel, out: str | Path) -> Path:
    """Save ``lm`` under ``out`` (created); returns the folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    args = lm.model.args
    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    config["model_type"] = getattr(args, "model_type", "llama")
    config["max_position_embeddings"] = lm.context_length
    config["eos_token_id"] = sorted(lm.tokenizer.eos_token_ids)
    quant = _quantization(lm.model)
    if quant:
        config["quantization"] = quant
    weights = dict(tree_flatten(lm.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hf = lm.tokenizer.hf
    hf.chat_template = lm.tokenizer.chat_template
    hf.save_pretrained(str(out))
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    tok_cfg["chat_template"] = lm.tokenizer.chat_template  # inline: every reader finds it
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mlx_kvserver.models.convert", description=__doc__)
    p.add_argument("--model", default="default", help="what `mlx-kvserver --model` accepts")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep quantized weights (default: as the server runs them here)")
    args = p.parse_args(argv)
    lm = resolve_and_load(args.model, dequantize=False if args.keep_quantized else None)
    print(save_mlx_folder(lm, args.out))


if __name__ == "__main__":
    main()
