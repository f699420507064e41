"""The disk store's tests: ``stores`` opens stores and closes every one at the end."""

from __future__ import annotations

import pytest

from kv_cache.tiers.disk.store import DiskStore
from tests.kv_cache.tiers.disk.disk_helpers import GEO


@pytest.fixture
def stores():
    """Opens stores and closes every one at the end (a root is locked while a store has it)."""
    opened = []

    def make(root, **over):
        kw = {**GEO, "max_bytes": 1 << 30, **over}
        s = DiskStore(root, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
