"""A chat about an image on a vision-language model (the tiny Qwen2.5-VL), end to end through
the OpenAI API: answered as mlx-vlm's own model answers it (its features in place of the image's
tokens, M-RoPE positions after the image), the same with the cache on and off, turn 2 reading
the first turn's prompt (the image's tokens included) from the cache, warm and after a restart,
the same chat through the Anthropic and Responses APIs, a different image with the
same text reusing nothing from the image on, and a prompt chunk smaller than the image leaving
it whole (greedy sampling throughout)."""

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
from mlx_kvserver.chat.conversation import Conversation, Message, Text
from mlx_kvserver.chat.images import decode_image
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.request import Prompt
from mlx_kvserver.engine.scheduler import whole_images
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.chat.pictures import data_url, file_of, picture
from tests.models.test_vision import MAX_TOKENS, ask  # greedy, with logprobs

QUESTION, FOLLOW_UP = "What is in this picture?", "And its colours?"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("vision")
    return resolve_and_load(str(make_tiny_vlm_dir(root / "tiny-vlm", seed=0)))


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


PICTURES = {"a": file_of(picture(96, 64)), "b": file_of(picture(96, 64).rotate(180))}


def first_turn(image: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": data_url(PICTURES[image])}}]}]


def logprobs(r: dict) -> list[tuple[str, float]]:
    return [(e["token"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]


def same(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    """The same answer token for token (each token's text and, but for float rounding, its
    log-probability)."""
    return len(a) == len(b) > 0 and all(
        x[0] == y[0] and x[1] == pytest.approx(y[1], abs=1e-3) for x, y in zip(a, b))


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def second_turn(image: str, first: dict) -> list[dict]:
    return first_turn(image) + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": FOLLOW_UP}]


def chat(url: str, model: str, image: str) -> dict[str, dict]:
    """Turn 1 about ``image`` (cache on, then off) and turn 2 after it (on, then off)."""
    history = first_turn(image)
    out = {"first": ask(url, model, history), "cold": ask(url, model, history, False)}
    history = second_turn(image, out["first"])
    out["warm"] = ask(url, model, history)
    out["uncached"] = ask(url, model, history, False)
    return out


def reference(lm: LoadedModel, image: str) -> list[tuple[str, float]]:
    """Turn 1's greedy answer as mlx-vlm's own model gives it: the whole sequence (prompt,
    pixels, grid) through its ``__call__`` at every step, nothing cached, its own positions."""
    conv = Conversation(messages=[Message("user", [
        Text(QUESTION), decode_image(PICTURES[image], "messages[0]")])])
    prompt = Prompt.of(conv, lm)
    ip = prompt.images
    vlm, tok = lm.model.vlm, lm.tokenizer
    ids, out = list(prompt.tokens), []
    for _ in range(MAX_TOKENS):
        logits = vlm(mx.array(ids)[None],
                     mx.concatenate([im.arrays["pixel_values"] for im in ip.images]),
                     image_grid_thw=mx.array([im.grid for im in ip.images])
                     ).logits[0, -1].astype(mx.float32)
        t = int(mx.argmax(logits).item())
        if t in tok.eos_token_ids:
            break
        lp = (logits - mx.logsumexp(logits))[t].item()
        out.append((tok.decode([t]), lp))
        ids.append(t)
    return out


def test_a_chat_about_an_image_is_exact_and_cached_like_text(vlm: LoadedModel,
                                                             tmp_path: Path) -> None:
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    with running_server([vlm], config, engine=make_engine([vlm], config)) as url:
        a = chat(url, vlm.name, "a")
        b = chat(url, vlm.name, "b")  # the same text, another image
        anthropic = httpx.post(f"{url}/messages", timeout=120, json={
            "model": vlm.name, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PICTURES["a"]).decode()}}]}]})
        responses = httpx.post(f"{url}/responses", timeout=120, json={
            "model": vlm.name, "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": QUESTION},
                {"type": "input_image", "image_url": data_url(PICTURES["a"])}]}]})
    with running_server([vlm], config, engine=make_engine([vlm], config)) as url:
        restarted = ask(url, vlm.name, second_turn("a", a["first"]))  # from the disk
    small = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, prefill_chunk=5,
                         kv_cache_dir=tmp_path / "kv-small")
    with running_server([vlm], small, engine=make_engine([vlm], small)) as url:
        chunked = chat(url, vlm.name, "a")

    span = Prompt.of(Conversation(messages=[Message("user", [
        Text(QUESTION), decode_image(PICTURES["a"], "messages[0]")])]), vlm).spans[0]
    assert span.length == 24 > small.prefill_chunk  # 96x64 pixels: 12x8 patches merged 2x2
    for run in (a, b, chunked):
        assert same(logprobs(run["first"]), logprobs(run["cold"]))
        assert same(logprobs(run["warm"]), logprobs(run["uncached"]))
        assert cached(run["cold"]) == cached(run["uncached"]) == 0
        # turn 2 reads turn 1's prompt, the image's tokens included, from the cache
        assert cached(run["warm"]) >= run["first"]["usage"]["prompt_tokens"] > span.end
    # the same chat through the Anthropic API: the same prompt (read from the cache) and answer
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == a["first"]["choices"][0]["message"]["content"]
    assert anthropic.json()["usage"]["cache_read_input_tokens"] > span.end
    assert responses.status_code == 200, responses.text
    said = [c["text"] for o in responses.json()["output"] if o["type"] == "message"
            for c in o["content"]]
    assert said == [a["first"]["choices"][0]["message"]["content"]]
    assert responses.json()["usage"]["input_tokens_details"]["cached_tokens"] > span.end
    # after a restart, turn 2 reads turn 1 (and its image's tokens) back from the disk
    assert same(logprobs(restarted), logprobs(a["uncached"]))
    assert cached(restarted) >= a["first"]["usage"]["prompt_tokens"]
    # answered as mlx-vlm's own model answers, for each image
    assert same(logprobs(a["cold"]), reference(vlm, "a"))
    assert same(logprobs(b["cold"]), reference(vlm, "b"))
    # the other image: nothing reused from its start on (turn 1 after image a's chat)
    assert cached(b["first"]) <= span.start
    assert logprobs(a["cold"]) != logprobs(b["cold"])
    # a chunk smaller than the image: the same answers
    for key in ("first", "warm"):
        assert same(logprobs(chunked[key]), logprobs(a[key]))


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

    prompt = Prompt.of(Conversation(messages=[Message("user", [
        Text(QUESTION), decode_image(PICTURES["a"], "messages[0]")])]), vlm)
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
