"""The KV cache's entries as the API's cache routes reach them (``/v1/kv_cache/...``): the
stats, an entry's description and deletion, its export as one file and a file's import. Each
runs on the engine thread between two steps (``Engine.call``), except reading the message id a
file names, which reads its header alone (before MLX parses the file) where it is called.
A file that cannot be imported here is an :class:`EntryFileError`, whatever finds it."""

from __future__ import annotations

from pathlib import Path

from kv_cache import TransferError, export_key

from .engine import Engine


class EntryFileError(ValueError):
    """An export file that cannot be imported here (corrupt, foreign, malformed)."""


class CacheEntries:
    """The cache routes' calls, over ``engine``'s caches (every model's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def stats(self) -> dict:
        """Per model: the cache's tiers, reread tokens, the queue, speculation and memory."""
        return await self.engine.call(self.engine.cache_stats)

    async def describe(self, key: str) -> dict | None:
        """The entry saved under message id ``key`` (whichever model's), or None."""
        return await self.engine.call(lambda: self.engine.entry_info(key))

    async def delete(self, key: str) -> bool:
        """Drop ``key``'s entry from every tier; False when there was none."""
        return await self.engine.call(lambda: self.engine.delete_entry(key))

    async def export(self, key: str) -> tuple[str, bytes] | None:
        """(model, the entry as one safetensors file) or None when nothing is saved as ``key``."""
        return await self.engine.call(lambda: self.engine.export_entry(key))

    async def import_file(self, model: str, path: str | Path, key: str) -> dict:
        """Save export file ``path`` as ``key``'s entry in ``model``'s cache; its description."""
        try:
            return await self.engine.call(lambda: self.engine.import_entry(model, str(path), key))
        except TransferError as e:
            raise EntryFileError(str(e)) from None

    @staticmethod
    def file_key(path: str | Path) -> str | None:
        """The message id export file ``path`` names (unchecked), or None; its header is checked
        to be well-formed safetensors that fits the file first."""
        try:
            return export_key(path)
        except TransferError as e:
            raise EntryFileError(str(e)) from None
