"""Export and import of one entry's cache as a single self-describing safetensors file.

Both go through the manager's public surface: an export reads the entry's pages while the
manager holds them (``CacheManager.holding``); an import writes the file's keys and values into
pool pages, as a restore from disk does, and keeps them with ``CacheManager.save``. An entry with
images carries its image spans (metadata ``spans``, in the checksum); one without has none, as
before images.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx

from kv_cache.errors import FormatError
from kv_cache.entries import Entry
from kv_cache.manager import CacheManager
from kv_cache.model.sequence import PagedSequence
from kv_cache.pages.spans import as_spans, page_extras
from kv_cache.tiers.disk.file_format import read_header

FORMAT = "mlx-kvcache-export"
VERSION = "2"


class TransferError(ValueError):
    """An export file that cannot be imported here (corrupt, foreign, malformed)."""


def _checksum(tensors: dict[str, mx.array], tokens, spans=()) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(json.dumps(list(tokens)).encode())
    if spans:  # NOTE: an export of text is checked as it always was
        h.update(_spans_json(spans).encode())
    for name in sorted(tensors):
        kv = tensors[name]
        h.update(name.encode())
        h.update(memoryview(kv.view(mx.uint16) if kv.dtype == mx.bfloat16 else kv))
    return h.hexdigest()


def _gather(pool, tables, n: int) -> dict[str, mx.array]:
    """Per group ``kv.<g>``: the positions of the first ``n`` a window at ``n`` reads (all, for
    full attention)."""
    P, out = pool.page_size, {}
    for g, (spec, table) in enumerate(zip(pool.groups, tables)):
        start = spec.kind.keep_from(n, P)
        blocks = table[spec.kind.pages(n, P)]
        if None in blocks:
            return {}
        out[f"kv.{g}"] = pool.gather(blocks, n - start)
    return out


def _spans_json(spans) -> str:
    return json.dumps([list(s) for s in spans])


def entry_kv(manager: CacheManager, key: str):
    """The tokens, tensors (``kv.<group>`` pages, ``state.<slot>.<i>``) and image spans of
    ``key``, from memory or disk; None when neither has it whole."""
    pool = manager.pool
    with manager.holding(key) as found:
        if found is None:
            return None
        tokens, tables, state, spans = found
        tensors = _gather(pool, tables, len(tokens))
        mx.eval(list(tensors.values()))
    if len(tensors) != len(pool.groups):
        return None
    for si, arrays in enumerate(state or []):
        for i, a in enumerate(arrays):
            tensors[f"state.{si}.{i}"] = a
    return tokens, tensors, spans


def export_entry(manager: CacheManager, key: str) -> bytes | None:
    """One safetensors file holding ``key``'s whole cache, or None if unknown."""
    found = entry_kv(manager, key)
    if found is None:
        return None
    tokens, tensors, spans = found
    tensors = {k: mx.contiguous(v) for k, v in tensors.items()}
    mx.eval(list(tensors.values()))
    pool = manager.pool
    meta = {"format": FORMAT, "format_version": VERSION, "fingerprint": pool.fingerprint,
            "key": key, "tokens": json.dumps(list(tokens)), "cache_spec": pool.spec.to_json(),
            "checksum": _checksum(tensors, tokens, spans)}
    if spans:
        meta["spans"] = _spans_json(spans)
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(path, tensors, metadata=meta)
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def export_key(path: str | Path) -> str | None:
    """The ``key`` an export file's metadata names (unchecked), after a strict check that its
    header is well-formed safetensors that fits the file (before MLX parses it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            header = read_header(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    except FormatError as e:
        raise TransferError(str(e))
    return header.metadata.get("key")


def read_export(path: str | Path) -> tuple[dict, dict[str, mx.array]]:
    """Parse and verify an export file; ``TransferError`` for anything wrong with it."""
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise TransferError(f"not a readable safetensors file: {e}")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TransferError("not a KV cache export file")
    if meta.get("format_version") != VERSION:
        raise TransferError(f"unsupported export version {meta.get('format_version')!r}")
    try:
        tokens = json.loads(meta["tokens"])
        assert isinstance(tokens, list) and all(type(t) is int and 0 <= t < 2**31
                                                for t in tokens)
    except (KeyError, ValueError, AssertionError):
        raise TransferError("the export's token ids are missing or malformed")
    if not isinstance(arrays, dict) or any(a.ndim == 5 and (a.shape[1] != 2 or
                                                            a.shape[3] > len(tokens))
                                           for k, a in arrays.items() if k.startswith("kv.")):
        raise TransferError("the export's data does not match its token ids")
    try:
        spans = as_spans(json.loads(meta["spans"])) if "spans" in meta else ()
        assert all(s.end <= len(tokens) for s in spans)
    except (TypeError, ValueError, AssertionError):
        raise TransferError("the export's image spans are malformed")
    if meta.get("checksum") != _checksum(arrays, tokens, spans):
        raise TransferError("the export's checksum does not match its data")
    meta["tokens"], meta["spans"] = tokens, spans
    return meta, arrays


def import_entry(manager: CacheManager, path: str | Path, key: str | None = None) -> Entry:
    """Add an export file's cache under its key (or ``key``); it must be this model's."""
    meta, arrays = read_export(path)
    pool = manager.pool
    if meta.get("fingerprint") != pool.fingerprint:
        raise TransferError("the export was made with another model (fingerprint differs)")
    tokens = meta["tokens"]
    if not tokens:
        raise TransferError("the export holds no tokens")
    n, P = len(tokens), pool.page_size
    want = {}
    for g, spec in enumerate(pool.groups):
        want[f"kv.{g}"] = (spec.stored_shape(n - spec.kind.keep_from(n, P)),
                           getattr(mx, spec.stored_dtype))
    for si, s in enumerate(pool.spec.states):
        for i, (shape, dt) in enumerate(zip(s.shapes, s.dtypes)):
            want[f"state.{si}.{i}"] = (tuple(shape), getattr(mx, dt))
    got = {k: (tuple(a.shape), a.dtype) for k, a in arrays.items()}
    if got != want:
        raise TransferError("the export's layout does not fit this model")
    key = key or meta.get("key")
    if not isinstance(key, str) or not key:
        raise TransferError("the export names no key and none was given")
    state = [[arrays[f"state.{si}.{i}"] for i in range(len(s.shapes))]
             for si, s in enumerate(pool.spec.states)] or None
    tables: list[list[int | None]] = []
    try:
        for g in range(len(pool.groups)):
            tables.append([])
            _write_pages(pool, g, tokens, arrays[f"kv.{g}"], tables[-1], manager.with_room,
                         meta["spans"])
        with PagedSequence(pool, tokens, tables, state, spans=meta["spans"]) as seq:
            return manager.save(key, seq)
    finally:
        for t in tables:
            pool.release_all(t)


def _write_pages(pool, g: int, tokens: list[int], kv: mx.array, table: list,
                 with_room, spans) -> None:
    """Group ``g``'s pages of ``tokens`` from ``kv``, which holds the positions from the first
    page a window at the end reads (all, for full attention), appended to ``table`` held: full
    pages sealed (the pool's own copy where it has one), the open tail written to a new page.
    ``with_room``: the manager's (``CacheManager.with_room``), room made for each page.
    ``spans``: the image spans among ``tokens`` (the pages' hashes carry them)."""
    n, P = len(tokens), pool.page_size
    skip = pool.groups[g].kind.first_page(n, P)
    chain = pool.chain(tokens[: n // P * P], g, spans)
    table += [None] * skip
    for i in range(skip, -(-n // P)):
        a, b = i * P, min((i + 1) * P, n)
        data = mx.contiguous(kv[:, :, :, a - skip * P : b - skip * P, :])
        if b - a == P:
            parent = chain[i - 1] if i else pool.roots[g]
            extras = page_extras(spans, a, P)
            table.append(with_room(lambda: pool.add_sealed(parent, tokens[a:b], data, g, chain[i],
                                                           extras)))
        else:
            (block,) = with_room(lambda: pool.allocate(1, g))
            table.append(block)
            pool.write(block, data, tokens[a:b])
    mx.eval([pool.data(b) for b in table if b is not None])
