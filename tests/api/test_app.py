"""The app's own behaviour: an unexpected error in a handler is a logged 500 in the shape of the
API it came through, and the server goes on."""

from __future__ import annotations

import httpx

from mlx_kvserver.api import anthropic, openai_chat
from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server


def test_a_bug_in_a_handler_is_a_500_in_the_apis_own_shape(tiny_lm, monkeypatch, caplog):
    def broken(*a, **k):
        raise ZeroDivisionError("boom")

    with running_server([tiny_lm], ServerConfig(max_tokens=2)) as url:
        monkeypatch.setattr(openai_chat, "parse", broken)
        monkeypatch.setattr(anthropic, "parse", broken)
        chat = httpx.post(f"{url}/chat/completions", json={"messages": []})
        msgs = httpx.post(f"{url}/messages", json={"messages": []})
        monkeypatch.undo()
        ok = httpx.post(f"{url}/chat/completions", timeout=60,
                        json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 500 and chat.json()["error"]["type"] == "server_error"
    assert chat.json()["error"]["message"] == "internal error: ZeroDivisionError"
    assert msgs.status_code == 500 and msgs.json()["type"] == "error"
    assert msgs.json()["error"]["type"] == "api_error"
    assert ok.status_code == 200
    assert "ZeroDivisionError" in caplog.text
