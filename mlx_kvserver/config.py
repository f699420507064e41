"""Server settings: command-line flags over a settings file over environment variables over
defaults.

``ServerConfig`` is the one definition of every setting and its default: the command line
(``flags.py``) takes its defaults from here, and the engine builds each model's cache and scheduler
from it (``engine.py``). A settings file (``--config FILE``, TOML) gives the flags' values by
their names without ``--`` (``max-batch = 8``): ``read_settings`` checks each against its flag
and converts it as the command line would (docs/CONFIGURATION.md).
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (pyproject.toml)
    import tomli as tomllib

GB = 1 << 30


def env_float(name: str, default: float, environ: Mapping[str, str] = os.environ) -> float:
    value = environ.get(name)
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
    # Models on demand (models/on_demand.py, models/serving.py): globs over a request's model name
    # (folder or .gguf paths, Hugging Face ids) that load on first use; none: only ``models``
    allow_models: list[str] = field(default_factory=list)
    allow_download: bool = False  # Hugging Face ids may be fetched (else: only the local cache)
    pin_models: list[str] = field(default_factory=list)  # allowed, and never unloaded
    model_ttl_s: float | None = None  # an idle model loaded on demand is unloaded after it
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
    # pages in 8 or 4 bits, or (key bits, value bits); None: the model's precision. The codec
    # picks the rest (kv_cache/layout/quant.py, spec.py key_block_for): groups of 64 along
    # head_dim (32 where 64 does not divide it), rotated, keys per channel over a page wherever
    # the model has no recurrent state (benchmarks/kv_quality.py; docs/BENCHMARKS.md, "KV pages
    # in 8 and 4 bits")
    kv_bits: int | tuple[int, int] | None = None
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
    # KV cache events in vLLM's format for a cache-aware router (engine/kv_events.py): the PUB
    # endpoint (None: off), the replay endpoint (None: the next port; "off": none), the topic,
    # and the events as tagged arrays (vLLM up to 0.23, read by older and newer routers) or maps
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    kv_events_format: str = "array"
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names beyond loopback, --host
    max_body_bytes: int = 8 << 20
    max_images: int = 16  # images in one request, at most (api/images.py)
    allow_image_urls: bool = False  # http(s) image URLs fetched (never from this machine)
    max_import_bytes: int = 4 << 30
    max_queue: int = 64  # requests waiting to start before a 429 (0: no bound; backlog.py)
    dequantize: bool | None = None  # None: on MLX's CPU backend only
    volatile_rules: bool = True  # the shipped normalizer rules (chat/normalize.py) and these:
    volatile_rule: list[str] = field(default_factory=list)
    volatile_rule_files: list[Path] = field(default_factory=list)


# -- the settings file ---------------------------------------------------------------------------

NOT_IN_FILES = ("help", "config")  # flags a settings file cannot give (dests)


def file_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The settings a file may give: each flag of ``parser`` by its name without ``--``."""
    return {a.option_strings[-1][2:]: a for a in parser._actions
            if a.option_strings and a.dest not in NOT_IN_FILES}


def _repeatable(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction)


# a flag's value type -> what a file gives for it; a converter of the flag's own takes either
# (``kv-bits = 8`` or ``kv-bits = "8,4"``)
_KINDS = {int: "integer", float: "number", None: "string", str: "string", Path: "string"}
_TOML = {"integer": ((int,), "an integer"), "number": ((int, float), "a number"),
         "string": ((str,), "a string"),
         "integer or string": ((int, str), "an integer or a string")}


def file_kind(action: argparse.Action) -> str:
    """What a settings file gives for ``action``'s flag, in TOML's words."""
    if action.nargs == 0:
        return "true or false"
    one = _KINDS.get(action.type, "integer or string")
    return f"list of {one}s (or one {one})" if _repeatable(action) else one


def _one(file: Path, key: str, action: argparse.Action, value: Any) -> Any:
    """One value of a flag as the command line gives it: of its type, converted, among its
    choices."""
    types, want = _TOML[_KINDS.get(action.type, "integer or string")]
    if isinstance(value, bool) or not isinstance(value, types):
        raise SystemExit(f"{file}: {key} = {value!r}: want {want} for --{key}")
    if action.type in (int, float):
        value = action.type(value)
    elif action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise SystemExit(f"{file}: {key} = {value!r}: {e}")
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"{file}: {key} = {value!r}: want one of "
                         f"{', '.join(map(repr, action.choices))}")
    return value


def read_settings(file: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flags' values a TOML settings file gives, by their ``parser`` dests: each key a
    flag's name without ``--`` at the top level of the file, each value of the flag's type
    (``file_kind``), converted as the command line would. ``SystemExit`` naming the key for an
    unknown key, a table, a wrong type or a value the flag refuses."""
    try:
        with open(file, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise SystemExit(f"--config {file}: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"--config {file}: not TOML: {e}")
    options = file_options(parser)
    out: dict[str, Any] = {}
    for key, value in table.items():
        action = options.get(key)
        if action is None:
            if isinstance(value, dict):
                raise SystemExit(f"{file}: [{key}] is a table: settings are flags' names at the "
                                 "top level of the file, one file for one server "
                                 "(docs/CONFIGURATION.md)")
            near = difflib.get_close_matches(key.replace("_", "-"), options, 1)
            raise SystemExit(f"{file}: {key!r} is no setting"
                             + (f" (did you mean {near[0]!r}?)" if near else
                                " (settings are the flags' names without '--')"))
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise SystemExit(f"{file}: {key} = {value!r}: want true or false for --{key}")
            out[action.dest] = action.const if value else action.default
        elif _repeatable(action):
            values = value if isinstance(value, list) else [value]
            out[action.dest] = [_one(file, key, action, v) for v in values]
        else:
            out[action.dest] = _one(file, key, action, value)
    return out
