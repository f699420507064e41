"""A put made ready, then written: its records checked against its tokens and the model, and the
page and tail files it must write (only those no stored file holds).

Sealed pages must chain over the entry's tokens (and image spans), per group, with the data's shape
of that group; a page the store has needs no data. An entry's open tail page (per group) is written
only when no stored file holds it: a full page continuing it, or a longer tail
(``StoreIndex.holder``); else that file holds it and nothing is written. Inconsistent records are a
``ValueError``; a manifest that cannot be written (a header over the cap) is a refusal, counted.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kv_cache.errors import FormatError
from kv_cache.pages.hashing import chain_hashes, page_hash
from kv_cache.pages.spans import Span, as_spans, page_extras
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing
from kv_cache.tiers.disk.index import FileInfo, StoreIndex, token_array

log = logging.getLogger("kv_cache.tiers.disk.store")


@dataclass
class NewFile:
    """A page or tail file a put writes."""

    hash: bytes
    chunks: list
    size: int
    info: FileInfo


@dataclass
class Manifest:
    """An entry's manifest as a put writes it."""

    chunks: list
    hashes: list[bytes]  # its sealed full pages, group after group
    size: int
    tail_parents: tuple[bytes, ...]  # per group, its open tail page's parent (if it has one)


@dataclass
class Prepared:
    """What a put writes: its tokens, new page and tail files, manifest (None: refused),
    layout, and the stored files that hold its open tail pages."""

    tokens: tuple[int, ...]
    new_files: list[NewFile]
    manifest: Manifest | None
    layout: list[tuple[int, int]]
    held: set[bytes]
    spans: tuple[Span, ...] = ()  # the image spans among its tokens



def prepare(index: StoreIndex, key, tokens, pages, tails=None, layout=None,
            state=None, spans=()) -> Prepared:
    """Check a put (``DiskStore.put``) and make its files."""
    spans = as_spans(spans)
    if not isinstance(key, str):
        raise ValueError("a key is a str")
    tokens = tuple(int(t) for t in tokens)
    if any(not fmt.INT64[0] <= t < fmt.INT64[1] for t in tokens):
        raise ValueError("token ids must fit int64")
    P, geo = index.geo.page_size, index.geo
    sealed = [p for p in pages if p.hash is not None]
    rest = list(pages[len(sealed):])
    if len(rest) > 1 or any(p.hash is not None for p in rest):
        raise ValueError("pages are sealed full pages, then at most one open tail page")
    tails = dict(tails or {})
    if rest:
        if not 0 < len(rest[0].tokens) < P or rest[0].data is None:
            raise ValueError(f"the open tail page holds 1..{P - 1} tokens and its data")
        tails[0] = rest[0].data
    full, groups = len(tokens) // P, geo.spec.groups
    layout = [(0, len(sealed))] if layout is None else [tuple(x) for x in layout]
    if len(layout) != len(groups):
        raise ValueError(f"a layout per group: {len(groups)} wanted")
    if any(skip + count != full for skip, count in layout) \
            or sum(c for _, c in layout) != len(sealed):
        raise ValueError("the pages do not make up the entry's tokens")
    if (len(tokens) % P) and set(tails) != set(range(len(groups))) \
            or not (len(tokens) % P) and tails:
        raise ValueError("an open tail page per group when the tokens end inside a page")
    if (state is None) == geo.spec.has_state and tokens:
        raise ValueError("an entry of this model carries its recurrent state"
                         if geo.spec.has_state else "this model has no recurrent state")
    new_pages, new_set, hashes, at, parents = [], set(), [], 0, []
    for g, (skip, count) in enumerate(layout):
        chain = chain_hashes(geo.root(g), tokens, P, spans=spans)
        parents.append(chain[-1] if chain else geo.root(g))
        group_pages = sealed[at : at + count]
        at += count
        for i, p in enumerate(group_pages, start=skip):
            h = bytes(p.hash)
            if p.group != g or len(p.tokens) != P or chain[i] != h \
                    or tuple(p.tokens) != tokens[i * P : (i + 1) * P]:
                raise ValueError("sealed pages must be full and their hashes chain over "
                                 "the tokens")
            hashes.append(h)
            if p.data is not None:
                _check_shape(geo, p.data, P, g)
                if h in index.pages and not index.page_file_exists(h):
                    index.lost_page(h)
                if h not in index.pages and h not in new_set:
                    new_set.add(h)
                    parent = geo.root(g) if i == 0 else chain[i - 1]
                    extras = page_extras(spans, i * P, P)
                    chunks, data_sum = fmt.page_file(geo, h, parent, p.tokens, p.data, g, extras)
                    new_pages.append(NewFile(h, chunks, framing.nbytes(chunks), FileInfo(
                        parent, token_array(p.tokens), g, False, data_sum,
                        framing.head_digest(chunks[0]), extras)))
            elif h not in index.pages:
                raise ValueError(f"page {h.hex()[:12]} is not on disk and came without data")
    n_tail, held = len(tokens) % P, set()
    tail = token_array(tokens[len(tokens) - n_tail:]) if n_tail else None
    extras = page_extras(spans, len(tokens) - n_tail, n_tail)
    for g, data in sorted(tails.items()):
        _check_shape(geo, data, n_tail, g)
        holder = index.holder(g, parents[g], tail, extras)
        if holder is not None and not index.page_file_exists(holder):
            index.lost_page(holder)
            holder = index.holder(g, parents[g], tail, extras)
        if holder is not None:
            held.add(holder)  # NOTE: a stored page or longer tail holds it: nothing written
            continue
        h = page_hash(parents[g], tail.tolist(), extras)
        chunks, data_sum = fmt.page_file(geo, h, parents[g], tail.tolist(), data, g, extras)
        new_pages.append(NewFile(h, chunks, framing.nbytes(chunks),
                                 FileInfo(parents[g], tail, g, True, data_sum,
                                          framing.head_digest(chunks[0]), extras)))
    try:
        chunks = fmt.entry_file(geo, key, tokens, hashes, layout, state, spans)
    except FormatError as e:
        log.warning("disk store: entry refused: %s", e)
        index.counts.refused += 1
        return Prepared(tokens, new_pages, None, layout, held, spans)
    return Prepared(tokens, new_pages, Manifest(chunks, hashes, framing.nbytes(chunks),
                                                tuple(parents) if n_tail else ()),
                    layout, held, spans)


def _check_shape(geo: fmt.Geometry, data, n: int, group: int = 0) -> None:
    if list(data.shape) != geo.shape(n, group):
        raise ValueError(f"page data of shape {data.shape}; {geo.shape(n, group)} "
                         "expected")


def write_files(index: StoreIndex, new_pages: list[NewFile]) -> None:
    """Write new page and tail files as one batch (one full flush); index each as it
    lands."""
    fds: dict[tuple[bool, str], int] = {}
    try:
        for p in new_pages:
            d = (p.info.partial, p.hash.hex()[:2])
            if d not in fds:
                fds[d] = afs.open_dir(d[1], index.dirs.tails_fd if d[0] else index.dirs.pages_fd,
                                      create=True)

        def landed(i: int, size: int) -> None:
            index.file_landed(new_pages[i].hash, size, new_pages[i].info)

        afs.atomic_write_many([(fds[(p.info.partial, p.hash.hex()[:2])],
                                p.hash.hex() + ".safetensors", p.chunks, None)
                               for p in new_pages], landed)
    finally:
        for fd in fds.values():
            os.close(fd)
