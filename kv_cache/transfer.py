"""Export and import of one entry's cache as a single self-describing safetensors file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx

from .manager import CacheManager, Entry
from .sequence import PagedSequence

FORMAT = "mlx-kvcache-export"
VERSION = "1"


class TransferError(ValueError):
    """An export file that cannot be imported here (corrupt, foreign, malformed)."""


def _checksum(kv: mx.array, tokens) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(json.dumps(list(tokens)).encode())
    h.update(memoryview(kv.view(mx.uint16) if kv.dtype == mx.bfloat16 else kv))
    return h.hexdigest()


def entry_kv(manager: CacheManager, key: str) -> tuple[tuple[int, ...], mx.array] | None:
    """The tokens and ``[layers, 2, kv_heads, n, head_dim]`` keys/values of ``key``, from
    memory or disk; None when neither has it."""
    entry = manager.get(key)
    if entry is not None:
        return entry.tokens, manager.pool.gather(entry.blocks, len(entry.tokens))
    stored = manager.store.get(key) if manager.store is not None else None
    if stored is None:
        return None
    blocks = manager._load(stored, len(stored.tokens))
    try:
        if len(blocks) < -(-len(stored.tokens) // manager.pool.page_size):
            return None  # part of it is gone or corrupt
        kv = manager.pool.gather(blocks, len(stored.tokens))
        mx.eval(kv)
        return stored.tokens, kv
    finally:
        for b in blocks:
            manager.pool.release(b)


def export_entry(manager: CacheManager, key: str) -> bytes | None:
    """One safetensors file holding ``key``'s whole cache, or None if unknown."""
    found = entry_kv(manager, key)
    if found is None:
        return None
    tokens, kv = found
    kv = mx.contiguous(kv)
    mx.eval(kv)
    pool = manager.pool
    meta = {"format": FORMAT, "format_version": VERSION, "fingerprint": pool.fingerprint,
            "key": key, "tokens": json.dumps(list(tokens)), "dtype": str(pool.dtype),
            "num_layers": str(pool.num_layers), "num_kv_heads": str(pool.num_kv_heads),
            "head_dim": str(pool.head_dim), "checksum": _checksum(kv, tokens)}
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(path, {"kv": kv}, metadata=meta)
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def read_export(path: str | Path) -> tuple[dict, mx.array]:
    """Parse and verify an export file; ``TransferError`` for anything wrong with it."""
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise TransferError(f"not a readable safetensors file: {e}")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TransferError("not a KV cache export file")
    if meta.get("format_version") != VERSION:
        raise TransferError(f"unsupported export version {meta.get('format_version')!r}")
    kv = arrays.get("kv")
    try:
        tokens = json.loads(meta["tokens"])
        assert isinstance(tokens, list) and all(type(t) is int and 0 <= t < 2**31
                                                for t in tokens)
    except (KeyError, ValueError, AssertionError):
        raise TransferError("the export's token ids are missing or malformed")
    if kv is None or kv.ndim != 5 or kv.shape[1] != 2 or kv.shape[3] != len(tokens):
        raise TransferError("the export's data does not match its token ids")
    if meta.get("checksum") != _checksum(kv, tokens):
        raise TransferError("the export's checksum does not match its data")
    meta["tokens"] = tokens
    return meta, kv


def import_entry(manager: CacheManager, path: str | Path, key: str | None = None) -> Entry:
    """Add an export file's cache under its key (or ``key``); it must be this model's."""
    meta, kv = read_export(path)
    pool = manager.pool
    if meta.get("fingerprint") != pool.fingerprint:
        raise TransferError("the export was made with another model (fingerprint differs)")
    geometry = (pool.num_layers, 2, pool.num_kv_heads, pool.head_dim)
    if (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != geometry \
            or kv.dtype != pool.dtype:
        raise TransferError(f"the export's layout {kv.shape} {kv.dtype} does not fit this model")
    tokens = meta["tokens"]
    if not tokens:
        raise TransferError("the export holds no tokens")
    key = key or meta.get("key")
    if not isinstance(key, str) or not key:
        raise TransferError("the export names no key and none was given")
    seq = PagedSequence(pool)
    try:
        for i, layer in enumerate(seq.layers):
            layer.load(kv[i, 0][None], kv[i, 1][None])
            layer.offset = len(tokens)
        seq.tokens = list(tokens)
        return manager.save(key, seq)
    finally:
        seq.close()
