"""GET /metrics (mlx_kvserver/api/metrics.py): Prometheus text that prometheus_client's own parser
reads, counters that move with requests, the cache snapshot, one registry per app."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_kvserver.api import metrics as metrics_mod
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.api.metrics import Metrics, route_label
from harness.server_utils import running_server

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
P = "mlx_kvserver_"


def parse(text: str) -> dict:
    """{(sample name, frozenset of labels): value} for every sample."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict:
    r = httpx.get(url.removesuffix("/v1") + "/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((P + name, frozenset(labels.items())), 0.0)


def chat(url: str, messages: list[dict], stream: bool) -> dict:
    body = {"messages": messages, "max_tokens": 6, "stream": stream,
            "stream_options": {"include_usage": True}}
    if not stream:
        return httpx.post(f"{url}/chat/completions", json=body, headers=AUTH, timeout=60).json()
    out = {}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                out["message_id"] = chunk.get("message_id") or out.get("message_id")
                out["usage"] = chunk.get("usage") or out.get("usage")
    return out


def test_metrics_need_the_key_parse_and_move_with_requests(tiny_lm, tmp_path):
    config = ServerConfig(api_key=KEY, max_tokens=6, kv_cache_dir=tmp_path / "kv")
    with running_server([tiny_lm], config) as url:
        root, m = url.removesuffix("/v1"), tiny_lm.name
        assert httpx.get(f"{root}/metrics").status_code == 401  # behind the key
        before = scrape(url)
        assert value(before, "http_requests_total", route="/metrics", status="401") == 1
        assert value(before, "queue_depth") == 0 and value(before, "batch_size") == 0
        assert value(before, "kv_ram_budget_bytes", model=m) == 2 << 30
        assert value(before, "kv_disk_budget_bytes", model=m) == 10 << 30

        first = [{"role": "user", "content": "hello there", "message_id": "u1"}]
        a = chat(url, first, stream=False)
        second = [*first, {"role": "assistant", "content": a["choices"][0]["message"]["content"],
                           "message_id": a["message_id"]},
                  {"role": "user", "content": "more", "message_id": "u2"}]
        b = chat(url, second, stream=True)
        assert httpx.get(f"{url}/kv_cache/not-there", headers=AUTH).status_code == 404
        after = scrape(url)

        def moved(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        usages = [a["usage"], b["usage"]]
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
        assert moved("http_requests_total", route="/v1/chat/completions", status="200") == 2
        assert moved("http_requests_total", route="/v1/kv_cache/{message_id}", status="404") == 1
        assert moved("http_requests_total", route="/metrics", status="200") == 1
        assert moved("prompt_tokens_total", model=m) == sum(u["prompt_tokens"] for u in usages)
        assert moved("cached_prompt_tokens_total", model=m) == \
            sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert moved("completion_tokens_total", model=m) == \
            sum(u["completion_tokens"] for u in usages)
        assert moved("time_to_first_token_seconds_count", model=m) == 2
        assert moved("time_to_first_token_seconds_sum", model=m) > 0
        assert moved("decode_tokens_per_second_count", model=m) == \
            sum(u["completion_tokens"] > 1 for u in usages)
        stats = httpx.get(f"{url}/kv_cache/stats", headers=AUTH).json()["models"][m]
        assert value(after, "kv_cache_hits_total", model=m) == stats["hits"] >= 1
        assert value(after, "kv_cache_misses_total", model=m) == stats["misses"]
        assert value(after, "kv_cache_tokens_served_total", model=m) == stats["tokens_served"]
        assert value(after, "kv_ram_entries", model=m) == stats["ram"]["entries"] > 0
        assert value(after, "kv_ram_pages", model=m, state="held") == stats["ram"]["pages_held"]
        assert value(after, "kv_ram_bytes", model=m) == stats["ram"]["bytes"] > 0
        assert value(after, "kv_disk_entries", model=m) == stats["disk"]["entries"]
        assert value(after, "kv_disk_bytes", model=m) == stats["disk"]["bytes_on_disk"] > 0
        assert value(after, "kv_disk_enabled", model=m) == 1
        assert 0 <= value(after, "kv_stats_age_seconds") < 5
        assert not any("not-there" in str(labels) for _, labels in after)  # ids never labels
        mem = stats["memory"]  # the budget, one for the server (no model label)
        assert value(after, "memory_limit_bytes") == mem["limit_bytes"] > 0
        assert value(after, "memory_weights_bytes") == mem["weights_bytes"] > 0
        assert value(after, "memory_pages_bytes") == stats["ram"]["bytes"]
        assert value(after, "memory_refused_total") == 0
        assert value(after, "memory_outside_mlx_bytes") == mem["outside_mlx_bytes"]
        assert value(after, "memory_margin_bytes") == mem["margin_bytes"]
        assert value(after, "memory_mlx_active_bytes") > mem["weights_bytes"]


def test_speculation_counters_move_with_the_usage(tiny_lm):
    """A plain answer (speculate: false), then the same question with the model's own greedy
    answer as the prediction: the draft and decode-pass counters move by what each usage says
    (its draft tokens, every source), the prediction counter by the prediction's own counts,
    and they match the speculation figures of the cache stats."""
    config = ServerConfig(api_key=KEY, max_tokens=24)
    with running_server([tiny_lm], config) as url:
        m = tiny_lm.name

        def ask(**extra) -> dict:
            body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 24,
                    **extra}
            r = httpx.post(f"{url}/chat/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        def figures(samples: dict) -> dict:
            return {k: value(samples, k + "_total", model=m) for k in (
                "decode_steps", "decode_step_tokens", "speculation_verify_steps",
                "speculation_draft_tokens", "speculation_accepted_tokens")} | {
                o: value(samples, "prediction_tokens_total", model=m, outcome=o)
                for o in ("accepted", "rejected")}

        def moved(a: dict, b: dict) -> dict:
            return {k: b[k] - a[k] for k in a}

        start = scrape(url)
        assert value(start, "speculation_mode", model=m, mode="ngram") == 1
        plain = ask(speculate=False)
        after_plain = scrape(url)
        u = plain["usage"]
        assert u["completion_tokens"] == 24 and u["decode_steps"] == 23  # one token a pass
        assert moved(figures(start), figures(after_plain)) == {
            "decode_steps": 23, "decode_step_tokens": 23, "speculation_verify_steps": 0,
            "speculation_draft_tokens": 0, "speculation_accepted_tokens": 0, "accepted": 0,
            "rejected": 0}

        text = plain["choices"][0]["message"]["content"]
        predicted = ask(prediction={"type": "content", "content": text})
        after = scrape(url)
        u = predicted["usage"]
        details = u["completion_tokens_details"]
        taken = details["accepted_draft_tokens"]
        refused = details["rejected_draft_tokens"]
        assert predicted["choices"][0]["message"]["content"] == text  # greedy: the same answer
        assert taken > 0 and 0 < u["decode_steps"] < u["completion_tokens"] - 1
        d = moved(figures(after_plain), figures(after))
        assert d["speculation_draft_tokens"] == taken + refused
        assert d["speculation_accepted_tokens"] == taken
        assert d["decode_steps"] == u["decode_steps"]
        assert d["decode_step_tokens"] == u["completion_tokens"] - 1  # after the first token
        assert 1 <= d["speculation_verify_steps"] <= d["decode_steps"]
        shown = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
        assert (d["accepted"], d["rejected"]) == shown and shown[0] > 0
        assert sum(shown) == len(tiny_lm.tokenizer.encode(text))  # the prediction, all of it

        spec = httpx.get(f"{url}/kv_cache/stats", headers=AUTH).json()["models"][m]["speculation"]
        total = figures(after)
        assert (total["decode_steps"], total["decode_step_tokens"],
                total["speculation_verify_steps"], total["speculation_draft_tokens"],
                total["speculation_accepted_tokens"]) == \
            (spec["decode_steps"], spec["tokens"], spec["verify_steps"], spec["drafted"],
             spec["accepted"])
        # what Prometheus would derive, against the figures the stats route computes
        assert round(total["speculation_accepted_tokens"] / total["speculation_draft_tokens"],
                     4) == spec["acceptance_rate"]
        assert round(total["decode_step_tokens"] / total["decode_steps"], 4) == \
            spec["tokens_per_step"] > 1


def test_each_app_counts_its_own_requests(tiny_lm):
    config = ServerConfig(api_key=KEY, max_tokens=2)
    with running_server([tiny_lm], config) as one, running_server([tiny_lm], config) as two:
        for _ in range(3):
            httpx.get(f"{one}/models", headers=AUTH)
        assert value(scrape(one), "http_requests_total", route="/v1/models", status="200") == 3
        assert value(scrape(two), "http_requests_total", route="/v1/models", status="200") == 0


class SlowEngine:
    """An engine whose worker is busy: control calls never run."""

    queued, busy = 3, True

    async def call(self, fn):
        await asyncio.sleep(3600)

    def cache_stats(self):  # pragma: no cover - never reached
        raise AssertionError


STATS = {"m": {"hits": 4, "misses": 1, "tokens_served": 300, "disk_hits": 1,
               "ram": {"entries": 2, "pages": 10, "pages_held": 6, "pages_cached": 4,
                       "bytes": 10240, "bytes_shared": 3072, "budget_bytes": 1 << 20,
                       "evictions": 7},
               "disk": None, "disk_enabled": False,
               "speculation": {"mode": "ngram", "decode_steps": 10, "tokens": 25,
                               "verify_steps": 6, "drafted": 20, "accepted": 15,
                               "acceptance_rate": 0.75, "tokens_per_step": 2.5}}}


def test_cache_snapshot_families_and_a_busy_worker(monkeypatch):
    monkeypatch.setattr(metrics_mod, "STATS_TIMEOUT_S", 0.05)
    metrics = Metrics()
    metrics.cache.update(STATS)
    samples = parse(asyncio.run(metrics.scrape(SlowEngine())).decode())
    # the worker did not answer in time: the last snapshot stands, with its age
    assert value(samples, "kv_cache_hits_total", model="m") == 4
    assert value(samples, "kv_ram_pages", model="m", state="held") == 6
    assert value(samples, "kv_ram_pages", model="m", state="cached") == 4
    assert value(samples, "kv_ram_pages", model="m", state="shared") == 3  # 3072 / 1024 bytes
    assert value(samples, "kv_ram_evictions_total", model="m") == 7
    assert value(samples, "kv_disk_enabled", model="m") == 0
    assert ("mlx_kvserver_kv_disk_bytes", frozenset({("model", "m")})) not in samples
    assert value(samples, "speculation_mode", model="m", mode="ngram") == 1
    assert [value(samples, n + "_total", model="m") for n in (
        "decode_steps", "decode_step_tokens", "speculation_verify_steps",
        "speculation_draft_tokens", "speculation_accepted_tokens")] == [10, 25, 6, 20, 15]
    assert value(samples, "queue_depth") == 3 and value(samples, "batch_size") == 1
    SlowEngine.batch_size = 5  # an engine that batches says how many sequences run
    try:
        assert value(parse(asyncio.run(metrics.scrape(SlowEngine())).decode()),
                     "batch_size") == 5
    finally:
        del SlowEngine.batch_size


@pytest.mark.parametrize("path,label", [
    ("/", "/"), ("/v1/chat/completions", "/v1/chat/completions"),
    ("/static/app.js", "/static/{path}"), ("/v1/kv_cache/msg-1", "/v1/kv_cache/{message_id}"),
    ("/v1/kv_cache/export/a/b", "/v1/kv_cache/export/{message_id}"),
    ("/v1/kv_cache/stats", "/v1/kv_cache/stats"), ("/wp-admin", "other")])
def test_route_labels_are_bounded(path, label):
    assert route_label(path) == label
