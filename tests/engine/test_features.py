"""Image features kept by image (engine/features.py) on the tiny Qwen2.5-VL, greedy: chats about
one image behind different system prompts (their pages miss) run the vision encoder once and
answer as when the encoder runs every time; after a restart another chat about it reads the
features from disk (the encoder runs 0 times), another image runs it again; the counts in the
stats and in /metrics; the features' bytes in the memory budget; the encoder's memory counted
with the pass that runs it, and not for an image whose features are kept."""

from __future__ import annotations

from pathlib import Path

import httpx

from harness.server_utils import make_engine, running_server
from kv_cache import Span
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.features import features_key, patches
from mlx_kvserver.engine.pressure import MIN_CHUNK, Pressure
from mlx_kvserver.models.loading import LoadedModel
from tests.api.test_metrics import scrape, value
from tests.engine.test_images import no_hub, vlm  # noqa: F401 (fixtures)
from tests.models.image_families.exact import PICTURES, first_turn, logprobs, prompt_of, same
from tests.models.test_vision import MAX_TOKENS, ask  # greedy, with logprobs

SYSTEMS = ("You are terse.", "You describe pictures.", "Answer in one word.")


def about(image: str, system: str) -> list[dict]:
    return [{"role": "system", "content": system}, *first_turn(image)]


def stats(url: str, model: str) -> dict:
    return httpx.get(f"{url}/kv_cache/stats", timeout=30).json()["models"][model]


def test_an_image_is_encoded_once_kept_on_disk_and_answers_as_encoded_each_time(
        vlm: LoadedModel, tmp_path: Path) -> None:
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    chats = [("a", SYSTEMS[0]), ("a", SYSTEMS[1]), ("a", SYSTEMS[2]), ("b", SYSTEMS[0])]
    # the reference: the encoder runs for every piece that holds the image, nothing cached
    ref_config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "ref")
    ref_engine = make_engine([vlm], ref_config)
    ref_engine.schedulers[vlm.name].runner.features = None
    with running_server([vlm], ref_config, engine=ref_engine) as url:
        want = [ask(url, vlm.name, about(image, system), False) for image, system in chats]

    engine = make_engine([vlm], config)
    features = engine.schedulers[vlm.name].runner.features
    with running_server([vlm], config, engine=engine) as url:
        got = [ask(url, vlm.name, about("a", s)) for s in SYSTEMS[:2]]
        s = stats(url, vlm.name)
        metrics = scrape(url)
    assert features.runs == 1  # two conversations, one image: one encoder run
    span = prompt_of(vlm, PICTURES["a"]).spans[0]
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] <= span.start  # pages missed
    images = s["images"]
    assert images["encoder_runs"] == 1 and images["feature_hits_memory"] == 1
    assert images["feature_hits_disk"] == 0 and images["features_in_memory"] == 1
    assert s["memory"]["features_bytes"] == images["features_bytes"] > 0  # in the one budget
    assert s["disk"]["arrays"] == 1
    assert value(metrics, "image_encoder_runs_total", model=vlm.name) == 1
    assert value(metrics, "image_feature_hits_total", model=vlm.name, source="memory") == 1
    assert value(metrics, "image_features_bytes", model=vlm.name) == images["features_bytes"]
    assert value(metrics, "memory_features_bytes") == images["features_bytes"]

    engine = make_engine([vlm], config)  # a restart on the same cache directory
    features = engine.schedulers[vlm.name].runner.features
    with running_server([vlm], config, engine=engine) as url:
        got.append(ask(url, vlm.name, about("a", SYSTEMS[2])))
        assert features.runs == 0  # the features came from disk
        got.append(ask(url, vlm.name, about("b", SYSTEMS[0])))
        assert features.runs == 1  # another image: encoded
        s = stats(url, vlm.name)
        metrics = scrape(url)
    assert s["images"]["feature_hits_disk"] == 1 and s["images"]["encoder_runs"] == 1
    assert value(metrics, "image_feature_hits_total", model=vlm.name, source="disk") == 1
    for mine, theirs in zip(got, want):
        assert same(logprobs(mine), logprobs(theirs))
    assert logprobs(got[0]) != logprobs(got[3])


def test_the_encoders_memory_is_counted_with_the_pass_that_runs_it(vlm: LoadedModel,
                                                                   tmp_path: Path) -> None:
    """The scheduler hands the memory policy each image not kept (its patches); a chunk whose
    pass with the encoder would not fit stops before the image; once its features are kept,
    the image costs no encoder."""
    config = ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path / "kv")
    engine = make_engine([vlm], config)
    scheduler, budget = engine.schedulers[vlm.name], engine.memory
    prompt = prompt_of(vlm, PICTURES["a"]).images  # the ImagePrompt
    image, span = prompt.images[0], prompt.spans[0]
    n = patches(image)
    assert n == 4 * span.length  # 2 x 2 patches merged into each image token
    v = budget.visions[vlm.name]
    assert (v.hidden, v.intermediate, v.heads, v.out_hidden) == (32, 64, 2, 64)
    # linear in the patches but for one block's attention scores over all of them (float32)
    peak = budget.encoder_peak
    assert peak(vlm.name, 2 * n) - 2 * peak(vlm.name, n) == 3 * v.heads * 2 * n * n * 4 > 0
    assert budget.encoder_peak("text-model", n) == 0

    class R:  # what the scheduler reads of a request
        images = prompt

    assert scheduler._to_encode(R, 0) == [(span.start, span.end, n)]
    assert scheduler._to_encode(R, span.end) == []  # read already
    scheduler.runner.features.encode(span, image)
    assert scheduler.runner.features.kept(span) and scheduler._to_encode(R, 0) == []
    assert features_key(Span(0, 4, "../x")) is None  # not the server's digest: never a key
    engine.stop()

    p = Pressure(budget, vlm.name)
    images = [(300, 400, n * 8)]
    enc = budget.encoder_peak(vlm.name, n * 8)
    budget.in_use = lambda: 0
    budget.limit = budget.pass_peak(vlm.name, 512, 0) + enc // 2
    assert p.chunk(0, 512) == 512  # text alone fits whole
    assert p.chunk(0, 512, images=images) == 256  # stops before the image
    budget.limit = budget.pass_peak(vlm.name, 512, 0) + enc
    assert p.chunk(0, 512, images=images) == 512  # room for the encoder too
    budget.limit = budget.pass_peak(vlm.name, MIN_CHUNK, 0) + enc // 2
    budget.shed = lambda: 0
    assert p.chunk(0, 512, images=[(0, 100, n * 8)]) == 0  # waits: it cannot run yet
    assert p.chunk(0, 512, images=[(0, 100, n * 8)], first=True) == MIN_CHUNK
