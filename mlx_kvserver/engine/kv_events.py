"""KV cache events in vLLM's format, for a cache-aware router in front of several servers
(``--kv-events``; docs/ROUTING.md).

The cache tells an observer which pages each tier stores and removes
(``kv_cache.watch_pages``); ``KvEventPublisher`` is that observer. Its calls only put on a queue
(the generating thread never waits on it); a publisher thread takes what is queued, makes one
``KVEventBatch`` of it and sends it as vLLM's ``ZmqEventPublisher`` does
(vllm/distributed/kv_events.py):

    PUB socket     multipart [topic, sequence number (8 bytes, big-endian), msgpack payload];
                   the sequence counts batches from 0
    replay ROUTER  a request [identity, b"", start (8 bytes, big-endian)] is answered with
                   [identity, b"", seq, payload] for each buffered batch from ``start`` on, then
                   [identity, b"", -1 (8 bytes, signed), b""]; the last ``BUFFER_STEPS`` batches
                   are kept

The payload is msgspec's msgpack of vLLM's structs: a batch is the array ``[ts, events,
data_parallel_rank]`` (0: one rank); each event is a tagged struct, encoded as vLLM up to 0.23
encodes it, a tagged array (``"array"``, the default: older and newer routers read it alike),
or as later vLLM does, a map with its tag under ``"type"`` (``"map"``):

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id (None),
                      medium, lora_name (None), extra_keys, group_idx
    BlockRemoved      block_hashes, medium
    AllBlocksCleared  (sent once, first: whatever a router knew of this server is void)

A block is a page. Its hash is the last 8 bytes of the page's chain hash, big-endian, as an
unsigned 64-bit int (what vLLM's ``maybe_convert_block_hash`` does to its own hashes); a first
page has no parent (None). ``medium``: "GPU" for pages in memory, "DISK" for the disk cache,
"EXTERNAL" for pages written to the shared store (``kv_cache.pages.events``). ``extra_keys``: per
block, None for a text page, else a tuple of ``(image hash, image start - page start)`` per image
the page holds tokens of (vLLM's multimodal keys). Consecutive pages of one chain, tier and
group go in one ``BlockStored``.
"""

# NOTE: no ``from __future__ import annotations``: msgspec reads the annotations of the structs
# that ``_structs`` makes, which name each other, as they are evaluated in its scope

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any, Sequence

import msgspec
import zmq

from kv_cache import CacheManager, StoredPage, watch_pages

log = logging.getLogger("mlx_kvserver.kv_events")

BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
MAX_QUEUE = 100_000  # calls waiting for the publisher thread; more are dropped (counted)
HWM = 100_000  # the PUB socket's high-water mark (vLLM's default)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
FORMATS = ("array", "map")


def _structs(array_like: bool):
    """vLLM's event structs (vllm/distributed/kv_events.py), the events as tagged arrays or
    tagged maps; the batch is an array either way."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def block_hash(h: bytes) -> int:
    """A page's chain hash as a block hash: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(h[-8:], "big")


def extra_keys(page: StoredPage) -> tuple | None:
    """vLLM's extra keys of ``page``: per image it holds tokens of, the image's hash and where
    the image starts, counted from the page's start (negative: before it); None for text."""
    return tuple((image, -offset) for image, offset, _ in page.extras) or None


def replay_default(endpoint: str) -> str | None:
    """The replay endpoint beside ``endpoint``: the next port of a TCP one (vLLM's 5557 and
    5558); None for another transport."""
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + 1}"
    return None


def check_endpoint(endpoint: str) -> None:
    """``ValueError`` for an endpoint ZMQ would not take (tcp://, ipc:// or inproc://)."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"want tcp://HOST:PORT, ipc://PATH or inproc://NAME, not {endpoint!r}")
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a tcp:// endpoint needs a port: {endpoint!r}")


class KvEventPublisher:
    """The observer of every served model's cache (``watch``), publishing what it is told as
    vLLM's KV events on ``endpoint`` (bound where it has '*' or '::', or is ipc:// or
    inproc://, as vLLM does; else connected), with the replay socket on ``replay``."""

    def __init__(self, endpoint: str, replay: str | None = None, *, topic: str = "",
                 encoding: str = "array", page_size: int, buffer_steps: int = BUFFER_STEPS):
        if encoding not in FORMATS:
            raise ValueError(f"encoding {encoding!r}: one of {FORMATS}")
        self.endpoint, self.replay_endpoint, self.page_size = endpoint, replay, page_size
        self._topic = topic.encode("utf-8")
        self._batch, self._stored, self._removed, self._cleared = \
            _structs(encoding == "array")
        self._queue: queue.Queue[tuple | None] = queue.Queue(maxsize=MAX_QUEUE)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self.dropped = 0  # calls dropped: the queue was full
        self.published = 0  # batches sent
        self._closed = False
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = None
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._queue.put(("cleared",))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (replay %s), topic %r, events as %ss", endpoint,
                 replay or "off", topic, encoding)

    # -- the cache's observer (``kv_cache.CacheEvents``): a queue put, nothing more -----------

    def stored(self, medium: str, pages: Sequence[StoredPage]) -> None:
        self._put(("stored", medium, pages))

    def removed(self, medium: str, hashes: Sequence[bytes]) -> None:
        self._put(("removed", medium, hashes))

    def _put(self, item: tuple) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th, ... drop
                log.warning("KV events: queue full, %d calls dropped", self.dropped)

    def watch(self, manager: CacheManager) -> None:
        """Publish what ``manager``'s tiers hold and every change from now on (on the
        generating thread, while it runs nothing)."""
        watch_pages(manager, self)

    def unwatch(self, manager: CacheManager) -> None:
        """Stop publishing ``manager``'s changes, its pages in memory published as removed (it
        is closing: they go with it)."""
        watch_pages(manager, None)

    def close(self) -> None:
        """Publish what is queued, then close the sockets. Idempotent."""
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        self._close_sockets()

    # -- the publisher thread -----------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        done = False
        while not done:
            if self._router is not None:
                while self._router.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            items = [item]
            while len(items) < 4096:  # all that is queued, in one batch
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in items:
                items, done = items[: items.index(None)], True
            events = self._events(items)
            if not events:
                continue
            try:
                payload = encode(self._batch(time.time(), events, 0))
                seq = next(self._seq)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published += 1
            except Exception:  # a bad batch never stops the publisher
                log.exception("KV events: publishing a batch failed")

    def _events(self, items: list[tuple]) -> list:
        """The events of ``items`` (queued calls), consecutive pages of one chain, tier and
        group in one ``BlockStored``, consecutive removals from one tier in one
        ``BlockRemoved``."""
        out: list = []
        last = None  # the page the last BlockStored ends with
        for item in items:
            kind = item[0]
            if kind == "cleared":
                out.append(self._cleared())
                last = None
            elif kind == "removed":
                _, medium, hashes = item
                hs = [block_hash(h) for h in hashes]
                prev = out[-1] if out else None
                if isinstance(prev, self._removed) and prev.medium == medium:
                    prev.block_hashes.extend(hs)
                elif hs:
                    out.append(self._removed(hs, medium))
                last = None
            else:
                _, medium, pages = item
                for p in pages:
                    prev = out[-1] if out else None
                    if isinstance(prev, self._stored) and prev.medium == medium \
                            and prev.group_idx == p.group and last is not None \
                            and p.parent == last.hash:
                        prev.block_hashes.append(block_hash(p.hash))
                        prev.token_ids.extend(p.tokens)
                        prev.extra_keys.append(extra_keys(p))
                    else:
                        out.append(self._stored(
                            [block_hash(p.hash)],
                            None if p.parent is None else block_hash(p.parent),
                            list(p.tokens), self.page_size, None, medium, None,
                            [extra_keys(p)], p.group))
                    last = p
        return out

    def _serve_replay(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._router.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)


def open_publisher(config, page_size: int) -> KvEventPublisher | None:
    """The publisher ``config`` asks for (``--kv-events``), or None."""
    if not config.kv_events:
        return None
    replay = config.kv_events_replay
    if replay is None:
        replay = replay_default(config.kv_events)
    elif replay == "off":
        replay = None
    return KvEventPublisher(config.kv_events, replay, topic=config.kv_events_topic,
                            encoding=config.kv_events_format, page_size=page_size)
