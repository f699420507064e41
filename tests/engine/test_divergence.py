"""Why a turn read tokens again: the first difference from a history held before (token,
message, both sides), in usage, the log and /metrics; a volatile-line rule removes it."""

from __future__ import annotations

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

GUIDE = " ".join(f"Rule {i}: keep the answer short and kind." for i in range(30))


def chat(url: str, system: str, turns: list[str], answers: list[str] | None = None) -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if answers and i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    r = httpx.post(f"{url}/chat/completions", timeout=60,
                   json={"messages": msgs, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("rule", [False, True], ids=["reported", "volatile rule"])
def test_a_changed_line_near_the_head_is_reported_or_normalized(tiny_lm, tmp_path, rule):
    config = ServerConfig(kv_cache_dir=tmp_path / "kv",
                          volatile_rule=[r"^Request #\d+$"] if rule else [])
    with running_server([tiny_lm], config) as url:
        first = chat(url, f"Request #1\n{GUIDE}", ["hello"])
        answer = first["choices"][0]["message"]["content"]
        second = chat(url, f"Request #2\n{GUIDE}", ["hello", "more"], [answer])
        usage = second["usage"]
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        reread = [ln for ln in metrics.splitlines()
                  if ln.startswith("mlx_kvserver_reread_prompt_tokens_total{")]
        if rule:  # the line is gone before rendering: the history comes from the cache
            assert "kv_cache_divergence" not in usage
            assert usage["prompt_tokens_details"]["cached_tokens"] > \
                first["usage"]["prompt_tokens"]
            assert not reread or reread[0].endswith(" 0.0")
            return
        d = usage["kv_cache_divergence"]
        assert d["message_index"] == 0  # the system message
        assert "2" in d["prompt_excerpt"] and "1" in d["cached_excerpt"]
        assert d["prompt_excerpt"] != d["cached_excerpt"]
        assert usage["prompt_tokens_details"]["cached_tokens"] <= d["position"]
        held = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        assert d["reread_tokens"] == held - d["position"] > 100
        assert float(reread[0].rsplit(" ", 1)[1]) == d["reread_tokens"]
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][tiny_lm.name]["reread"]
        assert stats == {"tokens": d["reread_tokens"], "turns": 1, "last": d}


def test_another_conversation_on_the_same_system_prompt_is_no_reread(tiny_lm, tmp_path):
    config = ServerConfig(kv_cache_dir=tmp_path / "kv")
    with running_server([tiny_lm], config) as url:
        chat(url, GUIDE, ["the weather in Paris today"])
        other = chat(url, GUIDE, ["a poem about the sea"])
        assert "kv_cache_divergence" not in other["usage"]
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 100


def test_a_prompt_that_goes_on_from_the_last_turn_is_no_reread(tiny_lm, tmp_path):
    config = ServerConfig(kv_cache_dir=tmp_path / "kv")
    with running_server([tiny_lm], config) as url:
        first = chat(url, GUIDE, ["hello"])
        second = chat(url, GUIDE, ["hello", "more"],
                      [first["choices"][0]["message"]["content"]])
        assert "kv_cache_divergence" not in second["usage"]
