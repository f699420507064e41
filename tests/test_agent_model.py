"""scripts/agent_model.py: a model folder for agent trials with the default model's tokenizer and
chat template and a raised context, loadable by the server."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_kvserver.models.loading import resolve_and_load
from scripts import agent_model

MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "list the files here"}]


@pytest.fixture(scope="module")
def default_lm():
    return resolve_and_load("default", dequantize=False)


def _same_tokenizer(lm, default_lm):
    assert lm.tokenizer.chat_template == default_lm.tokenizer.chat_template
    assert lm.tokenizer.content_digest() == default_lm.tokenizer.content_digest()
    assert lm.tokenizer.eos_token_ids == default_lm.tokenizer.eos_token_ids
    text = default_lm.tokenizer.render(MESSAGES)
    assert lm.tokenizer.render(MESSAGES) == text
    assert lm.tokenizer.encode(text) == default_lm.tokenizer.encode(text)


def test_random_weights_folder(tmp_path, default_lm):
    out = tmp_path / "agent-model"
    agent_model.main(["--out", str(out), "--layers", "2", "--hidden", "64",
                      "--context", "32768"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 49152
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64
    lm = resolve_and_load(str(out))
    assert lm.context_length == 32768
    assert lm.num_layers == 2
    _same_tokenizer(lm, default_lm)
    ids = lm.tokenizer.encode(lm.tokenizer.render(MESSAGES))
    logits = lm.model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), 49152)


def test_real_weights_folder(tmp_path, default_lm):
    out = tmp_path / "agent-model-real"
    agent_model.main(["--out", str(out), "--real-weights", "--context", "16384"])
    lm = resolve_and_load(str(out), dequantize=False)
    assert lm.context_length == 16384
    assert lm.num_layers == default_lm.num_layers
    _same_tokenizer(lm, default_lm)
    ids = default_lm.tokenizer.encode(default_lm.tokenizer.render(MESSAGES))
    # the prompt's first 8 tokens: every weight computes (a quantized pass on the CPU costs
    # ~150 ms a token)
    head = mx.array(ids[:8])[None]
    ours = lm.model(head)[0, -1]
    theirs = default_lm.model(head)[0, -1]
    # the same weights, dequantized: float32 against quantized matmuls, ~7e-3 apart
    assert mx.allclose(ours, theirs, atol=5e-2).item()
    assert mx.argmax(ours).item() == mx.argmax(theirs).item()


def test_bad_shape_is_refused():
    with pytest.raises(ValueError):
        agent_model.random_config({"model_type": "llama", "vocab_size": 49152}, layers=2,
                                  hidden=66, heads=4, kv_heads=2, context=4096)
