"""The routes a router polls (``api/worker_routes.py``): the served model, the engine's health,
and the load in SGLang's and vLLM's shapes, read from the engine; the API key guards all but
``/health_generate``."""

from __future__ import annotations

import httpx

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server


def test_server_and_model_info_name_the_served_model_and_the_load_follows_the_cache(tiny_lm):
    with running_server([tiny_lm], ServerConfig(max_tokens=4, page_size=8)) as url:
        base = url.removesuffix("/v1")
        info = httpx.get(f"{base}/server_info").json()
        model = httpx.get(f"{base}/model_info").json()
        before = httpx.get(f"{base}/get_load").json()
        r = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Tell me about the sea, at length."}]})
        after = httpx.get(f"{base}/get_load").json()
        loads = httpx.get(f"{url}/loads").json()
        health = httpx.get(f"{base}/health_generate")
    assert r.status_code == 200 and health.status_code == 200
    assert info["model_path"] == info["served_model_name"] == model["model_path"] == tiny_lm.name
    assert info["dp_size"] == 1 and info["max_running_requests"] == ServerConfig.max_batch
    assert model["is_generation"] and model["context_length"] == tiny_lm.context_length
    rank = before["loads"][0]
    assert before["load"] == rank["num_reqs"] == rank["num_waiting_reqs"] == 0
    assert rank["max_total_num_tokens"] == info["max_total_num_tokens"] > 0
    figures = after["server"]["models"][tiny_lm.name]
    assert before["server"]["models"][tiny_lm.name]["pages_used"] == 0
    assert figures["pages_used"] > 0 and figures["page_size"] == 8  # the answer's pages, kept
    assert after["server"]["running"] == after["server"]["queued"] == 0  # nothing runs now
    assert 0 < after["server"]["memory"]["free_bytes"] <= after["server"]["memory"]["limit_bytes"]
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["num_used_tokens"] == \
        after["loads"][0]["num_used_tokens"]


def test_the_api_key_guards_the_load_not_the_health(tiny_lm):
    with running_server([tiny_lm], ServerConfig(max_tokens=2, api_key="k")) as url:
        base = url.removesuffix("/v1")
        bare = {p: httpx.get(f"{base}{p}").status_code
                for p in ("/health_generate", "/server_info", "/model_info", "/get_load")}
        keyed = httpx.get(f"{base}/get_load", headers={"Authorization": "Bearer k"})
    assert bare == {"/health_generate": 200, "/server_info": 401, "/model_info": 401,
                    "/get_load": 401}
    assert keyed.status_code == 200
