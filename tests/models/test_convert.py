"""The converter writes a folder that mlx-lm loads and that computes what the source computes."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import load as mlx_lm_load

from mlx_kvserver.models.convert import save_mlx_folder
from mlx_kvserver.models.loading import resolve_and_load


def test_default_model_round_trips_through_mlx_lm(tmp_path):
    # Quantized: the same code path as a dequantized model, with a fifth of the bytes to write.
    dequantize = False
    lm = resolve_and_load("default", dequantize=dequantize)
    folder = save_mlx_folder(lm, tmp_path / "out")
    model, tokenizer = mlx_lm_load(str(folder))
    prompt = lm.tokenizer.render([{"role": "user", "content": "Name a colour."}])
    ids = lm.tokenizer.encode(prompt)
    assert tokenizer.encode(prompt, add_special_tokens=False) == ids
    # Every weight computes on any tokens: the prompt's first 8 (MLX's quantized matmul on the
    # CPU costs ~150 ms a token here, ~5 s a pass over the whole prompt).
    head = mx.array(ids[:8])[None]
    ours = lm.model(head)[0, -1]
    theirs = model(head)[0, -1]
    assert mx.allclose(ours, theirs, atol=1e-4).item()
    assert tokenizer.chat_template == lm.tokenizer.chat_template
    again = resolve_and_load(str(folder), dequantize=dequantize)
    assert again.tokenizer.render([{"role": "user", "content": "hi"}]) == \
        lm.tokenizer.render([{"role": "user", "content": "hi"}])
