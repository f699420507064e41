"""One model's cache, built in one call: the page pool (its pages in bits where asked), the
disk store under the cache directory, and the manager over them (``open_cache``; the library's
way in: ``kv_cache``); and ``check_store_url``, to check a setting before any model is
loaded.

Prefix views are not made here: whether a model reads shared prefixes through them is known only
once its forward passes have been tried on sequences of this manager (the runner's start-up
probe), which then turns them on (``CacheManager.share_prefixes``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from kv_cache.manager import CacheManager
from kv_cache.layout.quant import parse_bits
from kv_cache.layout.spec import CacheSpec, key_block_for, with_kv_bits
from kv_cache.pages.pool import PagePool
from kv_cache.tiers.disk.file_format import Geometry
from kv_cache.tiers.disk.store import DiskStore

log = logging.getLogger("kv_cache")


def open_cache(spec: CacheSpec, fingerprint: str, *, page_size: int, max_ram_bytes: int,
               policy: str, disk_dir: Path | None, max_disk_bytes: int, max_resident: int,
               about: dict | None = None, store_url: str | None = None,
               store_namespace: str = "kv", kv_bits: int | str | tuple | None = None,
               max_arrays_bytes: int = 0) -> CacheManager:
    """The manager of one model's cache: pages of ``page_size`` tokens within ``max_ram_bytes``,
    and (unless ``disk_dir`` is None) a disk store within ``max_disk_bytes`` in its own
    directory under ``disk_dir``; ``policy`` names the eviction policy of both. ``about`` (the
    model's name and source, say) is written beside the store as ``model.json`` for people
    looking at the directory. ``store_url``: a page store shared with other servers, below
    the disk (``kv_cache.tiers.store``), its keys under ``store_namespace``. ``kv_bits``: pages
    in bits (``kv_cache.parse_kv_bits``; ``with_kv_bits``, keys per channel over a page where
    ``key_block_for`` says so), a setting that enters the fingerprint. ``max_arrays_bytes``:
    the keyed arrays kept in memory (``kv_cache.arrays``; on disk they share
    ``max_disk_bytes`` with the entries)."""
    if parse_bits(kv_bits) is not None:
        block = key_block_for(spec, kv_bits, page_size)
        spec, fingerprint = with_kv_bits(spec, fingerprint, kv_bits, block)
        log.info("%s: KV pages in %s bits, keys scaled %s",
                 (about or {}).get("name", fingerprint[:16]), kv_bits,
                 f"per channel over pages of {block}" if block else "per position")
    pool = PagePool(spec=spec, page_size=page_size, max_bytes=max_ram_bytes, policy=policy,
                    fingerprint=fingerprint)
    store = None if disk_dir is None else open_store(
        Path(disk_dir), spec, fingerprint, page_size=page_size, max_bytes=max_disk_bytes,
        policy=policy, about=about or {})
    if store_url:
        from kv_cache.tiers.store import below_disk

        store = below_disk(store, store_url, store_namespace,
                           Geometry(fingerprint, page_size, spec))
    return CacheManager(pool, store, max_resident=max_resident,
                        max_arrays_bytes=max_arrays_bytes)


def open_store(disk_dir: Path, spec: CacheSpec, fingerprint: str, *, page_size: int,
               max_bytes: int, policy: str, about: dict) -> DiskStore | None:
    """The model's disk store under ``disk_dir/<fingerprint prefix>``, or None (logged) when
    the directory cannot be used: the cache then lives in memory only."""
    root = disk_dir / hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    name = about.get("name", fingerprint[:16])
    if root.is_symlink():  # NOTE: planted in our directory; following it would leave the tree
        log.warning("disk cache: %s is a symlink, not a directory; removed", root)
        try:
            root.unlink()
        except OSError:
            pass
    try:
        store = DiskStore(root, fingerprint=fingerprint, spec=spec, page_size=page_size,
                          max_bytes=max_bytes, policy=policy)
    except Exception as e:  # unreadable dir, locked by another server, ...
        log.warning("disk cache for %s disabled: cannot open %s: %s", name, root, e)
        return None
    note = json.dumps({**about, "fingerprint": fingerprint})
    store.write_note("model.json", note.encode())
    log.info("disk cache for %s at %s (%d entries)", name, root, len(store.keys()))
    return store


def check_store_url(url: str) -> None:
    """Raise ``ValueError`` for a shared-store URL that ``open_cache`` could not use (no
    connection made)."""
    from kv_cache.tiers.store import normalize_url

    normalize_url(url)
