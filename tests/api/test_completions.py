"""``/v1/completions`` through the official ``openai`` client: a raw prompt (text or token
ids), streamed or not, stop strings, logprobs, echo, reuse by token prefix; bad input is a 400
in OpenAI's shape."""

from __future__ import annotations

import openai
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server

PROMPT = "The capital of France is Paris. " * 12


@pytest.fixture(scope="module")
def client(tiny_lm, tmp_path_factory):
    config = ServerConfig(max_tokens=6, page_size=8, kv_cache_dir=tmp_path_factory.mktemp("kv"))
    with running_server([tiny_lm], config) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_text_and_token_ids_give_the_same_greedy_answer(client, tiny_lm):
    text = client.completions.create(model=tiny_lm.name, prompt=PROMPT, max_tokens=6,
                                     temperature=0)
    ids = tiny_lm.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=tiny_lm.name, prompt=ids, max_tokens=6,
                                       temperature=0)
    assert text.object == "text_completion" and text.choices[0].text
    assert by_ids.choices[0].text == text.choices[0].text
    assert text.usage.prompt_tokens == len(ids)
    # the second read of the same prompt comes from the cache, by token prefix
    assert by_ids.usage.prompt_tokens_details.cached_tokens >= len(ids) - 8


def test_stream_equals_the_whole_answer_and_ends_with_a_reason(client, tiny_lm):
    whole = client.completions.create(model=tiny_lm.name, prompt="hello there", max_tokens=6,
                                      temperature=0)
    chunks = list(client.completions.create(model=tiny_lm.name, prompt="hello there",
                                            max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_logprobs_echo_and_stop(client, tiny_lm):
    r = client.completions.create(model=tiny_lm.name, prompt="hello there", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    echoed = client.completions.create(model=tiny_lm.name, prompt="hello there", max_tokens=5,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "hello there" + r.choices[0].text
    stop = r.choices[0].text[2:4]
    if stop:
        cut = client.completions.create(model=tiny_lm.name, prompt="hello there",
                                        max_tokens=5, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == r.choices[0].text[:r.choices[0].text.index(stop)]


@pytest.mark.parametrize("kw,words", [
    ({"prompt": ""}, "must not be empty"),
    ({"prompt": [10**9]}, "outside this model's vocabulary"),
    ({"prompt": ["a", "b"]}, "batches of several prompts"),
    ({"prompt": "x", "logprobs": 9}, "from 0 to 5"),
    ({"prompt": "x", "suffix": "y"}, "'suffix' is not supported"),
])
def test_bad_input_is_a_400(client, tiny_lm, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=tiny_lm.name, max_tokens=2, **kw)
    assert words in e.value.body["message"]
