"""Two agent sessions with the same tools and system prompt share those pages, in memory and on
disk: Claude Code's volatile attribution line (a suffix per session) is removed before rendering,
so the second session's first turn reads only what differs."""

from __future__ import annotations

import copy

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from harness.agent_sessions import MODELS, Session, send
from harness.server_utils import running_server
from tests.harness.test_agent_sessions import tiny_long_lm  # noqa: F401  (a fixture)
from harness.tiny_model import make_tiny_tokenizer


def first_turn(url: str, seed: int) -> tuple:
    s = Session(api="anthropic", seed=seed, initial_tokens=1500, turns=1,
                tokenizer=make_tiny_tokenizer(), result_tokens=(40, 80), max_tokens=4)
    path, body, headers = s.request(1)
    assert "x-anthropic-billing-header" in body["system"][0]["text"]
    with httpx.Client(timeout=120) as client:
        res = send(client, url.removesuffix("/v1"), path, copy.deepcopy(body), headers)
    assert res.status == 200 and not res.error, res.error
    return res, body


def stats(url: str, name: str) -> dict:
    return httpx.get(f"{url}/kv_cache/stats").json()["models"][name]


@pytest.mark.parametrize("rules", [True, False], ids=["volatile rule", "no rules"])
def test_second_session_shares_the_tools_and_system_pages(tiny_long_lm, tmp_path, rules):  # noqa: F811
    config = ServerConfig(kv_cache_dir=tmp_path / "kv", max_tokens=4, page_size=16,
                          volatile_rules=rules,
                          model_aliases=[(m, "default") for m in MODELS.values()])
    with running_server([tiny_long_lm], config) as url:
        a, body_a = first_turn(url, seed=0)
        after_a = stats(url, tiny_long_lm.name)
        b, body_b = first_turn(url, seed=1)
        after_b = stats(url, tiny_long_lm.name)
    assert body_a["system"][0] != body_b["system"][0]  # the suffixes differ
    assert a.prompt_tokens > 1000 and a.cached_tokens == 0
    if not rules:  # the tool block before it is shared; the system prompt after it is not
        assert b.cached_tokens < b.prompt_tokens - 500
        return
    # the rest of the prompt is the same: all of it but the token left to run comes from A's
    assert b.prompt_tokens == a.prompt_tokens and b.cached_tokens == b.prompt_tokens - 1
    assert after_b["ram"]["bytes_shared"] > 0.9 * after_a["ram"]["bytes"] / 2
    pages_a, pages_b = after_a["disk"]["pages"], after_b["disk"]["pages"]
    assert pages_b - pages_a <= 2, (pages_a, pages_b)  # on disk the pages are written once
