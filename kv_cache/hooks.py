"""What a model runner uses around a forward pass over the manager's sequences.

``install`` routes a model's attention through the cache's (once, at start-up); ``forward`` runs
one sequence's tokens; ``batch_caches`` (or ``ragged_caches``, where
``CacheManager.can_go_ragged``) gives many sequences' caches to one pass and ``finish_batch``
puts their stepped states back; ``OWN_KEYS_APART`` is the length from which a batch's own keys
are read apart, row by row (the runner's memory estimate counts it). ``PagedSequence`` is what
``CacheManager.start`` hands out and these run over. ``boundaries`` gives a prompt's message
boundaries for ``CacheManager.start`` (where a model with recurrent state snapshots it), and
``common_prefix`` compares token ids as the cache verifies a reuse. ``Bidirectional`` is the
``mask`` a model's attention is given for a prompt piece whose runs of tokens (an image's, in
Gemma 3) attend to each other both ways.

The package root (``kv_cache``) is the way in for a user of the cache and this module the
runner's; the server imports nothing else of the library (``tests/test_architecture.py``).
"""

from kv_cache.model.attention import OWN_KEYS_APART, forward, install
from kv_cache.model.masks import Bidirectional
from kv_cache.model.batch import batch_caches, finish_batch, ragged_caches
from kv_cache.model.sequence import PagedSequence
from kv_cache.model.state_points import boundaries
from kv_cache.tokens import common_prefix

__all__ = ["OWN_KEYS_APART", "Bidirectional", "PagedSequence", "batch_caches", "boundaries",
           "common_prefix", "finish_batch", "forward", "install", "ragged_caches"]
