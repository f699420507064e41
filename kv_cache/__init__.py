"""A paged, shared, disk-persisted KV cache for mlx-lm models: the library's way in.

A user (the server) opens one model's cache with ``open_cache`` and works through the
``CacheManager`` it returns (``start`` a sequence for a prompt, ``save`` it under a key, ``keep``
it resident, ``report`` and ``describe`` for stats, ``share_prefixes`` once the model is known to
batch) and the names below; ``pages/``, ``model/`` and ``tiers/`` are the library's own layers.
"""

from kv_cache.errors import FormatError, OutOfBlocksError
from kv_cache.manager import CacheManager, Match
from kv_cache.model.sequence import PagedSequence
from kv_cache.model.spec import CacheSpec, spec_of_model
from kv_cache.model.state_points import boundaries
from kv_cache.opening import open_cache
from kv_cache.tiers.disk import atomic_fs
from kv_cache.tokens import common_prefix
from kv_cache.transfer import TransferError, export_entry, export_key, import_entry

__all__ = ["CacheManager", "CacheSpec", "FormatError", "Match", "OutOfBlocksError",
           "PagedSequence", "TransferError", "atomic_fs", "boundaries", "common_prefix",
           "export_entry", "export_key", "import_entry", "open_cache", "spec_of_model"]
