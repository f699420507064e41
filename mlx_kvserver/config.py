"""Server settings: command-line flags over environment variables over defaults.

``ServerConfig`` is the one definition of every setting and its default: the command line
(``cli.py``) takes its defaults from here, and the engine builds each model's cache and scheduler
from it (``engine.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

GB = 1 << 30


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not a number")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-kvserver" / "kv"


@dataclass
class ServerConfig:
    models: list[str] = field(default_factory=lambda: ["default"])
    model_aliases: list[tuple[str, str]] = field(default_factory=list)  # (name or glob, served)
    # Models on demand (models/on_demand.py, api/on_demand.py): globs over a request's model name
    # (folder or .gguf paths, Hugging Face ids) that load on first use; none: only ``models``
    allow_models: list[str] = field(default_factory=list)
    allow_download: bool = False  # Hugging Face ids may be fetched (else: only the local cache)
    pin_models: list[str] = field(default_factory=list)  # allowed, and never unloaded
    model_ttl_s: float | None = None  # an idle model loaded on demand is unloaded after it
    model_load_wait_s: float = 300.0  # how long a request waits for its model to load (503)
    host: str = "127.0.0.1"
    port: int = 8080
    max_tokens: int | None = 512
    temperature: float = 0.0
    kv_cache_dir: Path | None = None
    max_kv_size_gb: float = 10.0
    max_kv_ram_gb: float = 2.0
    # what the process holds outside MLX (Python, tokenizers), within the limit; None: measured
    memory_reserve_gb: float | None = None
    memory_limit_gb: float | None = None  # all the server may use (engine/memory.py); None: a
    # safe fraction of the machine (Metal: of MLX's recommended working set)
    page_size: int = 32
    # pages in 8 or 4 bits, or (key bits, value bits) (kv_cache/layout/quant.py); None: model's
    kv_bits: int | tuple[int, int] | None = None
    kv_group_size: int = 64  # values sharing one scale and bias, with kv_bits
    kv_rotate: bool = True  # with kv_bits: each group rotated (Hadamard) before quantizing
    # with kv_bits: keys' offsets and channel weights measured on a fixed text when a model is
    # opened (kv_cache/layout/key_shape.py); off by default: docs/BENCHMARKS.md section 14
    kv_calibrate: bool = False
    # with kv_bits: keys' scales per channel over a page, or per position along head_dim; auto:
    # per channel for 4-bit keys (kv_cache/layout/channel_keys.py)
    kv_key_scales: str = "auto"
    # with kv_bits: shared prefixes read packed (quantized products) or decoded; auto: packed on
    # a GPU (kv_cache/model/packed_attention.py)
    kv_attention: str = "auto"
    max_resident_sequences: int = 8  # (8 agents each on its own files: each next turn at once)
    max_batch: int = 32  # answers decoded together
    # NOTE: measured on the development CPU (2 cores, default model): 256 prompt tokens take
    # ~0.9 s, so a prompt arriving mid-stream stalls the other streams by about that much a step.
    prefill_chunk: int = 256  # prompt tokens per step
    speculate: str = "ngram"  # off | ngram | draft: drafts verified in the batch (speculate.py)
    num_draft_tokens: int = 8  # the most draft tokens one sequence verifies per step
    draft_model: str | None = None  # a small model with the target's tokenizer (speculate=draft)
    eviction_policy: str = "lru"
    kv_store: str | None = None  # a shared page store (redis://, valkey://, unix://)
    kv_store_namespace: str = "kv"  # keeps tenants of one store apart
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names beyond loopback, --host
    max_body_bytes: int = 8 << 20
    max_import_bytes: int = 4 << 30
    max_queue: int = 64  # requests waiting to start before a 429 (0: no bound; backlog.py)
    dequantize: bool | None = None  # None: on MLX's CPU backend only
    volatile_rules: bool = True  # the shipped normalizer rules (chat/normalize.py) and these:
    volatile_rule: list[str] = field(default_factory=list)
    volatile_rule_files: list[Path] = field(default_factory=list)
