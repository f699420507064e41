"""KV cache events in vLLM's format (mlx_kvserver/engine/kv_events.py, --kv-events): what a
consumer written against vLLM decodes from ours, and a running server's events over real ZMQ
sockets (a chat's pages as a chain, the next turn continuing it, the replay of missed batches).

What is matched, from vLLM's vllm/distributed/kv_events.py (``EventBatch``, ``KVCacheEvent``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``,
``ZmqEventPublisher``) and examples/online_serving/kv_events_subscriber.py:

- the payload decodes with msgspec's msgpack decoder typed by the structs as vLLM declares them:
  ``VLLM_ARRAY`` as up to vLLM 0.23 (every struct ``array_like=True``: an event is a tagged
  array), ``VLLM_EXAMPLE`` as the example subscriber's shorter ``BlockStored`` (older consumers:
  extra trailing fields are ignored) and ``VLLM_MAP`` as after vLLM's switch to tagged maps (the
  batch still an array) for ``--kv-events-format map``;
- the block hashes are ints in 64 bits (``ExternalBlockHash`` with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the digest's last 8 bytes, big-endian, unsigned);
- the PUB frames are [topic, sequence (8 bytes big-endian, from 0), payload]; a replay request
  to the ROUTER ([b"", the 8-byte start], as a REQ socket sends it) is answered by one
  [b"", seq, payload] per buffered batch from the start, then [b"", -1 (8 bytes signed), b""].
"""

# NOTE: no ``from __future__ import annotations``: msgspec reads the annotations of the structs
# that ``_vllm_structs`` makes, which name each other, as they are evaluated in its scope

import socket
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kv_cache import StoredPage
from kv_cache.pages.hashing import chain_hashes, root_hash
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.kv_events import KvEventPublisher, block_hash, replay_default
from harness.server_utils import make_engine, running_server

ExternalBlockHash = bytes | int  # vllm/v1/core/kv_cache_utils.py


def _vllm_structs(array_like: bool, short: bool = False):
    """The structs as vLLM declares them (see the module): events as tagged arrays or maps;
    ``short``: the example subscriber's BlockStored, without the later fields."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):  # the example subscriber's
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    if not short:  # vLLM's own, with the later fields after
        class BlockStored(BlockStored, tag="BlockStored"):  # noqa: F811
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Decoder(type=KVEventBatch)


VLLM_ARRAY = _vllm_structs(array_like=True)
VLLM_EXAMPLE = _vllm_structs(array_like=True, short=True)
VLLM_MAP = _vllm_structs(array_like=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoints() -> tuple[str, str]:
    return f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"


def connect(kind: int, endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint.replace("*", "127.0.0.1"))
    return s


def receive(sub: zmq.Socket, until, timeout: float = 30.0) -> list[tuple[bytes, int, bytes]]:
    """[(topic, seq, payload)] from ``sub`` until ``until(messages)`` holds."""
    out: list = []
    deadline = time.monotonic() + timeout
    while not until(out):
        assert time.monotonic() < deadline, f"no such events in {timeout} s: {out}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """What the replay socket sends from ``start``: [(seq, payload)], the end marker checked.
    A DEALER sends what a REQ would ([b"", start]) and, unlike a REQ, takes every reply."""
    req = connect(zmq.DEALER, endpoint)
    try:
        req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert req.poll(10_000), "the replay did not answer"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        req.close()


def page(h: int, parent: int | None, tokens, extras=()) -> StoredPage:
    digest = lambda x: bytes(24) + x.to_bytes(8, "big")  # noqa: E731
    return StoredPage(digest(h), None if parent is None else digest(parent), tuple(tokens),
                      tuple(extras))


@pytest.mark.parametrize("encoding,decoders", [("array", (VLLM_ARRAY, VLLM_EXAMPLE)),
                                               ("map", (VLLM_MAP,))])
def test_a_vllm_consumer_decodes_our_events(encoding, decoders):
    pub_at, replay_at = endpoints()
    pub = KvEventPublisher(pub_at, replay_at, topic="kv-events", encoding=encoding, page_size=2)
    sub = connect(zmq.SUB, pub_at)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher
        big = (1 << 64) - 5  # a hash past the signed range: still an int, unsigned
        pub.stored("GPU", [page(1, None, [5, 6]), page(2, 1, [7, 8]),
                           page(big, 2, [9, 9], [("img", 1, 4)])])
        pub.stored("DISK", [page(3, 2, [1, 2])])  # another tier: its own event
        pub.removed("GPU", [page(2, 1, []).hash])
        pub.removed("GPU", [page(1, None, []).hash])
        msgs = receive(sub, lambda m: any(b"BlockRemoved" in p for _, _, p in m))
        assert {topic for topic, _, _ in msgs} == {b"kv-events"}
        got = replay(replay_at, 0)
        assert [s for s, _ in got] == list(range(len(got)))  # every batch from the first
        assert all(dict(got)[seq] == p for _, seq, p in msgs)  # the same bytes, replayed
        assert replay(replay_at, len(got)) == []  # nothing after the last: only the end marker
        for decoder in decoders:
            events = [e for _, p in got for e in decoder.decode(p).events]
            assert decoder.decode(got[0][1]).data_parallel_rank == 0
            assert type(events[0]).__name__ == "AllBlocksCleared"  # first: whatever was known
            stored = [e for e in events if type(e).__name__ == "BlockStored"]
            assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium)
                    for e in stored] == [([1, 2, big], None, [5, 6, 7, 8, 9, 9], 2, "GPU"),
                                         ([3], 2, [1, 2], 2, "DISK")]
            assert stored[0].lora_id is None
            removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
            assert [(e.block_hashes, e.medium) for e in removed] == [([2, 1], "GPU")]
            if decoder is not VLLM_EXAMPLE:
                # vLLM's multimodal keys: the image, where it starts counted from the page's
                # start (an inner pair decodes as a list, as vLLM's own do: ``tuple[Any, ...]``)
                assert stored[0].extra_keys == [None, None, (["img", -1],)]
                assert stored[0].group_idx == 0 and stored[0].lora_name is None
    finally:
        sub.close()
        pub.close()


def test_hashes_and_endpoints():
    h = bytes(range(32))
    assert block_hash(h) == int.from_bytes(h, "big") & ((1 << 64) - 1)  # vLLM's conversion
    assert replay_default("tcp://*:5557") == "tcp://*:5558"
    assert replay_default("ipc:///tmp/kv") is None


def pages_of(events, medium) -> list:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def published_to_disk(replay_at: str, timeout: float = 30.0) -> None:
    """Wait until the replay holds every page stored in memory as stored on disk too: a save
    runs on the cache's writer and its events reach the socket from the publisher's thread."""
    deadline = time.monotonic() + timeout
    while True:
        events = [e for _, p in replay(replay_at, 0) for e in VLLM_ARRAY.decode(p).events]
        memory = {h for e in pages_of(events, "GPU") for h in e.block_hashes}
        if memory and memory <= {h for e in pages_of(events, "DISK") for h in e.block_hashes}:
            return
        assert time.monotonic() < deadline, f"the pages not published as on disk in {timeout} s"
        time.sleep(0.05)


def test_a_server_publishes_its_chats_pages_and_replays_what_was_missed(tiny_lm, tmp_path):
    pub_at, replay_at = endpoints()
    config = ServerConfig(max_tokens=6, page_size=8, kv_cache_dir=tmp_path / "kv",
                          kv_events=pub_at, kv_events_replay=replay_at)
    engine = make_engine([tiny_lm], config)
    with running_server([tiny_lm], config, engine=engine) as url:
        messages = [{"role": "user", "content": "tell me about the sea and the sky, twice"}]
        r = httpx.post(f"{url}/chat/completions", json={"messages": messages}, timeout=60)
        answer = r.json()["choices"][0]["message"]["content"]
        published_to_disk(replay_at)  # the turn saved, and its disk pages published
        sub = connect(zmq.SUB, pub_at)  # joins after the first turn: it missed its events
        time.sleep(0.3)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "and now about the mountains and rivers"}]
        httpx.post(f"{url}/chat/completions", json={"messages": messages}, timeout=60)
        live = receive(sub, lambda m: any(pages_of(VLLM_ARRAY.decode(p).events, "GPU")
                                          for _, _, p in m))
        first_live = live[0][1]
        assert first_live > 0  # the first turn's batches were missed
        batches = replay(replay_at, 0)
        sub.close()
    assert [s for s, _ in batches][: first_live + 1] == list(range(first_live + 1))
    missed = [e for _, p in batches[:first_live] for e in VLLM_ARRAY.decode(p).events]
    later = [e for _, p in batches[first_live:] for e in VLLM_ARRAY.decode(p).events]
    assert dict(batches)[first_live] == live[0][2]

    # the first turn: its pages in memory as one chain from the root, then the same on disk
    turn1 = pages_of(missed, "GPU")
    assert turn1 and turn1[0].parent_block_hash is None
    tokens = [t for e in turn1 for t in e.token_ids]
    hashes = [h for e in turn1 for h in e.block_hashes]
    root = root_hash(tiny_lm.fingerprint)
    assert hashes == [block_hash(h) for h in chain_hashes(root, tokens, 8)]
    for a, b in zip(turn1, turn1[1:]):
        assert b.parent_block_hash == a.block_hashes[-1]
    assert all(e.block_size == 8 and len(e.token_ids) == 8 * len(e.block_hashes)
               for e in turn1)
    disk = [h for e in pages_of(missed, "DISK") for h in e.block_hashes]
    assert disk == hashes  # what was saved is on disk too
    # the second turn continues the first: its first new page's parent is the first's last
    turn2 = pages_of(later, "GPU")
    assert turn2[0].parent_block_hash == hashes[-1]
    tokens2 = tokens + [t for e in turn2 for t in e.token_ids]
    assert [h for e in turn2 for h in e.block_hashes] == \
        [block_hash(h) for h in chain_hashes(root, tokens2, 8)][len(hashes):]


def test_the_flags():
    from mlx_kvserver.flags import config_from_args, parse_args

    config = config_from_args(parse_args(["--kv-events", "tcp://*:5557"], {}))
    assert (config.kv_events, config.kv_events_replay, config.kv_events_topic,
            config.kv_events_format) == ("tcp://*:5557", None, "", "array")
    assert config_from_args(parse_args([], {})).kv_events is None  # off by default
    for bad in (["--kv-events", "http://x:1"], ["--kv-events", "tcp://*"],
                ["--kv-events", "tcp://*:5557", "--kv-events-replay", "5558"]):
        with pytest.raises(SystemExit):
            config_from_args(parse_args(bad, {}))
