"""Load a llama-architecture GGUF file into an mlx-lm ``llama.Model`` plus a HF tokenizer.

``mx.load(path, return_metadata=True)`` gives the tensors (Q4_0/Q4_1/Q8_0 as MLX quantized triples
with group size 32; other types arrive as float16/float32) and the metadata. GGUF's q/k weights are
permuted for interleaved rope, hence ``rope_traditional=True``. The tokenizer is rebuilt with the
``tokenizers`` library from ``tokenizer.ggml.*``: byte-level BPE (``gpt2``, digits split one by one
unless the pre-tokenizer says otherwise) or SentencePiece-style BPE with byte fallback (``llama``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_LAYER_NAMES = {  # GGUF tensor name part -> mlx-lm llama module path
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass
class GGUFModel:
    """What :func:`load_gguf` returns."""

    model: llama.Model
    tokenizer: PreTrainedTokenizerFast
    config: dict[str, Any]  # the llama.ModelArgs, as a dict
    context_length: int
    eos_token_ids: set[int] = field(default_factory=set)  # eos, eot, eom from the metadata
    dequantized: bool = False
    name: str = ""  # general.name, when present


def is_gguf(path: str | Path) -> bool:
    """Whether the file starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def _int_list(v: Any) -> list[int]:
    return [int(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]


def build_tokenizer(meta: dict[str, Any]) -> tuple[PreTrainedTokenizerFast, set[int]]:
    """A HF fast tokenizer and the end-of-sequence token ids from GGUF tokenizer metadata."""
    kind = _scalar(meta, "tokenizer.ggml.model", "gpt2")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    n = len(tokens)
    types = _int_list(meta["tokenizer.ggml.token_type"]) if "tokenizer.ggml.token_type" in meta \
        else [1] * n
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        pre = _scalar(meta, "tokenizer.ggml.pre", "default")
        if pre in ("llama-bpe", "llama3", "smaug-bpe", "falcon3"):
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre == "gpt-2":
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:  # smollm, starcoder, refact, default: digits one by one
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tk.decoder = decoders.ByteLevel()
    elif kind == "llama":
        tk = _spm_tokenizer(meta, tokens, vocab, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (want 'gpt2' or 'llama')")
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i.item() if hasattr(i, "item") else i)] if i is not None else None

    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=tok("eos"), bos_token=tok("bos"),
                                 unk_token=tok("unknown"), pad_token=tok("padding"))
    hf.chat_template = meta.get("tokenizer.chat_template")  # None: ChatTokenizer uses ChatML
    eos = {vocab[t] for t in (tok("eos"), tok("eot"), tok("eom")) if t is not None}
    return hf, eos


def _spm_tokenizer(meta: dict[str, Any], tokens: list[str], vocab: dict[str, int],
                   types: list[int]) -> Tokenizer:
    """SentencePiece BPE (llama-style) with byte fallback; merges ranked by the merged score."""
    scores = [float(s) for s in meta["tokenizer.ggml.scores"].tolist()] \
        if "tokenizer.ggml.scores" in meta else [0.0] * len(tokens)
    ranked = []
    for piece, pid in vocab.items():
        if types[pid] != 1:
            continue
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], (left, right)))
    merges = [m for *_, m in sorted(ranked)]
    unk = tokens[int(_scalar(meta, "tokenizer.ggml.unknown_token_id", 0))]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True,
                              fuse_unk=True))
    prefix = bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


def model_args(meta: dict[str, Any], weights: dict[str, mx.array]) -> llama.ModelArgs:
    """mlx-lm llama arguments from GGUF metadata (``llama.*`` keys)."""
    def g(key: str, default: Any = None) -> Any:
        return _scalar(meta, f"llama.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // heads))
    vocab = int(g("vocab_size", weights["token_embd.weight"].shape[0]))
    rope_scaling = None
    kind = _scalar(meta, "llama.rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = {"type": "linear", "factor": float(g("rope.scaling.factor"))}
    if "rope_freqs.weight" in weights:  # llama3-style per-frequency factors; freqs set later
        rope_scaling = {"rope_type": "llama3", "factor": 1.0}
    return llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=int(g("block_count")),
        intermediate_size=int(g("feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), vocab_size=vocab,
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_traditional=True,
        rope_scaling=rope_scaling, max_position_embeddings=int(g("context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in weights, mlp_bias="blk.0.ffn_up.bias" in weights,
        tie_word_embeddings="output.weight" not in weights)


def _rename(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
            out[f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"] = w
        elif len(parts) == 2 and parts[0] in _TOP_NAMES:
            out[f"{_TOP_NAMES[parts[0]]}.{parts[1]}"] = w
        elif parts[0] != "rope_freqs":
            raise ValueError(f"unexpected tensor {name!r} in a llama GGUF")
    return out


# NOTE: a conversion (dequantizing, casting) writes each tensor's result a chunk of rows at a
# time into one array allocated first, each chunk evaluated before the next is made, and swaps
# the result in for its source at once: the load's peak is the weights, one source tensor and
# one chunk's temporaries. Converted whole, a tensor's temporaries were as large as its result
# (the default model's embedding: 108 MiB above its 513 MiB of float32 weights).
CHUNK_BYTES = 4 << 20  # a chunk's result, at most


def conversion_workspace() -> int:
    """What converting a chunk holds beside the arrays it writes, at most: its result, the
    dequantization's own temporary and the chunk's scales in float32."""
    return 3 * CHUNK_BYTES


def _in_chunks(shape: tuple[int, ...], dtype: mx.Dtype,
               make: Callable[[int, int], mx.array]) -> mx.array:
    """An array of ``shape`` and ``dtype`` whose rows ``i:j`` are ``make(i, j)``, made a chunk
    of rows at a time (see ``CHUNK_BYTES``)."""
    row = dtype.size * math.prod(shape[1:]) if shape else dtype.size
    step = max(1, CHUNK_BYTES // max(1, row))
    if not shape or step >= shape[0]:
        out = make(0, shape[0] if shape else 0)
        mx.eval(out)
        return out
    out = mx.zeros(shape, dtype=dtype)
    mx.eval(out)
    for i in range(0, shape[0], step):
        out[i:i + step] = make(i, min(i + step, shape[0]))  # in place: ``out`` has one holder
        mx.eval(out)
    return out


def _give_back_cache() -> None:
    """MLX's buffer cache keeps the sources converted so far (resident, of sizes the next
    tensors seldom reuse): given back once it holds more than a few chunks."""
    if mx.get_cache_memory() > 4 * CHUNK_BYTES:
        mx.clear_cache()


def cast_each(model: nn.Module, dtype: mx.Dtype, which: Callable[[mx.Dtype], bool]) -> None:
    """Cast the parameters whose dtype ``which`` picks to ``dtype``, one at a time and a chunk
    at a time (``Module.set_dtype`` casts them all at once: the old and new copies of every
    one together)."""
    names = [n for n, v in tree_flatten(model.parameters())
             if v.dtype != dtype and which(v.dtype)]
    for name in names:
        *path, leaf = name.split(".")
        owner: Any = model
        for part in path:
            owner = owner[int(part)] if isinstance(owner, list) else owner[part]
        key: Any = int(leaf) if isinstance(owner, list) else leaf
        v = owner[key]
        owner[key] = _in_chunks(v.shape, dtype, lambda i, j: v[i:j].astype(dtype) if v.ndim
                                else v.astype(dtype))
        del v
        _give_back_cache()


def dequantize_to_float32(model: nn.Module) -> nn.Module:
    """Replace quantized Linear/Embedding layers by float32 ones and cast the rest to float32,
    one tensor at a time and each a chunk of rows at a time (see ``CHUNK_BYTES``), the largest
    first (what the peak holds beside the weights is the last source and one chunk).

    Scales and biases are cast first so ``mx.dequantize`` writes float32 directly (~3x faster on
    MLX's CPU backend than dequantizing to float16 and casting afterwards). Modules other than
    nn.QuantizedLinear / nn.QuantizedEmbedding (e.g. MoE switch layers) stay as they are.
    """
    quantized = [(name, m) for name, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    quantized.sort(key=lambda nm: nm[1].weight.nbytes)
    while quantized:
        name, m = quantized.pop()  # the list holds only the modules still to do
        biases = m.get("biases")

        def rows(i: int, j: int, m: nn.Module = m, biases: mx.array | None = biases) -> mx.array:
            return mx.dequantize(m.weight[i:j], m.scales[i:j].astype(mx.float32),
                                 None if biases is None else biases[i:j].astype(mx.float32),
                                 m.group_size, m.bits, m.mode)
        w = _in_chunks((m.weight.shape[0], m.weight.shape[1] * 32 // m.bits), mx.float32, rows)
        if isinstance(m, nn.QuantizedLinear):
            new: nn.Module = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        else:
            new = nn.Embedding(w.shape[0], w.shape[1])
        new.weight = w
        # NOTE: swapped in at once, so the quantized arrays go as the float32 ones come
        model.update_modules(tree_unflatten([(name, new)]))
        del m, w, new, rows, biases
        _give_back_cache()
    cast_each(model, mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    return model


def load_gguf(path: str | Path, *, dequantize: bool) -> GGUFModel:
    """Load a llama-architecture GGUF file.

    ``dequantize=True`` turns every quantized Linear/Embedding into float32 and runs the whole
    model in float32 (fast with a real BLAS on MLX's CPU backend); ``False`` keeps the quantized
    weights (what Apple Silicon wants) and, on a GPU, runs the rest in the scales' dtype
    (float16). Raises FileNotFoundError for a missing file and ValueError for a file that is not
    GGUF or not a llama model.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # noqa: BLE001 - mlx raises RuntimeError/ValueError variously
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; only 'llama' loads")
    args = model_args(meta, weights)
    tokenizer, eos = build_tokenizer(meta)
    model = llama.Model(args)
    renamed = _rename(weights)

    def quant_spec(p: str, module: nn.Module) -> bool | dict[str, Any]:
        if f"{p}.scales" not in renamed or not hasattr(module, "to_quantized"):
            return False
        in_dims = module.weight.shape[-1]
        group = in_dims // renamed[f"{p}.scales"].shape[-1]
        return {"group_size": group, "bits": renamed[f"{p}.weight"].shape[-1] * 32 // in_dims}

    nn.quantize(model, class_predicate=quant_spec)
    model.load_weights(list(renamed.items()))
    model.eval()
    if "rope_freqs.weight" in weights:
        dims = model.layers[0].self_attn.rope.dims
        base = args.rope_theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        freqs = base * weights["rope_freqs.weight"].astype(mx.float32)
        for layer in model.layers:
            layer.self_attn.rope._freqs = freqs
    del renamed
    weights = {}  # the model holds its arrays now: the file's own copies may go (dequantizing)
    if dequantize:
        dequantize_to_float32(model)
    elif mx.default_device().type == mx.DeviceType.gpu:
        # NOTE: norms arrive as float32, which would make activations and KV float32; on a GPU run
        # them in the scales' dtype (float16). Not on the CPU, where float16 math is ~40x slower.
        act = next((m.scales.dtype for _, m in model.named_modules()
                    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))), None)
        if act is not None and act != mx.float32:
            cast_each(model, act, lambda d: d == mx.float32)
    mx.eval(model.parameters())
    mx.clear_cache()  # what the load freed: resident until given back
    ctx = int(_scalar(meta, "llama.context_length", 4096))
    return GGUFModel(model=model, tokenizer=tokenizer, config=dict(vars(args)),
                     context_length=ctx, eos_token_ids=eos, dequantized=dequantize,
                     name=str(meta.get("general.name", "")))
