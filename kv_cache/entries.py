"""The manager's plain values: an ``Entry`` (a saved sequence: its tokens, the pages of each
group, its recurrent state) and a ``Match`` (what a new prompt reuses, and where it was found).
They live apart from the manager so that its parts (saving, restoring) can name them without
importing the manager."""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.model.sequence import Snapshot
from kv_cache.tiers.base import FoundPrefix, StoredEntry


@dataclass(slots=True)
class Entry:
    key: str
    tokens: tuple[int, ...]
    tables: list[list[int | None]]  # per cache group; None: a page no window at the end reads
    state: Snapshot | None = None  # recurrent state after ``tokens``

    @property
    def blocks(self) -> list[int | None]:
        """Group 0's pages."""
        return self.tables[0] if self.tables else []


@dataclass(slots=True)
class Match:
    tokens: int  # prompt tokens whose keys and values are reused
    tables: list[list[int | None]]
    source: str  # "entry:<key>", "disk:<key>", "prefix", "disk-prefix" or "none"
    stored: StoredEntry | None = None
    state: Snapshot | None = None
    found: FoundPrefix | None = None  # a prefix the disk's files hold, found by its content

    @property
    def blocks(self) -> list[int | None]:
        return self.tables[0] if self.tables else []
