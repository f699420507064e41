"""The KV cache's own routes: stats, an entry's info and deletion, export and import."""

from __future__ import annotations

import os
import tempfile

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.cache_entries import CacheEntries, EntryFileError
from ..errors import RequestError, bad_request
from .http import body_chunks
from .validate import check_message_id


class KVRoutes:
    """Handlers over the engine's cache entries (:class:`CacheEntries`: run between steps)."""

    def __init__(self, served):
        self.served, self.config = served, served.config
        self.entries = CacheEntries(served.engine)

    def model_for(self, request, name):
        return self.served.model_for(request, name)

    async def kv_stats(self, request: Request) -> Response:
        stats = await self.entries.stats()
        return JSONResponse({"object": "kv_cache.stats", "models": stats})

    async def kv_entry(self, request: Request) -> Response:
        key = path_key(request)
        if request.method == "DELETE":
            if not await self.entries.delete(key):
                raise no_entry(key)
            return JSONResponse({"object": "kv_cache.entry.deleted", "message_id": key,
                                 "deleted": True})
        info = await self.entries.describe(key)
        if info is None:
            raise no_entry(key)
        return JSONResponse(info)

    async def kv_export(self, request: Request) -> Response:
        key = path_key(request)
        found = await self.entries.export(key)
        if found is None:
            raise no_entry(key)
        model, data = found
        return Response(data, media_type="application/octet-stream", headers={
            "Content-Disposition": 'attachment; filename="kv-cache.safetensors"',
            "X-Model-Id": model})

    async def kv_import(self, request: Request) -> Response:
        key = check_message_id(request.query_params.get("message_id"), "message_id")
        lm = self.model_for(request, request.query_params.get("model"))
        limit = self.config.max_import_bytes
        fd, path = tempfile.mkstemp(suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in body_chunks(request, limit, "the file"):
                    f.write(chunk)
            try:
                named = self.entries.file_key(path)  # the header, before MLX reads the file
                if key is None:
                    if named is None:
                        raise bad_request("the file names no message_id; pass ?message_id=",
                                          "message_id", code="invalid_kv_cache_file")
                    key = check_message_id(named, "message_id")
                info = await self.entries.import_file(lm.name, path, key)
            except EntryFileError as e:
                raise bad_request(f"cannot import this file: {e}", code="invalid_kv_cache_file")
            return JSONResponse(info)
        finally:
            os.unlink(path)


def path_key(request: Request) -> str:
    return check_message_id(request.path_params["message_id"], "message_id")


def no_entry(key: str) -> RequestError:
    return RequestError(404, f"no KV cache entry for message_id {key!r}", type="not_found_error",
                    param="message_id", code="kv_cache_entry_not_found")
