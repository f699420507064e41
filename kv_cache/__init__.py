"""A paged, shared, disk-persisted KV cache for mlx-lm models: the library's way in.

A user (the server) describes a model's cache (``spec_of_model``: a ``CacheSpec``), opens it
with ``open_cache`` and works through the ``CacheManager`` it returns: ``start`` a sequence for a
prompt and its image spans, if any (a ``Match`` says what it reused), ``save`` it under a key,
``keep`` it resident, ``report`` and ``describe`` for stats. ``export_entry``/``import_entry`` (and ``export_key``)
move an entry between servers as a file (``TransferError``, ``FormatError`` where one is not
ours); ``OutOfBlocksError`` says the pages ran out. ``parse_kv_bits`` and ``check_store_url``
check ``open_cache``'s settings before a model is loaded. ``watch_pages`` tells an observer
(``CacheEvents``) of the pages (``StoredPage``) each tier holds, stores and removes: what a
publisher of KV cache events for a router reads (``kv_cache.pages.events``).

A model runner's hooks around a forward pass are ``kv_cache.hooks``; ``layout/``, ``pages/``,
``model/`` and ``tiers/`` are the library's own layers, for its own use.
"""

from kv_cache.errors import FormatError, OutOfBlocksError
from kv_cache.events import watch_pages
from kv_cache.layout.quant import parse_bits as parse_kv_bits
from kv_cache.layout.spec import CacheSpec
from kv_cache.lookup import Match
from kv_cache.manager import CacheManager
from kv_cache.model.spec_reader import spec_of_model
from kv_cache.opening import check_store_url, open_cache
from kv_cache.pages.events import CacheEvents, StoredPage
from kv_cache.pages.spans import Span
from kv_cache.transfer import TransferError, export_entry, export_key, import_entry

__all__ = ["CacheEvents", "CacheManager", "CacheSpec", "FormatError", "Match", "OutOfBlocksError",
           "Span", "StoredPage", "TransferError", "check_store_url", "export_entry", "export_key",
           "import_entry", "open_cache", "parse_kv_bits", "spec_of_model", "watch_pages"]
