"""Models on demand, the policy: which names a request may load (``--allow-models``, ``--pin``),
where a name's files are (a folder, a GGUF file, or a Hugging Face id: in the local HF cache, or
downloaded with ``--allow-download``), and the state of each model loaded on demand
(:class:`Resident`: loading, loaded, unloaded; last use, for the least-recently-used choice and
``--model-ttl``). What a load will hold, its weights and its peak, is estimated from the files
before anything loads (``footprint.py``).

Loading, waiting and unloading through the engine are in ``serving.py``.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from .loading import _REPO_ID, LoadedModel, auto_dequantize, load_folder, resolve_and_load
from .vision import listing_fields

# NOTE: what a request's weights may take of the memory limit, all models together; the rest is
# for the KV pages, the running answers' working buffers and the passes (engine/memory.py).
WEIGHTS_SHARE = 0.75
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
MAX_NAME = 1024


class NotCached(LookupError):
    """A Hugging Face id that is not in the local cache, and downloads are off."""


@dataclass(frozen=True)
class Source:
    """Where a requested model comes from: ``key`` is the same for every spelling of it (the
    resolved path; the repo id with its revision)."""

    name: str  # as the request gave it
    key: str
    kind: str  # "path" | "hub"

    @property
    def repo(self) -> tuple[str, str | None]:
        repo_id, _, revision = self.key.partition("@")
        return repo_id, revision or None


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or "\\" in name \
        or os.sep in name and not _REPO_ID.match(name)


def source_of(name: str) -> Source | None:
    """What ``name`` points at, as ``resolve_and_load`` reads it (an existing path first, then a
    Hugging Face id); None for names that are neither (``default`` and indices among them)."""
    if not name or len(name) > MAX_NAME or "\x00" in name or name != name.strip() \
            or name == "default" or name.isdecimal():
        return None
    path = Path(name).expanduser()
    if path.exists() or _looks_local(name):
        return Source(name, str(path.resolve()), "path")
    if _REPO_ID.match(name) and ".." not in name:
        return Source(name, name, "hub")
    return None


class AllowList:
    """The names requests may load: ``patterns`` are globs (``fnmatch``: ``*`` spans ``/``) over
    the name as given (a path with a ``..`` part only by its resolved form) or the resolved
    path; ``pins`` are allowed too, and once loaded never unloaded."""

    def __init__(self, patterns: list[str], pins: list[str] = ()) -> None:
        self.patterns = list(patterns)
        self.pins = {s.key for s in map(source_of, pins) if s is not None}

    @property
    def enabled(self) -> bool:
        return bool(self.patterns or self.pins)

    def check(self, name: str | None) -> Source | None:
        """The source of ``name`` when it may load on demand; None otherwise."""
        if not self.enabled or name is None:
            return None
        src = source_of(name)
        if src is None:
            return None
        if src.key in self.pins:
            return src
        literal = ".." not in Path(name).parts and any(
            fnmatch.fnmatchcase(name, p) for p in self.patterns)
        resolved = src.kind == "path" and any(
            fnmatch.fnmatchcase(src.key, p) for p in self.patterns)
        return src if literal or resolved else None

    def pinned(self, src: Source) -> bool:
        return src.key in self.pins


def locate(src: Source, allow_download: bool) -> Path:
    """The local file or folder of ``src`` (a hub id: its snapshot in the HF cache, fetched
    first when ``allow_download``). FileNotFoundError for a missing path; :class:`NotCached`."""
    if src.kind == "path":
        path = Path(src.key)
        if not path.exists():
            raise FileNotFoundError(f"no such model file or folder: {src.name}")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, revision = src.repo
    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision,
                                      allow_patterns=HUB_PATTERNS,
                                      local_files_only=not allow_download))
    except LocalEntryNotFoundError as e:
        if allow_download:
            raise NotCached(f"{src.name} could not be fetched from the Hugging Face hub "
                            f"(offline?): {e}") from e
        raise NotCached(f"{src.name} is not in this machine's Hugging Face cache, and this "
                        "server does not download models (start it with --allow-download, or "
                        "fetch it with `huggingface-cli download`)") from e


def hub_bytes(src: Source) -> int:
    """Bytes of ``src``'s folder in the HF cache so far (a download's progress)."""
    from huggingface_hub import constants

    repo_id, _ = src.repo
    root = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--")) / "blobs"
    try:
        return sum(e.stat().st_size for e in os.scandir(root) if e.is_file())
    except OSError:
        return 0


def load_source(src: Source, path: Path, dequantize: bool | None) -> LoadedModel:
    """Load what :func:`locate` found, named as the request named it."""
    if src.kind == "hub":
        deq = auto_dequantize() if dequantize is None else dequantize
        lm = load_folder(path, dequantize=deq, name=src.name, source=src.name)
    else:
        lm = resolve_and_load(str(path), dequantize=dequantize)
    lm.name = src.name
    return lm


def in_thread(fn: Callable[[], Any], name: str = "model-load") -> asyncio.Future:
    """Run ``fn`` in a thread of its own; an asyncio future of its result.

    NOTE: MLX keeps streams per thread; a thread that ran MLX ends with them cleared (see the
    engine's loop). What it made is evaluated before it is used on another thread."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # handed to the awaiting side
            result, error = None, e
        finally:
            mx.clear_streams()
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile (the server stopped)
            pass
    threading.Thread(target=target, name=name, daemon=True).start()
    return future


# -- the state of each model loaded on demand ------------------------------------------------


@dataclass
class Resident:
    """A model requests have loaded on demand, by its :class:`Source`'s key."""

    source: Source
    pinned: bool
    status: str = "new"  # new | loading | loaded | unloading | unloaded
    phase: str = ""  # while loading: queued, locating, downloading, making room, ...
    started: float = 0.0  # monotonic: this load's or unload's start
    last_used: float = 0.0  # monotonic
    loads: int = 0
    weights: int = 0  # bytes, while loaded (the engine's count); the estimate while loading
    load_s: float | None = None  # the last load's seconds, and the last unload's
    unload_s: float | None = None
    downloaded: int | None = None  # bytes in the HF cache so far, while downloading
    unloaded_why: str = ""
    phase_s: dict[str, float] = field(default_factory=dict)  # the last load's phases, seconds
    _phase_at: float = 0.0
    lm: LoadedModel | None = None
    takes_images: bool | None = None  # known once it has loaded
    busy: Any = field(default=None, repr=False)  # the load's task or the unload's future

    @property
    def name(self) -> str:
        return self.source.name

    def enter(self, phase: str) -> None:
        """The load goes on to ``phase`` ("": done); the last phase's seconds are kept."""
        now = time.monotonic()
        if self.phase:
            self.phase_s[self.phase] = round(now - self._phase_at, 3)
        self.phase, self._phase_at = phase, now

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def describe(self) -> dict[str, Any]:
        """Its entry in ``/v1/models`` (beyond id and object)."""
        now = time.monotonic()
        out: dict[str, Any] = {"status": self.status, "on_demand": True, "pinned": self.pinned,
                               "loads": self.loads, "weights_bytes": self.weights or None,
                               "load_seconds": self.load_s, "load_phases_s": self.phase_s,
                               "unload_seconds": self.unload_s}
        if self.status == "loading":
            out["loading"] = {"phase": self.phase, "elapsed_s": round(now - self.started, 1),
                              **({"downloaded_bytes": self.downloaded}
                                 if self.downloaded is not None else {})}
        if self.takes_images is not None:
            out.update(listing_fields(self.takes_images))
        if self.status == "loaded":
            out["idle_s"] = round(now - self.last_used, 1)
        if self.status == "unloaded":
            out["unloaded_because"] = self.unloaded_why
        return out


def lru(residents: list[Resident], but: Resident | None = None) -> list[Resident]:
    """The loaded, unpinned residents, least recently used first (what may go for room)."""
    return sorted((r for r in residents if r.status == "loaded" and not r.pinned and r is not but),
                  key=lambda r: r.last_used)


def idle_past(residents: list[Resident], ttl: float, now: float) -> list[Resident]:
    """The loaded, unpinned residents unused for ``ttl`` seconds (``--model-ttl``)."""
    return [r for r in lru(residents) if now - r.last_used >= ttl]
