"""Hostile ids and files, through the real server: nothing is read or written outside the cache
directory, planted links are not followed, and malformed files are misses, never crashes.

The disk store's own unit tests already cover these cases file by file (tests/kv_cache/tiers/disk/:
test_hostile_keys_never_leave_the_root_and_round_trip, test_planted_symlinks_are_not_followed,
test_special_files_are_not_opened, test_hostile_page_headers_are_misses,
test_hostile_manifest_headers_are_misses, test_every_truncation_is_a_miss_and_removed); these
tests check the same promises end to end: HTTP routes, chat messages, start-up and answers.
"""

from __future__ import annotations

import json
import os
import struct
import urllib.parse
from pathlib import Path

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

# Valid message_ids (they are keys, never paths) and invalid ones (refused with a 400).
HOSTILE_IDS = ["..", ".", "../x", "../../../../../../tmp/pwned", "/etc/passwd", "a\\b",
               "..\\..\\x", "a\u2215b", "a\uff0fb", "a\u2044b", "\u29f8etc\u29f8passwd",
               "%2e%2e%2fx", "entries/../../x", "pages/ab", ".tmp.1.x", ".lock", "model.json",
               "C:\\Windows", "~", " ", "x" * 256]
INVALID_IDS = ["a\x00b", "\x00", "k" * 10_000, "x" * 257, "a\nb", "\x7f"]


def config(cache_dir: Path, **kw) -> ServerConfig:
    return ServerConfig(max_tokens=6, page_size=8, kv_cache_dir=cache_dir, **kw)


def q(key: str) -> str:
    """``key`` as one path segment (dots too: clients would resolve '..' before sending)."""
    return urllib.parse.quote(key, safe="").replace(".", "%2E")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (links not followed): size and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def store_root(cache_dir: Path) -> Path:
    (root,) = [p for p in cache_dir.iterdir()]
    return root


def assert_store_layout(root: Path) -> None:
    """Only the store's own names: hashed manifests and keyed arrays, hashed pages and tails in
    two-hex-digit folders."""
    assert {p.name for p in root.iterdir()} <= {".lock", "entries", "pages", "tails",
                                                "arrays", "model.json"}
    for p in [*(root / "entries").iterdir(), *(root / "arrays").iterdir()]:
        assert len(p.stem) == 64 and p.suffix == ".safetensors" and p.is_file(), p
    for sub in [*(root / "pages").iterdir(), *(root / "tails").iterdir()]:
        assert len(sub.name) == 2 and sub.is_dir() and not sub.is_symlink(), sub
        assert all(len(f.stem) == 64 and f.is_file() and not f.is_symlink()
                   for f in sub.iterdir()), sub


def chat(url: str, messages: list, use_cache: bool = True) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=60, json={
        "messages": messages, "temperature": 0, "use_kv_cache": use_cache})


def answer(url: str, messages: list, use_cache: bool = True) -> tuple[str, str, int]:
    r = chat(url, messages, use_cache)
    assert r.status_code == 200, r.text
    body = r.json()
    return (body["choices"][0]["message"]["content"], body["message_id"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_hostile_message_ids_never_leave_the_cache_dir(tiny_lm, tmp_path):
    cache, canary = tmp_path / "kv", tmp_path / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("untouched")
    outside_before = snapshot(canary)
    passwd = os.stat("/etc/passwd").st_mtime_ns if os.path.exists("/etc/passwd") else None
    with running_server([tiny_lm], config(cache)) as url:
        exported = {}
        for i, key in enumerate(HOSTILE_IDS):
            messages = [{"role": "user", "content": f"Question {i}?", "message_id": key}]
            content, _, _ = answer(url, messages)
            info = httpx.get(f"{url}/kv_cache/{q(key)}")
            assert info.status_code == 200 and info.json()["message_id"] == key, (key, info.text)
            assert info.json()["on_disk"] is True
            exp = httpx.get(f"{url}/kv_cache/export/{q(key)}")
            assert exp.status_code == 200, key
            exported[key] = exp.content
            # A second turn reuses the entry (found by the key, verified by tokens).
            messages += [{"role": "assistant", "content": content}, {"role": "user",
                                                                     "content": "More."}]
            assert answer(url, messages)[2] > 0, key
        for key in INVALID_IDS:
            r = chat(url, [{"role": "user", "content": "x", "message_id": key}])
            assert r.status_code == 400 and "message_id" in r.json()["error"]["param"], key
            for method, path in (("GET", f"/kv_cache/{q(key)}"), ("DELETE", f"/kv_cache/{q(key)}"),
                                 ("GET", f"/kv_cache/export/{q(key)}"),
                                 ("POST", f"/kv_cache/import?message_id={q(key)}")):
                r = httpx.request(method, url + path, content=exported[".."], timeout=60)
                # 404 for a line break: no route matches a path with one
                assert r.status_code in (400, 404) and r.json()["error"]["message"], \
                    (method, path[:60], r.text)
                assert r.status_code == 404 or r.json()["error"]["param"] == "message_id"
        # Import under each hostile id, then delete it: all inside the store.
        for key in HOSTILE_IDS:
            r = httpx.post(f"{url}/kv_cache/import?message_id={q(key)}", timeout=60,
                           content=exported[key])
            assert r.status_code == 200 and r.json()["message_id"] == key, r.text
        for key in HOSTILE_IDS[::2]:
            assert httpx.delete(f"{url}/kv_cache/{q(key)}").json()["deleted"] is True
            assert httpx.get(f"{url}/kv_cache/{q(key)}").status_code == 404
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary", "kv"]
    assert snapshot(canary) == outside_before
    if passwd is not None:
        assert os.stat("/etc/passwd").st_mtime_ns == passwd
    root = store_root(cache)
    assert_store_layout(root)
    assert len(list((root / "entries").iterdir())) >= len(HOSTILE_IDS[1::2])
    # After a restart every surviving hostile id is found again, from its hashed file.
    with running_server([tiny_lm], config(cache)) as url:
        for key in HOSTILE_IDS[1::2]:
            info = httpx.get(f"{url}/kv_cache/{q(key)}").json()
            assert info["message_id"] == key and info["on_disk"] and not info["in_memory"]
        for key in HOSTILE_IDS[::2]:
            assert httpx.get(f"{url}/kv_cache/{q(key)}").status_code == 404


def conversation(url: str, tag: str, turns: int = 2) -> list[dict]:
    messages: list[dict] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Tell me about {tag}, part {i}.",
                         "message_id": f"{tag}-u{i}"})
        content, mid, _ = answer(url, messages)
        messages.append({"role": "assistant", "content": content, "message_id": mid})
    return messages


def next_turn_is_exact(url: str, messages: list, tag: str) -> int:
    messages = messages + [{"role": "user", "content": "Go on.", "message_id": f"{tag}-next"}]
    warm, _, cached = answer(url, messages)
    cold, _, _ = answer(url, messages, use_cache=False)
    assert warm == cold
    return cached


def test_symlinks_planted_in_the_cache_dir_are_not_followed(tiny_lm, tmp_path):
    cache, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    with running_server([tiny_lm], config(cache)) as url:
        history = conversation(url, "links")
    root = store_root(cache)
    # 1. a manifest replaced by a link to a (valid) copy outside
    manifest = sorted((root / "entries").iterdir())[0]
    (outside / "manifest").write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(outside / "manifest")
    # 2. a page folder replaced by a link to a copy outside
    sub = sorted((root / "pages").iterdir())[0]
    os.replace(sub, outside / "pages")
    sub.symlink_to(outside / "pages", target_is_directory=True)
    # 3. model.json (rewritten at every start) replaced by a link to a file outside
    (outside / "victim.txt").write_text("do not overwrite")
    (root / "model.json").unlink()
    (root / "model.json").symlink_to(outside / "victim.txt")
    before = snapshot(outside)
    with running_server([tiny_lm], config(cache)) as url:
        next_turn_is_exact(url, history, "links")
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert snapshot(outside) == before
    assert (outside / "victim.txt").read_text() == "do not overwrite"
    assert stats["disk"]["corrupt_files_removed"] >= 2  # the two links, removed at start-up
    assert not any(p.is_symlink() for p in root.rglob("*"))
    assert json.loads((root / "model.json").read_text())["name"] == tiny_lm.name
    assert_store_layout(root)
    # 4. the model's whole store folder replaced by a link to a directory outside
    os.replace(root, outside / "store")
    root.symlink_to(outside / "store", target_is_directory=True)
    before = snapshot(outside)
    with running_server([tiny_lm], config(cache)) as url:
        conversation(url, "after")
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert stats["disk_enabled"] and stats["disk_saves"] > 0
    assert snapshot(outside) == before
    assert root.is_dir() and not root.is_symlink()
    assert_store_layout(root)


def test_a_link_planted_while_running_is_a_miss_and_not_followed(tiny_lm, tmp_path):
    cache, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    page_bytes = tiny_lm.num_layers * 2 * tiny_lm.num_kv_heads * 8 * tiny_lm.head_dim * 4
    # A RAM budget of a few pages and no resident sequence: entries leave memory at once, so
    # reuse loads the entry from disk (the lookup itself reads no file).
    with running_server([tiny_lm], config(cache, max_kv_ram_gb=12 * page_bytes / 2**30,
                                          max_resident_sequences=0)) as url:
        history = conversation(url, "live")
        conversation(url, "other")  # takes the RAM: "live" is left on disk only
        httpx.get(f"{url}/kv_cache/stats")  # (waits for the disk writes in flight)
        root = store_root(cache)
        for f in (root / "entries").iterdir():
            (outside / f.name).write_bytes(f.read_bytes())
            f.unlink()
            f.symlink_to(outside / f.name)
        before = snapshot(outside)
        next_turn_is_exact(url, history, "live")
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert snapshot(outside) == before
    assert stats["disk"]["corrupt_files_removed"] >= 1  # the entry loaded: its link removed
    with running_server([tiny_lm], config(cache)):  # links no request loaded: at start-up
        pass
    assert snapshot(outside) == before
    assert not any(p.is_symlink() for p in root.rglob("*"))


# -- malformed safetensors ------------------------------------------------------------------------


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def first_tensor(header: dict) -> dict | None:
    return next((v for k, v in header.items() if k != "__metadata__"), None)


def header_length_past_the_end(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw) + 100) + raw[8:]


def offsets_past_the_end(raw: bytes) -> bytes:
    header, data = split(raw)
    t = first_tensor(header)
    if t is None:  # a manifest (no tensors): give it a tensor that reaches past the end
        header["tail"] = t = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    t["data_offsets"] = [t["data_offsets"][0], t["data_offsets"][1] + 4096]
    return join(header, data)


def huge_header(raw: bytes) -> bytes:
    big = json.dumps({"__metadata__": {"x": "a" * (17 << 20)}}).encode()
    return struct.pack("<Q", len(big)) + big


def unknown_dtype(raw: bytes) -> bytes:
    header, data = split(raw)
    t = first_tensor(header)
    if t is None:
        header["tail"] = t = {"shape": [0], "data_offsets": [0, 0]}
    t["dtype"] = "F128"
    return join(header, data)


def metadata_of_the_wrong_type(raw: bytes) -> bytes:
    header, data = split(raw)
    header["__metadata__"]["tokens"] = [1, 2, 3]  # a list where a string must be
    return join(header, data)


def metadata_not_an_object(raw: bytes) -> bytes:
    header, data = split(raw)
    header["__metadata__"] = ["format", "mlx-kvcache-page"]
    return join(header, data)


@pytest.mark.parametrize("damage", [header_length_past_the_end, offsets_past_the_end,
                                    huge_header, unknown_dtype, metadata_of_the_wrong_type,
                                    metadata_not_an_object])
def test_malformed_safetensors_are_misses_not_crashes(tiny_lm, tmp_path, damage):
    cache = tmp_path / "kv"
    with running_server([tiny_lm], config(cache)) as url:
        history = conversation(url, "bad")
    root = store_root(cache)
    files = sorted(root.rglob("*.safetensors"))
    assert len(files) >= 4
    damaged = {f: damage(f.read_bytes()) for f in files}
    for f, raw in damaged.items():
        f.write_bytes(raw)
    with running_server([tiny_lm], config(cache)) as url:
        assert next_turn_is_exact(url, history, "bad") == 0  # nothing damaged was used
        for m in history:
            if m.get("message_id"):
                assert httpx.get(f"{url}/kv_cache/{q(m['message_id'])}").status_code == 404
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "ok"
    assert stats["disk"]["corrupt_files_removed"] >= len(files)
    # Removed; the same names may be back, written anew by the last turns with valid data.
    assert not any(f.exists() and f.read_bytes() == raw for f, raw in damaged.items())
    assert_store_layout(root)
