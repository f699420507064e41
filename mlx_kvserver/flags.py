"""The server's flags, read into a :class:`ServerConfig`: the parser by topic
(:func:`build_parser`, which ``mlx-kvchat`` extends and docs/CONFIGURATION.md is made from), the
settings file and the environment beneath the command line (:func:`parse_args`), and the checks
that turn them into a config (:func:`config_from_args`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from kv_cache import parse_kv_bits

from .config import ServerConfig, default_cache_dir, env_float, read_settings

D = ServerConfig  # the defaults


def _kv_bits(text: str) -> tuple[int, int] | int | None:
    """``--kv-bits``: ``8``, ``4`` or ``K,V``; one number stays one number."""
    try:
        kv = parse_kv_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if kv is None else kv[0] if kv[0] == kv[1] else kv


def build_parser(environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The server's flags, by topic; ``environ``: where the defaults that environment variables
    set are read (docs/CONFIGURATION.md is made from this parser: scripts/config_page.py)."""
    p = argparse.ArgumentParser(
        prog="mlx-kvserver",
        description="OpenAI-compatible chat server on MLX with a paged, persistent KV cache.",
        epilog="Every flag, the settings file and the environment variables: "
               "docs/CONFIGURATION.md")
    g = p.add_argument_group("settings file")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help="read settings from a TOML file, each a flag's name without '--' "
                        "(max-batch = 8, model = ['a', 'b']); a flag on the command line wins "
                        "over the file, and the file over the environment")

    g = p.add_argument_group("models")
    g.add_argument("--model", action="append", dest="models", metavar="MODEL",
                   help="'default' (bundled SmolLM2-135M-Instruct, the default), a .gguf file, "
                        "an MLX model folder or a Hugging Face repo id; repeat to serve several")
    g.add_argument("--model-alias", action="append", default=[], dest="model_aliases",
                   metavar="NAME=SERVED",
                   help="answer requests for model NAME (a glob such as 'claude-*' is allowed) "
                        "with the served model SERVED ('default': the first); repeatable. "
                        "Agents ask for their own model names: e.g. --model-alias '*=default'")
    g.add_argument("--allow-models", action="append", default=[], dest="allow_models",
                   metavar="PATTERN",
                   help="let a request's model name (or X-Model-Id) that matches PATTERN, a "
                        "glob over folder and .gguf paths and Hugging Face ids (e.g. "
                        "'/models/*', 'mlx-community/*'), be loaded on first use; repeatable "
                        "(default: none, only the --model models are served)")
    g.add_argument("--allow-download", action="store_true",
                   help="models allowed on demand may be downloaded from the Hugging Face hub "
                        "(without it, only those already in the local HF cache load)")
    g.add_argument("--pin", action="append", default=[], dest="pin_models", metavar="MODEL",
                   help="a model loaded on demand that is never unloaded (allowed as if it "
                        "matched --allow-models); repeatable")
    g.add_argument("--model-ttl", type=float, default=D.model_ttl_s, dest="model_ttl_s",
                   metavar="SECONDS",
                   help="unload a model loaded on demand once it has been idle this long "
                        "(default: never; it goes only to make room)")
    g.add_argument("--keep-quantized", action="store_true",
                   help="keep quantized weights on MLX's CPU backend (slower there)")

    g = p.add_argument_group("answers", "what a request gets when it does not say")
    g.add_argument("--max-tokens", metavar="N", type=int, default=D.max_tokens,
                   help=f"default completion length when a request sets none (default "
                        f"{D.max_tokens})")
    g.add_argument("--temp", metavar="T", type=float, default=D.temperature,
                   help=f"default sampling temperature (default {D.temperature:g}: greedy)")

    g = p.add_argument_group("images", "what a request may send a model that takes images")
    g.add_argument("--max-images", metavar="N", type=int, default=D.max_images,
                   help=f"images in one request, at most (default {D.max_images})")
    g.add_argument("--allow-image-urls", action="store_true",
                   help="fetch images that a request gives as http(s) URLs (at most 20 MiB "
                        "each, within 10 s; never from this machine's own addresses). "
                        "Without it only images sent inline (base64, data URLs) are read")

    g = p.add_argument_group("batching and speculation")
    g.add_argument("--max-batch", metavar="N", type=int, default=D.max_batch,
                   help="answers decoded together in one forward pass, at most (default "
                        f"{D.max_batch})")
    g.add_argument("--max-queue", metavar="N", type=int, default=D.max_queue,
                   help="requests that may wait to start (memory, a place in the batch); one "
                        "more is answered 429 with Retry-After from the rate prompts start. A "
                        f"waiting request has no time limit (0: no bound; default {D.max_queue})")
    g.add_argument("--prefill-chunk", metavar="N", type=int, default=D.prefill_chunk,
                   help="prompt tokens read per step while other answers stream (default "
                        f"{D.prefill_chunk})")
    g.add_argument("--speculate", choices=["off", "ngram", "draft"], default=None,
                   help="speculative decoding in the batch, which never changes an answer: "
                        "drafts from the token ids the server holds (ngram, the default), from a "
                        "draft model (draft, the default with --draft-model), or none (off)")
    g.add_argument("--num-draft-tokens", metavar="N", type=int, default=D.num_draft_tokens,
                   help="the most draft tokens one answer verifies per step (default "
                        f"{D.num_draft_tokens})")
    g.add_argument("--draft-model", default=None, metavar="PATH|HF-ID",
                   help="a small model with the served model's tokenizer that drafts where the "
                        "conversation has nothing to offer")

    g = p.add_argument_group("memory")
    g.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   dest="memory_limit_gb",
                   help="all the memory the server may use: weights, KV pages, working buffers "
                        "and passes (default: 75%% of the machine's, on a Mac of the Metal "
                        "working set MLX recommends)")
    g.add_argument("--memory-reserve", type=float, default=None, metavar="GB",
                   dest="memory_reserve_gb",
                   help="the part of --memory-limit that the process holds outside MLX "
                        "(Python, tokenizers, libraries; default: measured once the models "
                        "have loaded)")

    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-cache-dir", metavar="DIR", type=Path, default=None,
                   help="where the KV cache persists (default ~/.cache/mlx-kvserver/kv)")
    g.add_argument("--no-disk-cache", action="store_true",
                   help="keep the KV cache in memory only")
    g.add_argument("--max-kv-size-gb", metavar="GB", type=float,
                   default=env_float("MAX_KV_SIZE_GB", D.max_kv_size_gb, environ),
                   help="disk budget of the KV cache (env MAX_KV_SIZE_GB, default "
                        f"{D.max_kv_size_gb:g})")
    g.add_argument("--max-kv-ram-gb", metavar="GB", type=float,
                   default=env_float("MAX_KV_RAM_GB", D.max_kv_ram_gb, environ),
                   help="memory budget of the KV pages per model (env MAX_KV_RAM_GB, default "
                        f"{D.max_kv_ram_gb:g})")
    g.add_argument("--page-size", metavar="N", type=int, default=D.page_size,
                   help=f"tokens per KV page (default {D.page_size})")
    g.add_argument("--max-resident-sequences", metavar="N", type=int,
                   default=D.max_resident_sequences,
                   help="finished conversations kept with their working buffers, so that their "
                        f"next turn skips gathering pages (0: none; default "
                        f"{D.max_resident_sequences})")
    g.add_argument("--eviction-policy", default=D.eviction_policy,
                   choices=["lru", "fifo", "s3fifo"],
                   help=f"which pages go first when the memory or disk budget is full (default "
                        f"{D.eviction_policy})")

    g = p.add_argument_group("KV pages in bits")
    g.add_argument("--kv-bits", type=_kv_bits, default=D.kv_bits, metavar="K[,V]",
                   help="hold KV pages in 8 or 4 bits, in memory, on disk and in the store: one "
                        "number for keys and values, or K,V such as 8,4 (keys suffer most from "
                        "rounding); default: the model's precision (a model's own quantized "
                        "caches are still refused). The rest is picked for you: groups of 64 "
                        "along head_dim, rotated, keys scaled per channel over a page (per "
                        "position in sliding windows and models with recurrent state). What "
                        "each costs the answers and saves in bytes: docs/BENCHMARKS.md")

    g = p.add_argument_group("shared page store")
    g.add_argument("--kv-store", default=environ.get("KV_STORE_URL"), metavar="URL",
                   help="a page store shared with other servers, below the disk: redis://, "
                        "rediss://, valkey:// or unix:// (env KV_STORE_URL; password in the URL "
                        "or in KV_STORE_PASSWORD; needs the disk cache)")
    g.add_argument("--kv-store-namespace", metavar="NAME", default=D.kv_store_namespace,
                   help=f"key prefix in the shared store (default {D.kv_store_namespace})")

    g = p.add_argument_group("KV cache events",
                             "which pages the cache holds, published in vLLM's format for a "
                             "cache-aware router in front of several servers (docs/ROUTING.md)")
    g.add_argument("--kv-events", metavar="ENDPOINT", default=D.kv_events,
                   help="publish KV cache events on this ZMQ PUB endpoint, e.g. tcp://*:5557 "
                        "(bound where it has '*' or '::' or is ipc:// or inproc://, else "
                        "connected, as vLLM does; default off)")
    g.add_argument("--kv-events-replay", metavar="ENDPOINT", default=D.kv_events_replay,
                   help="the ZMQ ROUTER endpoint that resends missed batches from a sequence "
                        "number (default: --kv-events's next port, e.g. tcp://*:5558; 'off': "
                        "none)")
    g.add_argument("--kv-events-topic", metavar="TOPIC",
                   help="the topic frame of every message (default empty, as vLLM's)")
    g.add_argument("--kv-events-format", choices=("array", "map"), default=D.kv_events_format,
                   help="each event a tagged msgpack array, as vLLM up to 0.23 sends (older and "
                        "newer routers read it alike), or a map with its tag under 'type', as "
                        f"later vLLM sends (default {D.kv_events_format})")

    g = p.add_argument_group("network and access")
    g.add_argument("--host", metavar="ADDRESS", default=D.host,
                   help=f"address to bind (default {D.host})")
    g.add_argument("--port", metavar="N", type=int, default=D.port,
                   help=f"port to listen on (default {D.port})")
    g.add_argument("--api-key", metavar="KEY", default=environ.get("MLX_KVSERVER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (env MLX_KVSERVER_API_KEY)")
    g.add_argument("--cors-origin", metavar="ORIGIN", action="append", default=[],
                   dest="cors_origins",
                   help="allow browser requests from this origin (repeatable; default none)")
    g.add_argument("--allowed-host", action="append", default=[], dest="allowed_hosts",
                   metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable; '*' for "
                        "any). Always allowed: localhost, 127.0.0.1, [::1] and --host")

    g = p.add_argument_group("volatile lines",
                             "lines of a prompt that change per request and mean nothing to the "
                             "model, removed before rendering so that the cache still matches")
    g.add_argument("--volatile-rule", action="append", default=[], metavar="REGEX[=>REPL]",
                   help="a line pattern that changes per request and means nothing to the model "
                        "(removed, or replaced by REPL, before rendering); repeatable. See "
                        "mlx_kvserver/chat/normalize.py")
    g.add_argument("--volatile-rules", action="append", default=[], type=Path, metavar="FILE",
                   help="a file of volatile rules, one REGEX[=>REPL] a line")
    g.add_argument("--no-volatile-rules", action="store_true",
                   help="apply no volatile-line rules, not even the shipped ones for Claude "
                        "Code's attribution header and 1M-context label")

    g = p.add_argument_group("platform and logging")
    g.add_argument("--no-fast-blas", action="store_true",
                   help="do not preload a fast BLAS for MLX's CPU backend on Linux")
    g.add_argument("--log-level", default="info", metavar="LEVEL",
                   help="debug, info, warning or error (default info)")
    return p


def parse_args(argv: list[str] | None = None,
               environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """The command line over the settings file it names (``--config``) over the environment
    over the defaults. A repeatable flag on the command line replaces the file's list."""
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    if args.config is not None:
        given = _given(argv)
        for dest, value in read_settings(args.config, parser).items():
            if dest not in given:
                setattr(args, dest, value)
    return args


def _given(argv: list[str] | None) -> set[str]:
    """The dests that the command line ``argv`` sets itself (not by their defaults)."""
    parser = build_parser({})
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    if args.max_kv_size_gb < 0 or args.max_kv_ram_gb <= 0 or args.page_size <= 0:
        raise SystemExit("--max-kv-size-gb, --max-kv-ram-gb and --page-size must be positive")
    if args.max_resident_sequences < 0:
        raise SystemExit("--max-resident-sequences must be 0 or more")
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be 0 (no bound) or more")
    if args.max_batch < 1 or args.prefill_chunk < 1:
        raise SystemExit("--max-batch and --prefill-chunk must be 1 or more")
    if args.memory_limit_gb is not None and args.memory_limit_gb <= 0:
        raise SystemExit("--memory-limit must be a positive number of GB")
    if args.memory_reserve_gb is not None and args.memory_reserve_gb < 0:
        raise SystemExit("--memory-reserve must be 0 or more GB")
    if args.max_images < 0:
        raise SystemExit("--max-images must be 0 or more")
    if args.num_draft_tokens < 0:
        raise SystemExit("--num-draft-tokens must be 0 or more")
    speculate = args.speculate or ("draft" if args.draft_model else "ngram")
    if speculate == "draft" and not args.draft_model:
        raise SystemExit("--speculate draft needs --draft-model PATH|HF-ID")
    if args.kv_store:
        from kv_cache import check_store_url

        try:
            check_store_url(args.kv_store)
        except ValueError as e:
            raise SystemExit(f"--kv-store: {e}")
    replay = None if args.kv_events_replay == "off" else args.kv_events_replay
    for flag, endpoint in (("--kv-events", args.kv_events), ("--kv-events-replay", replay)):
        if endpoint:
            from .engine.kv_events import check_endpoint

            try:
                check_endpoint(endpoint)
            except ValueError as e:
                raise SystemExit(f"{flag}: {e}")
    if args.model_ttl_s is not None and args.model_ttl_s <= 0:
        raise SystemExit("--model-ttl must be a positive number of seconds")
    for pin in args.pin_models:
        from .models.on_demand import source_of

        if source_of(pin) is None:
            raise SystemExit(f"--pin {pin!r}: want a model folder, a .gguf file or a Hugging "
                             "Face id 'org/name'")
    aliases = []
    for a in args.model_aliases:
        name, sep, served = a.partition("=")
        if not sep or not name.strip() or not served.strip():
            raise SystemExit(f"--model-alias {a!r}: want NAME=SERVED (e.g. 'claude-*=default')")
        aliases.append((name.strip(), served.strip()))
    return ServerConfig(
        models=args.models or ["default"], model_aliases=aliases, host=args.host, port=args.port,
        allow_models=args.allow_models, allow_download=args.allow_download,
        pin_models=args.pin_models, model_ttl_s=args.model_ttl_s,
        max_tokens=args.max_tokens, temperature=args.temp,
        kv_cache_dir=None if args.no_disk_cache else (args.kv_cache_dir or default_cache_dir()),
        max_kv_size_gb=args.max_kv_size_gb, max_kv_ram_gb=args.max_kv_ram_gb,
        memory_limit_gb=args.memory_limit_gb, memory_reserve_gb=args.memory_reserve_gb,
        page_size=args.page_size, max_resident_sequences=args.max_resident_sequences,
        kv_bits=args.kv_bits, max_batch=args.max_batch, max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk, speculate=speculate,
        num_draft_tokens=args.num_draft_tokens, draft_model=args.draft_model,
        eviction_policy=args.eviction_policy, api_key=args.api_key, kv_store=args.kv_store,
        kv_store_namespace=args.kv_store_namespace, kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic or "",
        kv_events_format=args.kv_events_format,
        cors_origins=args.cors_origins, allowed_hosts=args.allowed_hosts,
        dequantize=False if args.keep_quantized else None,
        volatile_rules=not args.no_volatile_rules, volatile_rule=args.volatile_rule,
        volatile_rule_files=args.volatile_rules, max_images=args.max_images,
        allow_image_urls=args.allow_image_urls)
