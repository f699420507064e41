"""harness/agent_sessions.py: deterministic agent sessions of the right sizes that only ever grow,
and a live 3-turn session of each API against the server whose later turns come from the cache."""

from __future__ import annotations

import copy
import itertools
import json

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import resolve_and_load
from harness.agent_sessions import APIS, ID_PATTERNS, MODELS, Session, load_tokenizer, send
from harness.server_utils import running_server
from harness.tiny_model import make_tiny_model, make_tiny_tokenizer, tiny_config, write_model_dir

ANSWERS = ["I'll look at the package first.", "", "Let me read the file.", ("Found it: the "
           "price lookup returns None."), "Now the test."]


def played(api: str, turns: int = 6, **kw) -> tuple[Session, list[tuple[str, dict, dict]]]:
    """A session's first ``turns`` requests, with canned answers recorded in between."""
    s = Session(api=api, turns=turns, **kw)
    out = []
    for t in range(1, turns + 1):
        out.append(s.request(t))
        s.record(t, ANSWERS[(t - 1) % len(ANSWERS)])
    return s, out


def history(api: str, body: dict) -> list:
    return body["input" if api == "responses" else "messages"]


def without_cache_control(x):
    if isinstance(x, dict):
        return {k: without_cache_control(v) for k, v in x.items() if k != "cache_control"}
    if isinstance(x, list):
        return [without_cache_control(v) for v in x]
    return x


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer("default")  # the default model is installed by scripts/setup.sh


@pytest.mark.parametrize("api", APIS)
def test_the_same_seed_gives_the_same_requests(api):
    _, a = played(api, result_tokens=(50, 400))
    _, b = played(api, result_tokens=(50, 400))
    assert json.dumps(a) == json.dumps(b)


@pytest.mark.parametrize("api", APIS)
def test_each_turn_is_the_last_one_plus_appended_messages(api):
    _, reqs = played(api, turns=8, result_tokens=(50, 400))
    for (path, a, ha), (path2, b, hb) in itertools.pairwise(reqs):
        assert path == path2 and ha == hb
        a, b = without_cache_control(a), without_cache_control(b)
        old, new = history(api, a), history(api, b)
        assert new[:len(old)] == old
        assert 2 <= len(new) - len(old) <= 3  # (answer text,) tool call, tool result
        assert {k: v for k, v in a.items() if k not in ("messages", "input")} == \
            {k: v for k, v in b.items() if k not in ("messages", "input")}


@pytest.mark.parametrize("api", APIS)
def test_two_sessions_differ_only_in_the_attribution_suffix_and_ids(api):
    _, a = played(api, seed=0, result_tokens=(50, 400))
    _, b = played(api, seed=1, result_tokens=(50, 400))
    ja, jb = json.dumps(a), json.dumps(b)
    assert ja != jb
    assert ID_PATTERNS.sub("<id>", ja) == ID_PATTERNS.sub("<id>", jb)
    if api == "anthropic":
        first = [r[1]["system"][0]["text"] for r in (a[0], b[0])]
        assert first[0] != first[1]
        assert all(t.startswith("x-anthropic-billing-header: cc_version=2.1.") and
                   t.endswith("; cc_entrypoint=cli;") for t in first)


def test_anthropic_shape():
    s, reqs = played("anthropic", turns=3, result_tokens=(50, 400))
    path, body, headers = reqs[-1]
    assert path == "/v1/messages?beta=true"
    assert headers["anthropic-version"] == "2023-06-01" and "X-Claude-Code-Session-Id" in headers
    assert [b["type"] for b in body["system"]] == ["text"] * 3
    assert body["max_tokens"] == 32000 and body["stream"] is True
    assert {"thinking", "metadata", "context_management", "output_config"} <= set(body)
    assert all(set(t) == {"name", "description", "input_schema"} for t in body["tools"])
    msgs = body["messages"]
    assert msgs[1]["role"] == "system"  # the mid-conversation system message
    marked = [(i, k) for i, m in enumerate(msgs) if isinstance(m["content"], list)
              for k, b in enumerate(m["content"]) if "cache_control" in b]
    assert marked == [(len(msgs) - 1, len(msgs[-1]["content"]) - 1)]
    use = msgs[-2]["content"][-1]
    result = msgs[-1]["content"][0]
    assert use["type"] == "tool_use" and use["name"] == s.call(2).name
    assert result["type"] == "tool_result" and result["tool_use_id"] == use["id"]
    assert msgs[2]["content"][0] == {"type": "text", "text": ANSWERS[0]}
    assert len(msgs[-2]["content"]) == 1  # turn 2's answer was empty: only the call


def test_openai_shape():
    _, reqs = played("openai", turns=3, result_tokens=(50, 400))
    path, body, _ = reqs[-1]
    assert path == "/v1/chat/completions"
    assert body["tool_choice"] == "auto" and body["stream_options"] == {"include_usage": True}
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant",
                                         "tool"]
    assert msgs[0]["content"].rstrip().endswith("idempotency keys")  # the <env> block's end
    call = msgs[-2]["tool_calls"][0]
    assert msgs[-1]["tool_call_id"] == call["id"]
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_responses_shape():
    _, reqs = played("responses", turns=3, result_tokens=(50, 400))
    path, body, _ = reqs[-1]
    assert path == "/v1/responses"
    assert "instructions" not in body and body["store"] is False and body["stream"] is True
    items = body["input"]
    assert [i["role"] for i in items[:4]] == ["developer", "developer", "user", "user"]
    assert all(i["id"].startswith("msg_") for i in items if i["type"] == "message")
    calls = [i for i in items if i["type"] == "function_call"]
    outputs = [i for i in items if i["type"] == "function_call_output"]
    assert [c["call_id"] for c in calls] == [o["call_id"] for o in outputs] and len(calls) == 2
    kinds = [t["type"] for t in body["tools"]]
    assert set(kinds) <= {"function", "namespace", "web_search"} and kinds[-1] == "web_search"
    assert all(t["strict"] is False for t in body["tools"] if t["type"] == "function")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("target", [7000, 24000])
def test_sizes_with_the_default_tokenizer(default_tokenizer, api, target):
    s = Session(api=api, initial_tokens=target, turns=20, tokenizer=default_tokenizer)
    assert abs(s.initial_measured - target) <= 0.15 * target
    if api == "anthropic":  # Claude Code's size has all 25 tools, the small one a subset
        assert (len(s.tools) == 25) == (target == 24000)
    for t in range(1, 21):
        n = s.count(s.call(t).result)
        assert 200 <= n <= 3000 * 1.15, (t, n)


# -- live ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_long_lm(tmp_path_factory):
    """The tiny model with an 8,192-token context (sessions outgrow 2,048)."""
    cfg = {**tiny_config(), "max_position_embeddings": 8192}
    path = write_model_dir(tmp_path_factory.mktemp("tiny-agent"), make_tiny_model(0), cfg,
                           max_length=8192)
    return resolve_and_load(str(path))


@pytest.mark.parametrize("api", APIS)
def test_live_session_reuses_the_history(tiny_long_lm, tmp_path, api):
    config = ServerConfig(kv_cache_dir=tmp_path / "kv", max_tokens=16,
                          model_aliases=[(m, "default") for m in MODELS.values()])
    s = Session(api=api, initial_tokens=600, turns=3, tokenizer=make_tiny_tokenizer(),
                result_tokens=(40, 120), max_tokens=16)
    prompts = []
    with running_server([tiny_long_lm], config) as url, httpx.Client(timeout=120) as client:
        for turn in range(1, 4):
            path, body, headers = s.request(turn)
            res = send(client, url.removesuffix("/v1"), path, copy.deepcopy(body), headers)
            assert res.status == 200 and not res.error, (turn, res.error)
            assert res.prompt_tokens > 0
            if turn > 1:
                assert res.cached_tokens >= 0.9 * prompts[-1], (turn, res, prompts)
            prompts.append(res.prompt_tokens)
            s.record(turn, res.text, res.thinking)
    assert prompts[0] < prompts[1] < prompts[2]
