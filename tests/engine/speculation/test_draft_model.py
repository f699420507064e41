"""The draft model (engine/speculation/draft_model.py, ``--draft-model``): checked at load (the same
tokenizer token for token, the same end tokens, no recurrent state), drafting on a paged cache of
its own, never changing a greedy answer, and its sequences kept for the next turn."""

from __future__ import annotations

import httpx
import pytest

from mlx_kvserver import flags, server
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.speculation.draft_model import DraftModelError, check_draft_model
from mlx_kvserver.engine.engine import Engine
from mlx_kvserver.engine.speculation.pass_cost import PassCost
from mlx_kvserver.models.loading import resolve_and_load
from tests.chat.tiny_chat_model import make_tiny_chat_model_dir
from harness.server_utils import running_server
from harness.tiny_families import make_tiny_family_dir
from harness.tiny_model import make_tiny_model_dir


@pytest.fixture(autouse=True)
def whole_drafts(monkeypatch):
    # every draft verified whole
    monkeypatch.setattr(PassCost, "relative", lambda self, seqs, width: 1.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, the same weights as a draft: every draft taken, other weights: few taken)."""
    d = tmp_path_factory.mktemp("draft")
    target = resolve_and_load(str(make_tiny_model_dir(d / "t", seed=0)))
    same = resolve_and_load(str(make_tiny_model_dir(d / "s", seed=0)))
    other = resolve_and_load(str(make_tiny_model_dir(d / "o", seed=5, num_layers=1)))
    return target, same, other


def ask(url: str, lm, content: str, **kw) -> dict:
    r = httpx.post(url + "/chat/completions", timeout=120, json={
        "model": lm.name, "messages": [{"role": "user", "content": content}],
        "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def serve(target, draft, mode="draft"):
    config = ServerConfig(max_tokens=32, page_size=8, speculate=mode)
    return running_server([target], config, engine=Engine([target], config, draft=draft))


@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_answers_equal_without_speculation(models, which):
    target, same, other = models
    draft = same if which == "same" else other
    prompts = ["tell me a story", "what is the sea?", "count to ten"]
    with serve(target, None, "off") as url:
        want = [ask(url, target, p)["choices"][0]["message"]["content"] for p in prompts]
    with serve(target, draft) as url:
        got = [ask(url, target, p) for p in prompts]
    assert [g["choices"][0]["message"]["content"] for g in got] == want
    taken = sum(g["usage"]["completion_tokens_details"]["accepted_draft_tokens"] for g in got)
    assert all(g["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] ==
               g["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 0
               for g in got)  # the draft model's drafts are no prediction
    steps = sum(g["usage"]["decode_steps"] for g in got)
    tokens = sum(g["usage"]["completion_tokens"] for g in got)
    if which == "same":  # a draft model that is the model: everything it drafts is taken
        assert taken >= tokens // 2 and steps < tokens // 3
        assert sum(g["usage"]["completion_tokens_details"]["rejected_draft_tokens"]
                   for g in got) == 0
    else:
        assert sum(g["usage"]["completion_tokens_details"]["rejected_draft_tokens"]
                   for g in got) > 0


def test_batched_answers_and_the_next_turn_from_the_draft_cache(models):
    target, same, _ = models
    with serve(target, None, "off") as url:
        want = ask(url, target, "hello", n=3, max_tokens=12)
    with serve(target, same) as url:
        got = ask(url, target, "hello", n=3, max_tokens=12)
        assert [c["message"]["content"] for c in got["choices"]] == \
            [c["message"]["content"] for c in want["choices"]]
        stats = httpx.get(url + "/kv_cache/stats", timeout=30).json()["models"][target.name]
        assert stats["speculation"]["mode"] == "draft"
        assert stats["speculation"]["accepted"] > 0
    config = ServerConfig(max_tokens=16, page_size=8, speculate="draft")
    engine = Engine([target], config, draft=same)
    with running_server([target], config, engine=engine) as url:
        first = ask(url, target, "tell me about rivers and the sea")
        mid = first["message_id"]
        assert engine.draft.manager.describe(mid) is not None  # its draft sequence, kept
        before = engine.draft.manager.report()["tokens_served"]
        msgs = [{"role": "user", "content": "tell me about rivers and the sea"},
                {"role": "assistant", "content": first["choices"][0]["message"]["content"],
                 "message_id": mid}, {"role": "user", "content": "and lakes?"}]
        r = httpx.post(url + "/chat/completions", timeout=120, json={
            "model": target.name, "messages": msgs, "temperature": 0}).json()
        assert r["usage"]["completion_tokens_details"]["accepted_draft_tokens"] > 0
        # the next turn's draft sequence started from the first one's (not from nothing)
        assert engine.draft.manager.report()["tokens_served"] > before


def test_another_tokenizer_is_refused_at_load(models, tmp_path):
    target = models[0]
    qwen = resolve_and_load(str(make_tiny_chat_model_dir(tmp_path / "q", "qwen3")))
    with pytest.raises(DraftModelError, match="another tokenizer"):
        check_draft_model(qwen, target)
    with pytest.raises(DraftModelError, match="another tokenizer"):
        Engine([target], ServerConfig(speculate="draft"), draft=qwen)
    state = resolve_and_load(str(make_tiny_family_dir(tmp_path / "s", "qwen3_5")))
    with pytest.raises(DraftModelError):
        check_draft_model(state, state)


def test_the_command_line(models, tmp_path):
    target = models[0]
    parser = flags.build_parser()
    with pytest.raises(SystemExit, match="--draft-model"):
        flags.config_from_args(parser.parse_args(["--speculate", "draft"]))
    config = flags.config_from_args(parser.parse_args(["--draft-model", target.source]))
    assert (config.speculate, config.draft_model) == ("draft", target.source)
    config = flags.config_from_args(parser.parse_args(["--speculate", "off"]))
    assert config.speculate == "off" and config.draft_model is None
    qwen = make_tiny_chat_model_dir(tmp_path / "q", "qwen3")
    config = flags.config_from_args(parser.parse_args(
        ["--model", target.source, "--draft-model", str(qwen), "--no-disk-cache"]))
    with pytest.raises(SystemExit, match="--draft-model: .*another tokenizer"):
        server.load_engine(config)
