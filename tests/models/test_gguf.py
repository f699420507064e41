"""GGUF loading (mlx_kvserver/models/gguf.py): the bundled SmolLM2 model end to end, synthetic files."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache
from harness.tiny_model import make_tiny_model, make_tiny_tokenizer

from mlx_kvserver.models.gguf import build_tokenizer, load_gguf
from mlx_kvserver.models.loading import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def greedy(model: nn.Module, ids: list[int], steps: int, stop: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding with mlx-lm's KVCache."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array(ids)[None], cache=cache)
    out: list[int] = []
    for _ in range(steps):
        y = int(mx.argmax(logits[0, -1]))
        out.append(y)
        if y in stop:
            break
        logits = model(mx.array([[y]]), cache=cache)
    return out


@pytest.fixture(scope="module")
def smol() -> object:
    return load_gguf(default_model_path(), dequantize=True)


def prompt_ids(g: object) -> list[int]:
    text = g.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return g.tokenizer.encode(text, add_special_tokens=False)


def test_default_model_metadata(smol: object) -> None:
    assert smol.context_length == 8192
    assert smol.dequantized
    args = smol.config
    assert (args["num_hidden_layers"], args["num_attention_heads"], args["num_key_value_heads"],
            args["hidden_size"], args["rope_traditional"]) == (30, 9, 3, 576, True)
    assert args["tie_word_embeddings"]
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in smol.model.named_modules())
    assert {v.dtype for _, v in tree_flatten(smol.model.parameters())} == {mx.float32}
    tok = smol.tokenizer
    assert tok.convert_ids_to_tokens(sorted(smol.eos_token_ids)) == ["<|im_end|>"]
    assert tok.encode("2024", add_special_tokens=False) == [tok.convert_tokens_to_ids(c)
                                                            for c in "2024"]  # digits split
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]  # control token


def test_default_model_answers_paris(smol: object) -> None:
    out = greedy(smol.model, prompt_ids(smol), 20, smol.eos_token_ids)
    text = smol.tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text


def test_quantized_matches_dequantized_first_tokens(smol: object) -> None:
    q = load_gguf(default_model_path(), dequantize=False)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in q.model.named_modules())
    # A short raw prompt: quantized matmul on MLX's CPU backend is ~25x slower than float32.
    ids = smol.tokenizer.encode("The capital of France is", add_special_tokens=False)
    want = greedy(smol.model, ids, 3)
    assert greedy(q.model, ids, 3) == want
    assert "Paris" in smol.tokenizer.decode(want)


def test_not_gguf_is_value_error(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_gguf(p, dequantize=True)
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf", dequantize=True)


def gguf_meta(arch: str = "llama") -> dict:
    """GGUF metadata for the tiny model: gpt2-style tokenizer from the tiny tokenizer."""
    tk = make_tiny_tokenizer()
    vocab = tk.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tk.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    special = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "general.architecture": arch, "general.name": "tiny",
        "llama.embedding_length": u32(64), "llama.block_count": u32(2),
        "llama.feed_forward_length": u32(128), "llama.attention.head_count": u32(4),
        "llama.attention.head_count_kv": u32(2), "llama.context_length": u32(1024),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "llama.rope.freq_base": mx.array(10000.0), "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in special else 1 for t in tokens],
                                              dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(vocab["<|im_end|>"]),
        "tokenizer.ggml.bos_token_id": u32(vocab["<|im_start|>"]),
    }


def to_gguf_names(model: llama.Model) -> dict[str, mx.array]:
    inv = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
           "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            mod, leaf = rest.rsplit(".", 1)
            out[f"blk.{i}.{inv[mod]}.{leaf}"] = v
        else:
            top = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
            out[top[k]] = v
    return out


def test_synthetic_gguf_matches_mlx_lm_model(tmp_path: Path) -> None:
    ref = make_tiny_model(seed=3)
    ref_trad = llama.Model(llama.ModelArgs(**{**vars(ref.args), "rope_traditional": True}))
    ref_trad.load_weights(tree_flatten(ref.parameters()))
    path = tmp_path / "tiny.gguf"
    mx.save_gguf(str(path), to_gguf_names(ref), gguf_meta())
    g = load_gguf(path, dequantize=True)
    assert g.context_length == 1024 and g.name == "tiny"
    assert g.config["tie_word_embeddings"] == ref.args.tie_word_embeddings
    ids = g.tokenizer.encode("Hello héllo 🙂 123", add_special_tokens=False)
    assert g.tokenizer.decode(ids) == "Hello héllo 🙂 123"
    assert ids[-3:] == g.tokenizer.convert_tokens_to_ids(["1", "2", "3"])  # digits split
    ids = g.tokenizer.encode("Hello héllo 🙂", add_special_tokens=False)
    assert ids == make_tiny_tokenizer().encode("Hello héllo 🙂").ids
    x = mx.array(ids)[None]
    assert mx.allclose(g.model(x), ref_trad(x), atol=1e-5).item()


def test_non_llama_architecture_is_value_error(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 4))}, gguf_meta("gpt2"))
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(path, dequantize=True)


def test_sentencepiece_tokenizer_round_trip() -> None:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "lo", "llo",
              "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # listed order = merge order
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": mx.array(scores),
            "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
            "tokenizer.ggml.bos_token_id": mx.array(1), "tokenizer.ggml.eos_token_id": mx.array(2),
            "tokenizer.ggml.unknown_token_id": mx.array(0)}
    tok, eos = build_tokenizer(meta)
    assert eos == {2}
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁hello", "▁world"]
    for text in ("hello world", "héllo wörld", "</s> hello"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
