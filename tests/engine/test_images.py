"""Image chats through the engine on the tiny Qwen2.5-VL: the same chat through the OpenAI,
Anthropic and Responses APIs gives the same answer from the cache; a prompt piece never cuts an
image; an image chat batched beside text chats answers as alone; a verify pass after an image
equals decoding token by token (greedy sampling throughout). The family's exactness (mlx-vlm's
own answer, cache on and off, warm, restored, chunked) is tests/models/image_families/."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import huggingface_hub
import mlx.core as mx
import pytest

from harness.server_utils import make_engine, running_server
from harness.tiny_vlm import make_tiny_vlm_dir
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.scheduler import whole_images
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.chat.pictures import data_url
from tests.models.image_families.exact import (PICTURES, QUESTION, first_turn, logprobs,
                                               prompt_of, same)
from tests.models.test_vision import MAX_TOKENS, ask  # greedy, with logprobs


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("vision")
    return resolve_and_load(str(make_tiny_vlm_dir(root / "tiny-vlm", seed=0)))


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_the_same_image_chat_through_every_api_is_the_same_answer_from_the_cache(
        vlm: LoadedModel, tmp_path: Path) -> None:
    """Turn 1 about an image through the OpenAI API, then the same through the Anthropic and
    Responses APIs: the same answer, the image's tokens read from the cache, and counted by
    ``/v1/messages/count_tokens`` as the Messages API reads them (the family's
    exactness on every path: tests/models/image_families/)."""
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    with running_server([vlm], config, engine=make_engine([vlm], config)) as url:
        openai = ask(url, vlm.name, first_turn("a"))
        anthropic = httpx.post(f"{url}/messages", timeout=120, json={
            "model": vlm.name, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PICTURES["a"]).decode()}}]}]})
        counted = httpx.post(f"{url}/messages/count_tokens", timeout=120, json={
            "model": vlm.name, "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PICTURES["a"]).decode()}}]}]})
        responses = httpx.post(f"{url}/responses", timeout=120, json={
            "model": vlm.name, "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": QUESTION},
                {"type": "input_image", "image_url": data_url(PICTURES["a"])}]}]})
    span = prompt_of(vlm, PICTURES["a"]).spans[0]
    said = openai["choices"][0]["message"]["content"]
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == said
    assert anthropic.json()["usage"]["cache_read_input_tokens"] > span.end
    # counted as the Messages API reads it: the image's tokens included
    usage = anthropic.json()["usage"]
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == (usage["input_tokens"]
                                              + usage["cache_read_input_tokens"]) > span.end
    assert responses.status_code == 200, responses.text
    assert [c["text"] for o in responses.json()["output"] if o["type"] == "message"
            for c in o["content"]] == [said]
    assert responses.json()["usage"]["input_tokens_details"]["cached_tokens"] > span.end


def test_a_prompt_piece_never_cuts_an_image() -> None:
    spans = [(10, 24, "x"), (40, 4, "y")]
    assert whole_images(spans, 0, 16) == 10  # back to the image's start
    assert whole_images(spans, 10, 15) == 34  # begins with it: the whole image
    assert whole_images(spans, 34, 42) == 40
    assert whole_images(spans, 0, 10) == 10 and whole_images(spans, 34, 40) == 40
    assert whole_images([], 0, 7) == 7


def test_an_image_chat_batched_beside_text_chats_answers_as_alone(vlm: LoadedModel,
                                                                  tmp_path: Path) -> None:
    """Decode passes of an image chat (positions after its image: index + its delta) and of text
    chats (index) in one batch: each answer as when it runs alone."""
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    texts = [[{"role": "user", "content": f"Tell me about {w}."}] for w in ("the sea", "snow")]
    chats = [first_turn("a"), *texts, first_turn("b")]
    engine = make_engine([vlm], config)
    runner = engine.schedulers[vlm.name].runner
    decode, mixed = runner.decode, []

    def spy(seqs, tokens):  # whether a pass held rows with and without an image's delta
        deltas = {getattr(s, "rope_delta", 0) for s in seqs}
        mixed.append(0 in deltas and len(deltas) > 1)
        return decode(seqs, tokens)

    runner.decode = spy
    with running_server([vlm], config, engine=engine) as url:
        alone = [ask(url, vlm.name, m, False) for m in chats]
        with ThreadPoolExecutor(len(chats)) as pool:
            together = list(pool.map(lambda m: ask(url, vlm.name, m, False), chats))
    assert runner.batched and any(mixed)
    for x, y in zip(alone, together):
        assert same(logprobs(x), logprobs(y))


def test_a_verify_pass_after_an_image_equals_decoding_token_by_token(vlm: LoadedModel) -> None:
    """A draft verified after an image (one pass over several positions, alone and beside a
    text sequence in a ragged or padded pass) has each position's logits as decoding one token
    at a time: the positions past the prompt are index + the prompt's delta in every pass."""
    from tests.engine.test_runner import _runner

    prompt = prompt_of(vlm, PICTURES["a"])
    assert prompt.rope_delta != 0
    manager, runner = _runner(vlm)
    draft = [5, 6, 7]
    rows = []
    for alone in (True, False):
        seqs = [manager.new_sequence(), manager.new_sequence()]
        seqs[0].rope_delta = prompt.rope_delta
        runner.prefill(seqs[0], prompt.tokens, images=prompt.images)
        runner.prefill(seqs[1], [1, 2, 3, 4])
        rows.append(runner.verify(seqs[:1], [draft])[0] if alone
                    else runner.verify(seqs, [draft, [9]])[0])
        for s in seqs:
            s.close()
    seq = manager.new_sequence()
    seq.rope_delta = prompt.rope_delta
    runner.prefill(seq, prompt.tokens, images=prompt.images)
    stepwise = mx.concatenate([runner.decode([seq], [t]) for t in draft])
    for row in rows:
        assert mx.allclose(row.astype(mx.float32), stepwise.astype(mx.float32), atol=1e-3)
