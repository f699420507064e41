"""The manager's counters, one object that each of its parts counts into (hits and misses where
a sequence starts, pages read where a restore reads them, saves where the disk writer writes,
entries dropped where room is made); ``CacheManager.report`` reads them out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ManagerStats:
    hits: int = 0
    misses: int = 0
    tokens_served: int = 0
    disk_hits: int = 0
    tokens_from_disk: int = 0
    pages_read_from_disk: int = 0
    entries_dropped: int = 0
    disk_saves: int = 0
    disk_save_failures: int = 0
