"""Keys and values of the shared store: what one server writes and every other checks.

Keys (``Keys``)::

    <namespace>:<version>:<model>:page:<page hash hex>     a sealed page or an open tail page
    <namespace>:<version>:<model>:entry:<sha256(key) hex>  an entry's manifest

``version`` is this layout's and the disk format's (``kv_cache.tiers.disk.file_format``);
``model`` digests the model's fingerprint, page size and cache spec (its layers, heads, head
size, KV dtype, windows, state slots). A message id is client input: only its hash is a key
(invariant 7). Pages are content-addressed, so a page's value is the same whoever writes it
(``SET NX``).

A value is a header of ours and the file the disk tier would write (``page_file``,
``entry_file``: its own metadata and checksums)::

    magic "MKVS" | version u16 | kind u8 | 0 u8 | model digest 16 B | id 32 B
    | payload length u64 | xxh3-128 of the payload 16 B | payload

``check`` takes nothing on trust (invariant 8): length, magic, version, kind, model, the key's
own id and the checksum, and then the disk format's checks of the payload (format version,
fingerprint, cache spec, the page hash over its parent and tokens, the data checksum). Any
failure is ``BadValue``: the caller counts a miss and deletes the value.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

from kv_cache.tiers.disk import file_data
from kv_cache.tiers.disk import file_format as fmt

MAGIC = b"MKVS"
VERSION = 1
PAGE, ENTRY = 1, 2
HEADER = struct.Struct("<4sHBx16s32sQ16s")


class BadValue(Exception):
    """A value that is not a valid one of ours for this key and model."""


def model_digest(geo: fmt.Geometry) -> bytes:
    """What identifies the model's KV bytes: fingerprint, page size, cache spec."""
    h = hashlib.sha256(b"kv-store-model\0")
    for part in (geo.fingerprint, str(geo.page_size), geo.spec.to_json()):
        h.update(part.encode() + b"\0")
    return h.digest()[:16]


def entry_id(key: str) -> bytes:
    """A message id's stand-in: its sha256 (the raw id is never a key nor in a value)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Keys:
    """The key names of one namespace and model."""

    prefix: str

    @classmethod
    def of(cls, namespace: str, geo: fmt.Geometry) -> "Keys":
        if not namespace or any(c in namespace for c in ": \r\n\0"):
            raise ValueError(f"a store namespace is a word without ':' or spaces: {namespace!r}")
        return cls(f"{namespace}:v{VERSION}.{fmt.FORMAT_VERSION}:{model_digest(geo).hex()}:")

    def page(self, h: bytes) -> str:
        return f"{self.prefix}page:{h.hex()}"

    def entry(self, key: str) -> str:
        return f"{self.prefix}entry:{entry_id(key).hex()}"


def wrap(geo: fmt.Geometry, kind: int, ident: bytes, chunks) -> list:
    """A value as chunks (no copy of the payload): our header, then ``chunks``."""
    x = xxhash.xxh3_128()
    size = 0
    for c in chunks:
        x.update(c)
        size += memoryview(c).nbytes
    head = HEADER.pack(MAGIC, VERSION, kind, model_digest(geo), ident, size, x.digest())
    return [head, *chunks]


def join(chunks) -> bytes:
    """Chunks as one value (the client sends bytes)."""
    return b"".join(bytes(memoryview(c).cast("B")) if not isinstance(c, bytes) else c
                    for c in chunks)


def unwrap(geo: fmt.Geometry, kind: int, ident: bytes, value: bytes | None) -> memoryview:
    """The payload of ``value`` after every check of our header; ``BadValue`` otherwise."""
    if value is None:
        raise BadValue("absent")
    if len(value) < HEADER.size:
        raise BadValue("truncated header")
    magic, version, k, model, got_id, size, digest = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BadValue("not a value of ours")
    if version != VERSION or k != kind:
        raise BadValue(f"format {version}/{k}, {VERSION}/{kind} expected")
    if model != model_digest(geo):
        raise BadValue("another model's value")
    if got_id != ident:
        raise BadValue("the value of another key")
    payload = memoryview(value)[HEADER.size:]
    if len(payload) != size:
        raise BadValue(f"length {len(payload)}, {size} expected")
    if xxhash.xxh3_128_digest(payload) != digest:
        raise BadValue("checksum mismatch")
    return payload


def page_value(geo: fmt.Geometry, h: bytes, parent: bytes, tokens, data, group: int,
               extras=()) -> bytes:
    """A page's (or open tail page's) value, with its image keys ``extras``: the disk tier's
    file of it, wrapped."""
    chunks, _ = fmt.page_file(geo, h, parent, tokens, data, group, extras)
    return join(wrap(geo, PAGE, h, chunks))


def check_page(geo: fmt.Geometry, h: bytes, value: bytes | None, tail: bool = False):
    """A page value, every check passed: (storage-form numpy view of its data, dtype name).
    Runs no MLX (``file_data.to_array`` makes the array on the caller's thread)."""
    payload = bytes(unwrap(geo, PAGE, h, value))  # NOTE: the disk's parser takes bytes
    try:
        return file_data.check_page(geo, payload, h, fmt.TAIL_FORMAT if tail else fmt.PAGE_FORMAT)
    except fmt.FormatError as e:  # ForeignError is one too
        raise BadValue(str(e)) from e


def entry_value(geo: fmt.Geometry, key: str, tokens, hashes, layout, state,
                spans=()) -> bytes:
    """An entry's manifest value (with its image ``spans``): the disk tier's manifest under the
    id's hash, wrapped."""
    ident = entry_id(key)
    chunks = fmt.entry_file(geo, ident.hex(), tokens, hashes, layout, state, spans)
    return join(wrap(geo, ENTRY, ident, chunks))


def check_entry(geo: fmt.Geometry, key: str, value: bytes | None):
    """A manifest value, every check passed: (``EntryMetaInfo``, its state tensors)."""
    ident = entry_id(key)
    payload = unwrap(geo, ENTRY, ident, value)
    try:
        info, tensors = file_data.decode_entry(geo, bytes(payload))
    except fmt.FormatError as e:
        raise BadValue(str(e)) from e
    if info.key != ident.hex():
        raise BadValue("the manifest of another key")
    return info, tensors
