"""Each picture's image-processor output kept by its digest (mlx_kvserver/models/
image_preprocessing.py), on the tiny Qwen2.5-VL, Qwen3-VL and LLaVA: the processor's whole
output (token ids, pixels, grids) for a prompt with two different pictures, and with the same
picture twice, equals the real image processor's, first (each picture processed alone) and
again (nothing processed); a chat about a picture processes it once and answers as it does with
the real image processor; the least recently used outputs leave first when the bound is
reached, but never for another picture of the same call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL.Image import Transpose

from harness.server_utils import make_engine, running_server
from harness.tiny_llava import make_tiny_llava_dir
from harness.tiny_qwen3_vl import make_tiny_qwen3_vl_dir
from harness.tiny_vlm import make_tiny_vlm_dir
from mlx_kvserver.chat.conversation import Conversation, Message, Text
from mlx_kvserver.chat.images import decode_image
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.request import Prompt
from mlx_kvserver.models.image_preprocessing import (DIGEST, CachedImageProcessor, kept_image_bytes,
                                                    pil_image)
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.chat.pictures import file_of, picture
from tests.models.image_families.exact import PICTURES, chat, logprobs, same
from tests.models.test_vision import MAX_TOKENS, no_hub  # noqa: F401 (nothing from the hub)

MAKERS = {"qwen2_5_vl": make_tiny_vlm_dir, "qwen3_vl": make_tiny_qwen3_vl_dir,
          "llava": make_tiny_llava_dir}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp(request.param)
    return resolve_and_load(str(MAKERS[request.param](root / f"tiny-{request.param}", seed=0)))


class Forwarding:
    """An object standing in for ``inner``: its other attributes are ``inner``'s."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        if "inner" not in vars(self):
            raise AttributeError(name)
        return getattr(self.inner, name)


class Counting(Forwarding):
    """An image processor that counts the images it is given, call by call."""

    def __call__(self, images: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(len(images))
        return self.inner(images, *args, **kwargs)


def real(lm: LoadedModel) -> Any:
    """The model's real image processor (under the cache put in place when it loaded, and any
    counting)."""
    inner = lm.processor.image_processor
    assert isinstance(inner, CachedImageProcessor)
    while isinstance(inner, (CachedImageProcessor, Counting)):
        inner = inner.inner
    return inner


def counted(lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, max_bytes: int = 2**28
            ) -> tuple[CachedImageProcessor, Counting]:
    """An empty cache in the model's processor, around the real image processor counted."""
    counting = Counting(real(lm))
    cache = CachedImageProcessor(counting, lm.model.reader.join, max_bytes)
    monkeypatch.setattr(lm.processor, "image_processor", cache)
    return cache, counting


class Spy(Forwarding):
    """The model's processor, each call's keyword arguments and output kept."""

    def __call__(self, **kwargs: Any) -> Any:
        out = self.inner(**kwargs)
        self.calls.append((kwargs, out))
        return out


def processed(lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, names: list[str]
              ) -> tuple[Any, Any]:
    """The processor's output for a prompt about pictures ``names`` as the prompt is made
    (``image_prompt``), and the real image processor's for the same text and pictures."""
    with monkeypatch.context() as m:
        spy = Spy(lm.processor)
        m.setattr(lm, "processor", spy)
        Prompt.of(Conversation(messages=[Message("user", [Text("Compare"), *[
            decode_image(PICTURES[n], n) for n in names]])]), lm)
    (kwargs, out), = spy.calls
    with monkeypatch.context() as m:
        m.setattr(lm.processor, "image_processor", real(lm))
        return out, lm.processor(**kwargs)


def assert_equal(out: Any, ref: Any) -> None:
    assert set(out) == set(ref) >= {"input_ids", "pixel_values"}
    for key in ref:
        a, b = np.asarray(out[key]), np.asarray(ref[key])
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), key


@pytest.mark.parametrize("names", [["a", "b"], ["a", "a"]])
def test_the_output_is_the_real_image_processor_s(lm: LoadedModel, names: list[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _, counting = counted(lm, monkeypatch)
    first, ref = processed(lm, monkeypatch, names)
    assert_equal(first, ref)
    # each different picture processed once, alone
    assert counting.calls == [1] * len(set(names))
    again, ref = processed(lm, monkeypatch, names)
    assert_equal(again, ref)
    assert counting.calls == [1] * len(set(names))  # nothing processed again
    if "image_grid_thw" in ref:  # one grid per picture
        assert np.asarray(ref["image_grid_thw"]).shape == (len(names), 3)


def test_a_chat_processes_its_picture_once_and_answers_as_without(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, counting = counted(lm, monkeypatch)
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    with running_server([lm], config, engine=make_engine([lm], config)) as url:
        kept = chat(url, lm.name, "a")  # four requests about picture a
    assert counting.calls == [1]
    monkeypatch.setattr(lm.processor, "image_processor", real(lm))
    plain_config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8,
                                kv_cache_dir=tmp_path / "kv-plain")
    with running_server([lm], plain_config, engine=make_engine([lm], plain_config)) as url:
        plain = chat(url, lm.name, "a")
    for key, r in plain.items():
        assert same(logprobs(kept[key]), logprobs(r)), key


def test_the_least_recently_used_outputs_leave_first(lm: LoadedModel,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = (pil_image(decode_image(PICTURES[n], n)) for n in "ab")
    size = sum(np.asarray(v).nbytes for v in real(lm)([a]).values())
    cache, counting = counted(lm, monkeypatch, max_bytes=size)  # room for one picture
    for im in (a, b, b, a):
        cache([im])
    assert counting.calls == [1, 1, 1]  # b pushed a out
    assert cache.kept_bytes == size
    cache, counting = counted(lm, monkeypatch, max_bytes=size - 1)  # room for none
    for im in (a, a):
        cache([im])
    assert counting.calls == [1, 1] and cache.kept_bytes == 0
    # three pictures, room for two: a call keeps what fits and pushes out none of its own, so
    # the next call with the same pictures finds the two kept
    c = pil_image(decode_image(file_of(picture(96, 64).transpose(Transpose.FLIP_LEFT_RIGHT)), "c"))
    assert len({getattr(p, DIGEST) for p in (a, b, c)}) == 3
    cache, counting = counted(lm, monkeypatch, max_bytes=2 * size)
    for _ in range(3):
        cache([a, b, c])
    assert counting.calls == [1, 1, 1, 1, 1]  # c each time
    assert cache.kept_bytes == 2 * size
    # a picture without its digest goes to the real image processor as it is
    cache([a.copy(), a.copy()])
    assert counting.calls == [1, 1, 1, 1, 1, 2]


def test_memory_pressure_gives_the_kept_outputs_back(lm: LoadedModel,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """The engine's memory report counts the kept outputs, and its shedders (what the memory
    budget calls under pressure) give them back; the next call processes the picture again."""
    cache, counting = counted(lm, monkeypatch)
    a = pil_image(decode_image(PICTURES["a"], "a"))
    cache([a])
    assert cache.kept_bytes > 0 and kept_image_bytes(lm.processor) == cache.kept_bytes
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    engine = make_engine([lm], config)
    try:
        assert engine.memory_report()["image_inputs_bytes"] == cache.kept_bytes
        engine.memory.shed()
        assert cache.kept_bytes == 0 == engine.memory_report()["image_inputs_bytes"]
    finally:
        engine.stop()
    cache([a])
    assert counting.calls == [1, 1]
