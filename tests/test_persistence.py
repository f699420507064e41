"""The disk tier through the real server: restarts, corrupt files, budget, management routes."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

TURNS = ["Tell me about the sea.", "And the mountains?", "Which is older?", "Say it shorter."]


def config(cache_dir, **kw) -> ServerConfig:
    return ServerConfig(max_tokens=10, page_size=8, kv_cache_dir=Path(cache_dir), **kw)


def ask(url, model, messages, use_cache=True, max_tokens=10):
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                       temperature=0, extra_body={"use_kv_cache": use_cache})
    msg = r.choices[0].message
    return msg.content, msg.model_extra["message_id"], r.usage


def run_turns(url, model, tag, turns, messages=None):
    messages = list(messages or [])
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text, "message_id": f"{tag}-u{i}"})
        content, mid, _ = ask(url, model, messages)
        messages.append({"role": "assistant", "content": content, "message_id": mid})
    return messages


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("pages/*/*.safetensors"))


def test_restart_answers_turn_four_from_disk(tiny_lm, tmp_path):
    with running_server([tiny_lm], config(tmp_path)) as url:
        history = run_turns(url, tiny_lm.name, "r", TURNS[:3])
        prev_prompt = ask(url, tiny_lm.name, history[:-1])[2].prompt_tokens  # turn 3 again
    history.append({"role": "user", "content": TURNS[3], "message_id": "r-u3"})
    with running_server([tiny_lm], config(tmp_path)) as url:  # a new process state, same dir
        warm, _, usage = ask(url, tiny_lm.name, history)
        cold, _, cold_usage = ask(url, tiny_lm.name, history, use_cache=False)
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert warm == cold
    assert cold_usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens >= prev_prompt
    assert stats["disk_hits"] == 1 and stats["pages_read_from_disk"] > 0


def test_edited_message_after_restart_reuses_common_prefix(tiny_lm, tmp_path):
    with running_server([tiny_lm], config(tmp_path)) as url:
        history = run_turns(url, tiny_lm.name, "e", TURNS[:2])
    edited = [dict(m) for m in history]
    edited[2] = dict(edited[2], content="Something else entirely.")  # the first answer, edited
    edited.append({"role": "user", "content": "Continue.", "message_id": "e-u2"})
    with running_server([tiny_lm], config(tmp_path)) as url:
        warm, _, usage = ask(url, tiny_lm.name, edited)
        cold, _, _ = ask(url, tiny_lm.name, edited, use_cache=False)
    assert warm == cold
    first_prompt = tiny_lm.tokenizer.encode(tiny_lm.tokenizer.render(
        [{"role": "user", "content": TURNS[0]}], add_generation_prompt=True))
    assert len(first_prompt) <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def corrupt_truncate(path: Path, n: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: n % max(len(data), 1)])


def corrupt_flip(path: Path, n: int) -> None:
    data = bytearray(path.read_bytes())
    data[-1 - (n * 997) % (len(data) // 2)] ^= 0x40
    path.write_bytes(bytes(data))


def corrupt_empty(path: Path, n: int) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_flip, corrupt_empty])
def test_damaged_files_are_misses_and_answers_stay_exact(tiny_lm, tmp_path, damage):
    with running_server([tiny_lm], config(tmp_path)) as url:
        history = run_turns(url, tiny_lm.name, "d", TURNS[:2])
    files = page_files(tmp_path) + sorted(tmp_path.rglob("tails/*/*.safetensors")) \
        + sorted(tmp_path.rglob("entries/*.safetensors"))
    assert files
    for i, f in enumerate(files):
        damage(f, 7 + 13 * i)
    history.append({"role": "user", "content": TURNS[2], "message_id": "d-u2"})
    with running_server([tiny_lm], config(tmp_path)) as url:
        warm, _, usage = ask(url, tiny_lm.name, history)
        cold, _, _ = ask(url, tiny_lm.name, history, use_cache=False)
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
    assert warm == cold
    assert usage.prompt_tokens_details.cached_tokens == 0  # nothing damaged was used


def test_cache_of_another_model_is_never_used(tiny_lm, tiny_lm_b, tmp_path):
    assert tiny_lm.fingerprint != tiny_lm_b.fingerprint
    with running_server([tiny_lm], config(tmp_path)) as url:
        history = run_turns(url, tiny_lm.name, "f", TURNS[:2])
    # Plant model A's files where model B's store lives.
    (root_a,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with running_server([tiny_lm_b], config(tmp_path)) as url:
        pass
    root_b = next(p for p in tmp_path.iterdir() if p.is_dir() and p != root_a)
    for src in list(root_a.rglob("*.safetensors")):
        dst = root_b / src.relative_to(root_a)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    history.append({"role": "user", "content": TURNS[2], "message_id": "f-u2"})
    with running_server([tiny_lm_b], config(tmp_path)) as url:
        warm, _, usage = ask(url, tiny_lm_b.name, history)
        cold, _, _ = ask(url, tiny_lm_b.name, history, use_cache=False)
    assert warm == cold and usage.prompt_tokens_details.cached_tokens == 0


def test_disk_budget_holds_after_every_turn_and_evicts_oldest(tiny_lm, tmp_path):
    page_bytes = tiny_lm.num_layers * 2 * tiny_lm.num_kv_heads * 8 * tiny_lm.head_dim * 4
    budget_gb = 25 * page_bytes / (1 << 30)
    with running_server([tiny_lm], config(tmp_path, max_kv_size_gb=budget_gb)) as url:
        first = run_turns(url, tiny_lm.name, "b0", TURNS[:1])
        for c in range(1, 6):
            run_turns(url, tiny_lm.name, f"b{c}", [f"Conversation {c}: " + TURNS[c % 4]])
            disk = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]["disk"]
            assert disk["bytes_on_disk"] <= disk["budget"]
        assert disk["evictions"] > 0
        gone = httpx.get(f"{url}/kv_cache/{first[-1]['message_id']}").json()
    # The oldest conversation went first (from disk; memory is a separate tier).
    assert gone.get("on_disk") in (False, None)


def test_management_routes_stats_entry_delete_export_import(tiny_lm, tmp_path):
    with running_server([tiny_lm], config(tmp_path / "a")) as url:
        history = run_turns(url, tiny_lm.name, "m", TURNS[:2])
        key = history[-1]["message_id"]
        info = httpx.get(f"{url}/kv_cache/{key}").json()
        assert info["message_id"] == key and info["in_memory"] and info["on_disk"]
        assert info["tokens"] > 0
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
        assert stats["ram"]["entries"] >= 4 and stats["disk"]["entries"] >= 4
        exported = httpx.get(f"{url}/kv_cache/export/{key}")
        assert exported.status_code == 200 and len(exported.content) > 1000
        assert httpx.delete(f"{url}/kv_cache/{key}").json()["deleted"] is True
        assert httpx.get(f"{url}/kv_cache/{key}").status_code == 404
        assert httpx.delete(f"{url}/kv_cache/{key}").status_code == 404
        assert httpx.get(f"{url}/kv_cache/export/nope").status_code == 404
    history.append({"role": "user", "content": TURNS[2], "message_id": "m-u2"})
    with running_server([tiny_lm], config(tmp_path / "b")) as url:  # an empty cache
        bad = httpx.post(f"{url}/kv_cache/import", content=b"not safetensors")
        assert bad.status_code == 400
        flipped = bytearray(exported.content)
        flipped[-5] ^= 1
        assert httpx.post(f"{url}/kv_cache/import", content=bytes(flipped)).status_code == 400
        r = httpx.post(f"{url}/kv_cache/import", content=exported.content)
        assert r.status_code == 200 and r.json()["message_id"] == key
        warm, _, usage = ask(url, tiny_lm.name, history)
        cold, _, _ = ask(url, tiny_lm.name, history, use_cache=False)
    turn2_prompt = tiny_lm.tokenizer.encode(tiny_lm.tokenizer.render(
        [{"role": m["role"], "content": m["content"]} for m in history[:3]],
        add_generation_prompt=True))
    assert warm == cold
    assert len(turn2_prompt) <= usage.prompt_tokens_details.cached_tokens <= info["tokens"]


def test_unusable_cache_dir_serves_without_disk(tiny_lm, tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    with running_server([tiny_lm], config(blocker)) as url:
        history = run_turns(url, tiny_lm.name, "u", TURNS[:2])
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert stats["disk_enabled"] is False and len(history) == 4
    assert os.path.isfile(blocker)


def test_import_larger_than_the_limit_is_413_and_stores_nothing(tiny_lm, tmp_path):
    with running_server([tiny_lm], config(tmp_path, max_import_bytes=1000)) as url:
        r = httpx.post(f"{url}/kv_cache/import?message_id=big", content=b"x" * 5000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert httpx.get(f"{url}/kv_cache/big").status_code == 404
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert stats["ram"]["entries"] == 0 and stats["disk"]["entries"] == 0
