"""Models on demand (``models/on_demand.py``, ``models/serving.py``): the names a request may load,
a model loaded on first use through each API and waited for, one whose load's peak would not fit
refused, bad names, the Hugging Face cache without downloads, ``--model-ttl`` and ``--pin``, and
(a real server process under a small memory limit) the least recently used model unloaded to
make room, loaded again, its conversation going on from its cache on disk. What a load will hold:
tests/models/test_footprint.py."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models import serving
from mlx_kvserver.models.footprint import estimate_load, estimate_weights, weights_bytes
from mlx_kvserver.models.loading import resolve_and_load
from mlx_kvserver.models.on_demand import AllowList, Resident, Source, idle_past, lru, source_of
from harness.server_procs import Server
from harness.server_utils import running_server
from harness.tiny_model import make_tiny_model_dir

HELLO = [{"role": "user", "content": "Hello world, how are you?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A folder of three tiny model folders (b, c, d), other weights than the served one's."""
    root = tmp_path_factory.mktemp("models")
    for seed, name in ((11, "b"), (12, "c"), (13, "d")):
        make_tiny_model_dir(root / name, seed=seed)
    return root


def config(tmp_path: Path, models: Path, **kw) -> ServerConfig:
    return ServerConfig(max_tokens=4, page_size=8, kv_cache_dir=tmp_path / "kv",
                        allow_models=[f"{models}/*"], **kw)


def chat(url: str, model: str | None, messages=HELLO, headers=None, **kw) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 4, **kw}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120)


def listed(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/models").json()["data"]}


# -- the policy ---------------------------------------------------------------------------------

def test_names_sources_and_the_allow_list(models: Path):
    b = str(models / "b")
    assert source_of(b) == Source(b, b, "path")
    assert source_of(f"{models}/x/../b").key == b
    assert source_of("mlx-community/Qwen3-0.6B@main") == Source(
        "mlx-community/Qwen3-0.6B@main", "mlx-community/Qwen3-0.6B@main", "hub")
    assert source_of("mlx-community/Qwen3-0.6B@main").repo == ("mlx-community/Qwen3-0.6B", "main")
    for name in (None, "", "default", "0", "12", "gpt-4o", " x/y", "a\x00b", "x" * 2000):
        assert source_of(name or "") is None, name
    assert source_of("./missing.gguf").kind == "path"  # a path: found missing when loaded
    assert not AllowList([]).enabled and AllowList([]).check(b) is None
    allow = AllowList([f"{models}/*", "mlx-community/*"], pins=["org/pinned"])
    assert allow.check(b).key == b and allow.check("mlx-community/x").kind == "hub"
    assert allow.check(f"{models}/c/../b").key == b  # a '..' only by its resolved path
    assert allow.check(f"{models}/../etc") is None  # matches the glob, resolves outside it
    assert allow.check("other/x") is None and allow.check("default") is None
    assert allow.check("org/pinned") is not None and allow.pinned(allow.check("org/pinned"))
    assert not allow.pinned(allow.check(b))


def test_least_recently_used_first_pinned_never():
    def res(name, status, used, pinned=False):
        r = Resident(Source(name, name, "hub"), pinned, status=status)
        r.last_used = used
        return r
    a, b, c, d = res("o/a", "loaded", 3), res("o/b", "loaded", 1), res("o/c", "loaded", 0, True), \
        res("o/d", "loading", 0)
    assert lru([a, b, c, d]) == [b, a] and lru([a, b, c, d], but=b) == [a]
    assert idle_past([a, b, c, d], ttl=5, now=7) == [b]


def test_ttl_counts_idle_time_from_the_last_look_that_found_the_model_busy(tiny_lm):
    """A model answering one long request for longer than the TTL is not unloaded right after
    it (idle counts from the last look that found it busy, not from the request's start)."""
    import asyncio
    import dataclasses

    from mlx_kvserver.engine.memory import MemoryBudget
    from mlx_kvserver.models.registry import ModelRegistry

    class Engine:  # what OnDemand asks of the engine
        memory, busy = MemoryBudget(1 << 30), {"o/x": True}
        models, removed = {"o/x": object()}, []

        @property
        def schedulers(self):
            return {n: type("S", (), {"busy": b})() for n, b in self.busy.items()}

        async def call(self, fn):
            return fn()

        def remove_model(self, name):
            if self.busy[name]:
                return False
            self.removed.append(name)
            return True

    async def scenario():
        engine, lm = Engine(), dataclasses.replace(tiny_lm, name="o/x")
        od = serving.OnDemand(ServerConfig(allow_models=["o/*"], model_ttl_s=0.2),
                              ModelRegistry([tiny_lm, lm]), engine)
        r = od.residents["o/x"] = Resident(Source("o/x", "o/x", "hub"), False, status="loaded",
                                           lm=lm, loads=1, weights=1)
        r.touch()
        od.start()
        await asyncio.sleep(0.6)  # busy all along: three TTLs
        busy_status = r.status
        engine.busy["o/x"] = False
        await asyncio.sleep(0.1)  # idle, but not for a TTL yet
        soon_after = r.status
        await asyncio.sleep(0.4)
        await od.close()
        return busy_status, soon_after, r.status, r.unloaded_why, "o/x" in od.registry, \
            engine.removed
    assert asyncio.run(scenario()) == ("loaded", "loaded", "unloaded",
                                       "idle for 0.2 s, --model-ttl", False, ["o/x"])


# -- through the server --------------------------------------------------------------------------

def test_loaded_on_first_use_through_chat_and_anthropic(tiny_lm, models, tmp_path):
    b, c = str(models / "b"), str(models / "c")
    with running_server([tiny_lm], config(tmp_path, models)) as url:
        before = listed(url)
        first = chat(url, b)
        again = chat(url, f"{models}/d/../b")  # another spelling of the same folder
        header = chat(url, "gpt-4o", headers={"X-Model-Id": b})  # the header wins
        msgs = httpx.post(f"{url}/messages", timeout=120, json={
            "model": c, "max_tokens": 4, "messages": HELLO})
        count = httpx.post(f"{url}/messages/count_tokens", timeout=60,
                           json={"model": c, "messages": HELLO})
        after = listed(url)
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert list(before) == [tiny_lm.name]
    assert before[tiny_lm.name]["status"] == "loaded" and before[tiny_lm.name]["pinned"]
    assert not before[tiny_lm.name]["on_demand"] and before[tiny_lm.name]["weights_bytes"] > 0
    assert first.status_code == 200 and first.json()["model"] == b
    assert again.json()["model"] == b and header.json()["model"] == b
    assert msgs.status_code == 200 and msgs.json()["model"] == c
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    assert list(after) == [tiny_lm.name, b, c]
    for name in (b, c):
        m = after[name]
        assert m["status"] == "loaded" and m["on_demand"] and not m["pinned"], m
        assert m["loads"] == 1 and m["weights_bytes"] == weights_bytes(
            resolve_and_load(name).model) and m["load_seconds"] > 0
    assert health["models"] == [tiny_lm.name, b, c]


def test_a_model_whose_load_would_not_fit_is_refused_though_its_weights_would(
        tiny_lm, tmp_path, monkeypatch):
    """Room is made for a load's peak, not only for its weights: a 4-bit model dequantized on
    load (float32 weights and one source tensor and chunk beside them) whose weights fit the
    weights' share but whose load's peak does not is a 400 that says both, before it loads."""
    from tests.models.test_footprint import quantized_dir

    for name in ("set_memory_limit", "set_cache_limit", "set_wired_limit"):
        monkeypatch.setattr(mx, name, lambda n: 0)  # this process's MLX limits stay as they are
    root = tmp_path / "models"
    q = quantized_dir(root / "q", hidden=256, vocab=4096)
    estimate = estimate_load(q, dequantize=True)
    assert estimate.peak > estimate.weights + (4 << 20)
    served = weights_bytes(tiny_lm.model)
    cap = served + (estimate.weights + estimate.peak) // 2  # the weights fit; the peak does not
    cfg = ServerConfig(max_tokens=4, page_size=8, kv_cache_dir=tmp_path / "kv",
                       allow_models=[f"{root}/*"], memory_limit_gb=cap / 0.75 / (1 << 30),
                       dequantize=True)
    with running_server([tiny_lm], cfg) as url:
        r = chat(url, str(q))
        models = listed(url)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_too_large", r.text
    mb = lambda n: f"{n / (1 << 20):.1f} MB"  # noqa: E731
    assert f"needs about {mb(estimate.peak)} while it loads ({mb(estimate.weights)} of weights " \
        "once loaded)" in r.json()["error"]["message"]
    assert str(q) not in models


def slow_loads(monkeypatch, seconds: float) -> list[str]:
    """Every load sleeps ``seconds`` in its thread first; the names loaded."""
    loaded, load = [], serving.load_source

    def slow(src, path, deq):
        loaded.append(src.name)
        time.sleep(seconds)
        return load(src, path, deq)
    monkeypatch.setattr(serving, "load_source", slow)
    return loaded


def test_concurrent_first_requests_load_once(tiny_lm, models, tmp_path, monkeypatch):
    loaded = slow_loads(monkeypatch, 0.5)
    b = str(models / "b")
    with running_server([tiny_lm], config(tmp_path, models)) as url:
        out: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: out.append(chat(url, b))) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        during = listed(url)[b]
        for t in threads:
            t.join()
        after = listed(url)[b]
    assert during["status"] == "loading" and during["loading"]["phase"] == "reading weights"
    assert during["loading"]["elapsed_s"] >= 0 and during["loads"] == 0
    assert [r.status_code for r in out] == [200] * 4 and {r.json()["model"] for r in out} == {b}
    assert loaded == [b] and after["loads"] == 1


def test_a_request_waits_for_a_load_however_long_it_takes(tiny_lm, models, tmp_path,
                                                         monkeypatch):
    """A load slower than any fixed wait: the request that started it and one that comes while
    it goes on are both answered when it ends (a wait is not a failure)."""
    slow_loads(monkeypatch, 2.0)
    b = str(models / "b")
    with running_server([tiny_lm], config(tmp_path, models)) as url:
        out: list[httpx.Response] = []
        first = threading.Thread(target=lambda: out.append(chat(url, b)))
        first.start()
        time.sleep(0.5)
        during = listed(url)[b]["status"]
        out.append(chat(url, b))
        first.join()
        loads = listed(url)[b]["loads"]
    assert during == "loading"
    assert [r.status_code for r in out] == [200, 200] and loads == 1


def test_bad_names_are_a_404_listing_the_served(tiny_lm, models, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # empty, offline
    cfg = config(tmp_path, models)
    cfg.allow_models.append("org/*")
    with running_server([tiny_lm], cfg) as url:
        other = chat(url, str(tmp_path))  # a folder the patterns do not allow
        escape = chat(url, f"{models}/../{tmp_path.name}")
        missing = chat(url, str(models / "nope"))
        hub = chat(url, "org/not-cached")
        anth = httpx.post(f"{url}/messages", timeout=60, json={
            "model": "org/not-cached", "max_tokens": 4, "messages": HELLO})
        names = list(listed(url))
    for r in (other, escape):
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["message"].endswith(
            f"not found; served: {tiny_lm.name} (other names load only when they match the "
            "server's --allow-models)")
    assert missing.status_code == 404 and "no such model file or folder" in missing.text
    assert hub.status_code == 404 and hub.json()["error"]["code"] == "model_not_cached"
    assert "not in this machine's Hugging Face cache" in hub.json()["error"]["message"]
    assert "--allow-download" in hub.json()["error"]["message"]
    assert anth.status_code == 404 and anth.json()["error"]["type"] == "not_found_error"
    assert names == [tiny_lm.name]  # failed loads are not listed


def test_a_hugging_face_id_in_the_local_cache_loads_without_downloads(tiny_lm, models, tmp_path,
                                                                     monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hf" / "models--org--tiny"
    shutil.copytree(models / "b", repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    cfg = config(tmp_path, models)
    cfg.allow_models.append("org/*")
    with running_server([tiny_lm], cfg) as url:
        r = chat(url, "org/tiny")
        m = listed(url)["org/tiny"]
    assert r.status_code == 200 and r.json()["model"] == "org/tiny"
    assert m["status"] == "loaded" and m["loads"] == 1


def test_model_ttl_unloads_an_idle_model_and_pin_keeps_one(tiny_lm, models, tmp_path):
    b, c = str(models / "b"), str(models / "c")
    cfg = config(tmp_path, models, model_ttl_s=0.4, pin_models=[c])
    with running_server([tiny_lm], cfg) as url:
        first = chat(url, b, [{**HELLO[0], "message_id": "u1"}])
        chat(url, c)
        memory = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]["memory"]
        deadline = time.monotonic() + 20
        while listed(url)[b]["status"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = listed(url)
        freed = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]["memory"]
        turn2 = [{**HELLO[0], "message_id": "u1"},
                 {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"],
                  "message_id": first.json()["message_id"]},
                 {"role": "user", "content": "And you?", "message_id": "u2"}]
        second = chat(url, b, turn2)
        back = listed(url)
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][b]
    assert gone[b]["status"] == "unloaded" and "--model-ttl" in gone[b]["unloaded_because"]
    assert gone[b]["weights_bytes"] is None and gone[b]["unload_seconds"] >= 0
    assert gone[c]["status"] == "loaded" and gone[c]["pinned"]  # idle as long, pinned
    b_weights = memory["weights_by_model"][b]
    assert b not in freed["weights_by_model"] and c in freed["weights_by_model"]
    assert freed["mlx_active_bytes"] <= memory["mlx_active_bytes"] - b_weights  # really freed
    assert second.status_code == 200 and back[b]["loads"] == 2
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first.json()["usage"]["prompt_tokens"]  # the first turn, from its disk cache
    assert stats["disk_hits"] == 1 and stats["pages_read_from_disk"] > 0


# -- a real server process under a small memory limit ----------------------------------------------

def test_least_recently_used_unloaded_for_room_and_back_from_disk(tmp_path, tiny_model_dir):
    """Weights may take 75% of 0.018 GB (14.5 MB): the served tiny model (0.5 MB) and two of the
    5.4 MB ones. c is pinned: d's load unloads b, though c was used before it; b's next turn
    unloads d, and reads only its new message (its first turn comes from its cache on disk)."""
    root = tmp_path / "models"
    for seed, name in ((21, "b"), (22, "c"), (23, "d")):
        make_tiny_model_dir(root / name, seed=seed, hidden=256)
    make_tiny_model_dir(root / "e", seed=24, hidden=1024, num_layers=1)  # 36 MB: never fits
    b, c, d, e = (str(root / n) for n in "bcde")
    server = Server(tiny_model_dir, tmp_path / "kv", tmp_path / "server.log",
                    "--allow-models", f"{root}/*", "--pin", c, "--memory-limit", "0.018",
                    "--memory-reserve", "0",  # MLX's bytes alone: the sizes below are exact
                    "--max-tokens", "4", "--page-size", "8", warm=True).start()
    url = server.url + "/v1"
    try:
        assert chat(url, c).status_code == 200
        turn1 = [{"role": "user", "content": "Tell me about the sea.", "message_id": "s1"}]
        first = chat(url, b, turn1)
        two = listed(url)
        third = chat(url, d)
        swapped = listed(url)
        turn2 = turn1 + [{"role": "assistant", "message_id": first.json()["message_id"],
                          "content": first.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And the mountains?", "message_id": "s2"}]
        second = chat(url, b, turn2)
        back = listed(url)
        back_stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][b]
        too_big = chat(url, e)
    finally:
        server.stop()
    log = server.log_text()
    assert first.status_code == 200 and third.status_code == 200, log[-3000:]
    assert [two[n]["status"] for n in (b, c)] == ["loaded", "loaded"]
    assert [swapped[n]["status"] for n in (b, c, d)] == ["unloaded", "loaded", "loaded"]
    assert "to make room for " + d in swapped[b]["unloaded_because"]
    assert [back[n]["status"] for n in (b, c, d)] == ["loaded", "loaded", "unloaded"]
    assert back[b]["loads"] == 2 and back[c]["loads"] == 1
    assert second.status_code == 200, second.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first.json()["usage"]["prompt_tokens"]  # the first turn, from disk
    assert back_stats["disk_hits"] == 1 and back_stats["pages_read_from_disk"] > 0
    assert f"unloaded model {b} (least recently used, to make room for {d}" in log
    assert log.count(f"loaded model {b} in ") == 2
    assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "model_too_large"
    need = estimate_weights(Path(e), dequantize=True) / (1 << 20)
    assert f"needs about {need:.1f} MB of weights; the models that stay loaded hold 5.6 MB and " \
        "all weights may take 13.8 MB (75% of the memory limit, 18.4 MB: --memory-limit); it " \
        "does not fit" in too_big.json()["error"]["message"]


def test_a_load_waits_for_the_busy_model_it_must_unload(tmp_path, tiny_model_dir):
    """Room for one more 5.4 MB model (c pinned, as above): d's load must unload b, which is
    answering. d's request waits for b's answer to end (it makes progress), then b goes and d
    is answered; the log says once why it waited."""
    root = tmp_path / "models"
    for seed, name in ((21, "b"), (22, "c"), (23, "d")):
        make_tiny_model_dir(root / name, seed=seed, hidden=256)
    b, c, d = (str(root / n) for n in "bcd")
    server = Server(tiny_model_dir, tmp_path / "kv", tmp_path / "server.log",
                    "--allow-models", f"{root}/*", "--pin", c, "--memory-limit", "0.018",
                    "--memory-reserve", "0", "--speculate", "off", "--page-size", "8",
                    warm=True).start()
    url = server.url + "/v1"
    try:
        assert chat(url, c).status_code == 200
        with httpx.stream("POST", f"{url}/chat/completions", timeout=120, json={
                "model": b, "messages": HELLO, "max_tokens": 1500, "temperature": 0,
                "stream": True}) as long:
            lines = long.iter_lines()
            next(line for line in lines if '"content"' in line)  # b is answering
            waited = chat(url, d)
            rest = "".join(lines)
        swapped = listed(url)
    finally:
        server.stop()
    log = server.log_text()
    assert waited.status_code == 200, waited.text
    assert '"finish_reason"' in rest  # b's answer ran to its end, not cut for d
    assert [swapped[n]["status"] for n in (b, c, d)] == ["unloaded", "loaded", "loaded"]
    assert log.count(f"model {d} waits for room") == 1
