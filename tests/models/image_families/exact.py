"""The exactness check every vision family's test runs: a chat about an image, greedy, through
the OpenAI API on a running server, against the family's own mlx-vlm model.

:func:`check_image_chat` asserts, for a loaded tiny model of the family: turn 1 equals mlx-vlm's
own model run over the whole sequence with nothing cached (``reference``, given the family's
call), for two different images; the cache on equals the cache off for turn 1 and turn 2; turn 2
reads turn 1's prompt, the image's tokens included, from the cache, warm and after a restart
(from the disk); the other image with the same text reuses nothing from the image's start on;
a prompt chunk smaller than the image leaves the image whole (the same answers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import pytest

from harness.server_utils import make_engine, running_server
from mlx_kvserver.chat.conversation import Conversation, Message, Text
from mlx_kvserver.chat.images import decode_image
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.request import Prompt
from mlx_kvserver.models.image_prompt import ImagePrompt
from mlx_kvserver.models.loading import LoadedModel
from tests.chat.pictures import data_url, file_of, picture
from tests.models.test_vision import MAX_TOKENS, ask  # greedy, with logprobs

QUESTION, FOLLOW_UP = "What is in this picture?", "And its colours?"
PICTURES = {"a": file_of(picture(96, 64)), "b": file_of(picture(96, 64).rotate(180))}

# mlx-vlm's model over the whole sequence: (its model, the prompt's token ids so far, the
# prompt made ready) -> the last position's logits
Call = Callable[[Any, list[int], Prompt], mx.array]


def first_turn(image: str, pictures: dict[str, bytes] = PICTURES) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": data_url(pictures[image])}}]}]


def second_turn(image: str, first: dict, pictures: dict[str, bytes] = PICTURES) -> list[dict]:
    return first_turn(image, pictures) + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": FOLLOW_UP}]


def logprobs(r: dict) -> list[tuple[str, float]]:
    return [(e["token"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]


def same(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    """The same answer token for token (each token's text and, but for float rounding, its
    log-probability)."""
    return len(a) == len(b) > 0 and all(
        x[0] == y[0] and x[1] == pytest.approx(y[1], abs=1e-3) for x, y in zip(a, b))


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def chat(url: str, model: str, image: str, pictures: dict[str, bytes] = PICTURES
         ) -> dict[str, dict]:
    """Turn 1 about ``image`` (cache on, then off) and turn 2 after it (on, then off)."""
    history = first_turn(image, pictures)
    out = {"first": ask(url, model, history), "cold": ask(url, model, history, False)}
    history = second_turn(image, out["first"], pictures)
    out["warm"] = ask(url, model, history)
    out["uncached"] = ask(url, model, history, False)
    return out


def prompt_of(lm: LoadedModel, image: bytes) -> Prompt:
    """Turn 1's prompt about ``image`` made ready for ``lm``."""
    return Prompt.of(Conversation(messages=[Message("user", [
        Text(QUESTION), decode_image(image, "messages[0]")])]), lm)


def two_images(lm: LoadedModel, pictures: dict[str, bytes] = PICTURES) -> ImagePrompt:
    """A prompt about pictures ``a`` and ``b`` made ready for ``lm`` (its images and spans): for
    the check that each image encoded alone gives the whole prompt's features."""
    two = Prompt.of(Conversation(messages=[Message("user", [
        Text("Compare"), decode_image(pictures["a"], "a"), decode_image(pictures["b"], "b")])]),
        lm).images
    assert two is not None and len(two.images) == 2
    return two


def reference(lm: LoadedModel, image: bytes, call: Call) -> list[tuple[str, float]]:
    """Turn 1's greedy answer as mlx-vlm's own model gives it: ``call`` over the whole
    sequence (prompt, pixels) at every step, nothing cached."""
    prompt = prompt_of(lm, image)
    tok = lm.tokenizer
    ids, out = list(prompt.tokens), []
    for _ in range(MAX_TOKENS):
        logits = call(lm.model.vlm, ids, prompt).astype(mx.float32)
        t = int(mx.argmax(logits).item())
        if t in tok.eos_token_ids:
            break
        out.append((tok.decode([t]), (logits - mx.logsumexp(logits))[t].item()))
        ids.append(t)
    return out


def check_image_chat(lm: LoadedModel, tmp_path: Path, call: Call,
                     pictures: dict[str, bytes] = PICTURES) -> dict[str, dict]:
    """The module docstring's checks on ``lm``; turn 1 and 2 of image ``a``'s chat returned."""
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    with running_server([lm], config, engine=make_engine([lm], config)) as url:
        a = chat(url, lm.name, "a", pictures)
        b = chat(url, lm.name, "b", pictures)  # the same text, another image
    with running_server([lm], config, engine=make_engine([lm], config)) as url:
        restarted = ask(url, lm.name, second_turn("a", a["first"], pictures))  # from the disk
    span = prompt_of(lm, pictures["a"]).spans[0]
    small = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, prefill_chunk=max(2, span.length // 2),
                         kv_cache_dir=tmp_path / "kv-small")
    with running_server([lm], small, engine=make_engine([lm], small)) as url:
        chunked = chat(url, lm.name, "a", pictures)

    assert span.length > small.prefill_chunk
    for run in (a, b, chunked):
        assert same(logprobs(run["first"]), logprobs(run["cold"]))
        assert same(logprobs(run["warm"]), logprobs(run["uncached"]))
        assert cached(run["cold"]) == cached(run["uncached"]) == 0
        # turn 2 reads turn 1's prompt, the image's tokens included, from the cache
        assert cached(run["warm"]) >= run["first"]["usage"]["prompt_tokens"] > span.end
    # after a restart, turn 2 reads turn 1 (and its image's tokens) back from the disk
    assert same(logprobs(restarted), logprobs(a["uncached"]))
    assert cached(restarted) >= a["first"]["usage"]["prompt_tokens"]
    # answered as mlx-vlm's own model answers, for each image
    assert same(logprobs(a["cold"]), reference(lm, pictures["a"], call))
    assert same(logprobs(b["cold"]), reference(lm, pictures["b"], call))
    # the other image: nothing reused from its start on (turn 1 after image a's chat)
    assert cached(b["first"]) <= span.start
    assert logprobs(a["cold"]) != logprobs(b["cold"])
    # a chunk smaller than the image: the same answers
    for key in ("first", "warm"):
        assert same(logprobs(chunked[key]), logprobs(a[key]))
    return a
