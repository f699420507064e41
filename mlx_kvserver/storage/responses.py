"""Stored responses of ``/v1/responses`` (``store: true``): what ``previous_response_id``,
``GET`` and ``DELETE /v1/responses/{id}`` read.

A record is a JSON object: ``response`` (the response object as the client got it) and
``history`` (the conversation that led to it, its answer last, as :func:`message_to_json`
writes it; ``instructions`` are not part of it). The store is a dict in memory, or one file per
response under ``root`` when given, so a follow-up works after a restart.

NOTE (invariants 5 and 7): a response id is client input: a file is named by the sha256 of the
id, never by the id; files are written atomically (temp file, fsync, rename); a file that is
truncated, corrupt or holds another id is a miss (logged, removed), never a crash. The store
keeps at most ``max_entries`` records and ``max_bytes`` on disk, dropping the oldest first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..chat.conversation import Image, Message, Reasoning, Text, ToolCall, ToolResult
from ..chat.images import decode_image, png_bytes
from ..errors import RequestError
from ..config import ServerConfig
from .files import TMP_PREFIX, UnsafeFile, open_folder, read_file, remove, write_file

log = logging.getLogger("mlx_kvserver.responses")

FORMAT = 1
SUFFIX = ".json"


def message_to_json(m: Message) -> dict:
    """A message as plain JSON (role, message_id, parts), the store's format."""
    parts: list[dict] = []
    for p in m.parts:
        if isinstance(p, Text):
            parts.append({"type": "text", "text": p.text})
        elif isinstance(p, Reasoning):
            parts.append({"type": "reasoning", "text": p.text})
        elif isinstance(p, ToolCall):
            parts.append({"type": "tool_call", "id": p.id, "name": p.name,
                          "arguments": p.arguments})
        elif isinstance(p, ToolResult):
            parts.append({"type": "tool_result", "call_id": p.call_id, "content": p.content,
                          "name": p.name, "is_error": p.is_error})
        elif isinstance(p, Image):  # its pixels, so a follow-up reads the same picture
            parts.append({"type": "image", "digest": p.digest,
                          "png": base64.b64encode(png_bytes(p)).decode("ascii")})
    return {"role": m.role, "message_id": m.message_id, "parts": parts}


def message_from_json(d: Any) -> Message:
    """The message :func:`message_to_json` wrote; ``ValueError`` for anything else."""
    try:
        parts: list = []
        for p in d["parts"]:
            kind = p["type"]
            if kind == "text":
                parts.append(Text(_str(p["text"])))
            elif kind == "reasoning":
                parts.append(Reasoning(_str(p["text"])))
            elif kind == "tool_call":
                parts.append(ToolCall(_str(p["id"]), _str(p["name"]), _str(p["arguments"])))
            elif kind == "tool_result":
                name = p.get("name")
                parts.append(ToolResult(_str(p["call_id"]), _str(p["content"]),
                                        None if name is None else _str(name),
                                        bool(p.get("is_error"))))
            elif kind == "image":
                parts.append(_image(p))
            else:
                raise ValueError(f"unknown part type {kind!r}")
        mid = d.get("message_id")
        return Message(_str(d["role"]), parts, None if mid is None else _str(mid))
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a stored message: {e}") from None


def _image(p: dict) -> Image:
    """A stored image part, read back and checked against the digest it was stored with."""
    try:
        image = decode_image(base64.b64decode(_str(p["png"]), validate=True), "stored image")
    except (binascii.Error, RequestError) as e:
        raise ValueError(f"a stored image does not decode: {e}") from None
    if image.digest != _str(p["digest"]):
        raise ValueError("a stored image is not the image it was stored as")
    return image


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("a string was expected")
    return v


def file_name(response_id: str) -> str:
    """The file a response is kept in: the sha256 of its id (ids are client input)."""
    return hashlib.sha256(response_id.encode("utf-8", "surrogatepass")).hexdigest() + SUFFIX


class ResponseStore:
    """Records by response id: in memory (``root`` None) or one JSON file each under ``root``."""

    def __init__(self, root: Path | None, max_entries: int = 2000, max_bytes: int = 1 << 30):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.root, self.max_entries, self.max_bytes = root, max_entries, max_bytes
        self._lock = threading.Lock()
        self._memory: OrderedDict[str, dict] = OrderedDict()  # root None: id -> record
        self._files: OrderedDict[str, int] = OrderedDict()  # root given: file -> size, oldest 1st
        self._fd: int | None = None
        self.memory = root is None
        if root is not None:
            self.root = Path(os.path.realpath(root))
            parent = self.root.parent
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(f"cannot create {self.root}")
            self._open(create=False)  # NOTE: the folder is made when the first record is kept

    @classmethod
    def open(cls, config: ServerConfig) -> ResponseStore:
        """The server's own store: next to the KV cache on disk (``responses/`` in its folder),
        or in memory (logged) when there is no cache folder or it cannot be used (shared through
        a KV store too: ``shared_responses.open_store``)."""
        if config.kv_cache_dir is None:
            return cls(None)
        try:
            return cls(config.kv_cache_dir / "responses")
        except OSError as e:
            log.warning("stored responses kept in memory only: cannot use %s: %s",
                        config.kv_cache_dir / "responses", e)
            return cls(None)

    def _open(self, create: bool) -> int | None:
        """The folder's descriptor (made when ``create``), scanned when first opened."""
        if self._fd is None and (create or self.root.is_dir()):
            self._fd = open_folder(self.root)
            self._scan()
        return self._fd

    def _scan(self) -> None:
        found = []
        for e in os.scandir(self._fd):
            if e.name.startswith(TMP_PREFIX):  # a write that a crash cut short
                remove(self._fd, e.name)
            elif e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, e.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
        self._trim()

    def __len__(self) -> int:
        return len(self._memory) if self.memory else len(self._files)

    def get(self, response_id: str) -> dict | None:
        """The record stored under ``response_id``, or None (unknown, or its file is bad)."""
        with self._lock:
            if self.memory:
                return self._memory.get(response_id)
            name = file_name(response_id)
            if name not in self._files:
                return None
            try:
                record = json.loads(read_file(self._fd, name, self.max_bytes))
                if not isinstance(record, dict) or record.get("format") != FORMAT \
                        or record.get("id") != response_id:
                    raise UnsafeFile("not a stored response of this id")
                return record["record"]
            except FileNotFoundError:
                self._files.pop(name, None)
                return None
            except (OSError, ValueError, KeyError, RecursionError) as e:  # UnsafeFile too
                log.warning("response store: %s is unreadable (%s); removed", name, e)
                self._remove(name)
                return None

    def put(self, response_id: str, record: dict) -> bool:
        """Store ``record`` (JSON-able) under ``response_id``; False (logged) if it could not be
        written. The oldest records go past the caps."""
        with self._lock:
            if self.memory:
                self._memory[response_id] = record
                self._memory.move_to_end(response_id)
                while len(self._memory) > self.max_entries:
                    self._memory.popitem(last=False)
                return True
            data = json.dumps({"format": FORMAT, "id": response_id, "record": record},
                              ensure_ascii=False).encode("utf-8", "surrogatepass")
            if len(data) > self.max_bytes:
                log.warning("response store: %s is larger than the store (%d bytes); not kept",
                            response_id[:80], len(data))
                return False
            name = file_name(response_id)
            try:
                write_file(self._open(create=True), name, data)
            except OSError as e:
                log.warning("response store: could not write %s: %s", name, e)
                return False
            self._files.pop(name, None)
            self._files[name] = len(data)
            self._trim()
            return True

    def delete(self, response_id: str) -> bool:
        """Remove the record; True if there was one."""
        with self._lock:
            if self.memory:
                return self._memory.pop(response_id, None) is not None
            name = file_name(response_id)
            if name not in self._files:
                return False
            self._remove(name)
            return True

    def close(self) -> None:
        """Release the folder (a disk store is not used after this)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _remove(self, name: str) -> None:
        self._files.pop(name, None)
        remove(self._fd, name)

    def _trim(self) -> None:
        total = sum(self._files.values())
        while self._files and (len(self._files) > self.max_entries or total > self.max_bytes):
            name, size = next(iter(self._files.items()))
            total -= size
            self._remove(name)
