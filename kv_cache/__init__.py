"""A paged, shared, disk-persisted KV cache for mlx-lm models: the library's way in.

A user (the server) opens one model's cache with ``open_cache`` and works through the
``CacheManager`` it returns (``start`` a sequence for a prompt, ``save`` it under a key, ``keep``
it resident, ``report`` and ``describe`` for stats, ``share_prefixes`` once the model is known to
batch) and the names below (the runner's ``forward``/``install``/``batch_caches`` (or
``ragged_caches`` where ``can_go_ragged``) around a forward pass; ``with_kv_bits`` for pages in
bits, ``key_block_for`` for their keys' scales; ``check_store_url`` for ``--kv-store``);
``layout/``, ``pages/``, ``model/`` and ``tiers/`` are the library's own layers.
"""

from kv_cache.errors import FormatError, OutOfBlocksError
from kv_cache.manager import CacheManager, Match
from kv_cache.model.attention import OWN_KEYS_APART, forward, install
from kv_cache.model.batch import batch_caches, can_go_ragged, finish_batch, ragged_caches
from kv_cache.model.sequence import PagedSequence
from kv_cache.layout.quant import parse_bits as parse_kv_bits
from kv_cache.layout.spec import CacheSpec, key_block_for, with_kv_bits
from kv_cache.model.spec_reader import spec_of_model
from kv_cache.model.state_points import boundaries
from kv_cache.opening import check_store_url, open_cache
from kv_cache.tiers.disk import atomic_fs
from kv_cache.tokens import common_prefix
from kv_cache.transfer import TransferError, export_entry, export_key, import_entry

__all__ = ["CacheManager", "CacheSpec", "FormatError", "Match", "OWN_KEYS_APART",
           "OutOfBlocksError", "PagedSequence", "TransferError", "atomic_fs", "batch_caches",
           "boundaries", "can_go_ragged", "check_store_url", "common_prefix", "export_entry",
           "export_key", "finish_batch", "forward", "import_entry", "install", "key_block_for",
           "open_cache", "parse_kv_bits", "ragged_caches", "spec_of_model", "with_kv_bits"]
