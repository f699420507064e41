"""Speculative decoding never changes a greedy answer (engine/speculation/speculate.py).

A random-weight model's answer is random text, so drafts are made to be taken: a ``prediction``
of the answer without speculation (whole, or with a few tokens changed: taken in part), or the
same request asked before with ``speculate: false`` (its saved token ids are a draft source).
The usage shows drafts verified, taken and, where intended, rejected: nothing passes vacuously.
Apart from those (``accepted_draft_tokens`` / ``rejected_draft_tokens``, every source), the
prediction's own counts (``accepted_prediction_tokens`` / ``rejected_prediction_tokens``) are its
tokens that appeared in the answer and not, whatever was drafted: 0 and 0 without one.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from kv_cache import open_cache
from mlx_kvserver.api import completions
from mlx_kvserver.chat.output import Accepted, Usage
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.speculation.drafts import Drafter
from mlx_kvserver.engine.request import Job
from mlx_kvserver.engine.runner import Runner
from mlx_kvserver.engine.scheduler import Scheduler
from mlx_kvserver.engine.speculation.pass_cost import PassCost
from mlx_kvserver.models.loading import resolve_and_load
from tests.engine.test_scheduler import Collect, run
from harness.server_utils import running_server
from harness.tiny_families import make_tiny_family_dir

MAX = 32


@pytest.fixture(autouse=True)
def wide_passes_cost_nothing(monkeypatch):
    """Every draft verified whole, as where a wider pass costs what a step does (a GPU): the
    width a step picks on this CPU (``Speculation._width``, tested in test_speculation_width.py)
    would otherwise cut the drafts these tests make to check every path."""
    monkeypatch.setattr(PassCost, "relative", lambda self, seqs, width: 1.0)


@pytest.fixture(scope="module")
def urls(tiny_lm):
    """(speculation on, speculation off): two servers of the tiny model."""
    on = ServerConfig(max_tokens=MAX, page_size=8, speculate="ngram", num_draft_tokens=8)
    off = ServerConfig(max_tokens=MAX, page_size=8, speculate="off")
    with running_server([tiny_lm], on) as a, running_server([tiny_lm], off) as b:
        yield a, b


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, lm, content, **kw) -> dict:
    msgs = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return post(url, "/chat/completions",
                {"model": lm.name, "messages": msgs, "temperature": 0, **kw})


def text(r: dict, i: int = 0) -> str:
    return r["choices"][i]["message"]["content"]


def details(u: dict) -> dict:
    return u.get("completion_tokens_details") or u["output_tokens_details"]


def drafts(u: dict) -> tuple[int, int]:
    """Draft tokens verified, every source: taken, refused."""
    return details(u)["accepted_draft_tokens"], details(u)["rejected_draft_tokens"]


def predicted(u: dict) -> tuple[int, int]:
    """The prediction's tokens that appeared in the answer, and that did not."""
    return details(u)["accepted_prediction_tokens"], details(u)["rejected_prediction_tokens"]


def predict(t: str) -> dict:
    return {"type": "content", "content": t}


def corrupt(t: str) -> str:
    """``t`` with two characters changed (a third and two thirds in): a draft taken in part."""
    out = list(t)
    for i in (len(t) // 3, 2 * len(t) // 3):
        out[i] = "Q" if out[i] != "Q" else "Z"
    return "".join(out)


def test_one_client_same_answer_with_whole_and_partial_predictions(urls, tiny_lm):
    on, off = urls
    p = "Tell me about the sea."
    ref = chat(off, tiny_lm, p)
    want = text(ref)
    assert ref["usage"]["completion_tokens"] == MAX and predicted(ref["usage"]) == (0, 0)
    plain = chat(off, tiny_lm, p, prediction=predict(want))
    assert drafts(plain["usage"]) == (0, 0)
    # the prediction's tokens that appeared: counted without a draft (a random model's text
    # re-encodes to other tokens in places: not all of them)
    counted = predicted(plain["usage"])
    assert sum(counted) == len(tiny_lm.tokenizer.encode(want)) and counted[0] >= MAX // 2
    no = chat(on, tiny_lm, p, speculate=False, prediction=predict(want))
    assert text(no) == want and drafts(no["usage"]) == (0, 0)
    assert no["usage"]["decode_steps"] == MAX - 1
    whole = chat(on, tiny_lm, p, prediction=predict(want))
    part = chat(on, tiny_lm, p, prediction=predict(corrupt(want)))
    for r in (whole, part):
        assert text(r) == want and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == MAX
        assert r["usage"]["decode_steps"] < MAX // 2
    assert drafts(whole["usage"])[0] >= MAX // 2
    assert predicted(whole["usage"]) == predicted(no["usage"]) == counted  # the same answer
    # (the saved ids of ``no`` agree with more than a changed prediction: they are drafted,
    # so the drafts taken in part are the scheduler tests' below, on token-id predictions)
    assert drafts(part["usage"])[0] >= MAX // 3
    bent = predicted(part["usage"])
    assert sum(bent) == len(tiny_lm.tokenizer.encode(corrupt(want)))
    assert 0 < bent[0] < counted[0] and bent[1] > counted[1]


def test_n_choices_each_take_their_drafts(urls, tiny_lm):
    on, off = urls
    p = "count with me"
    want = text(chat(off, tiny_lm, p))
    assert text(chat(on, tiny_lm, p, speculate=False)) == want  # its ids: drafts
    r = chat(on, tiny_lm, p, n=3, prediction=predict(corrupt(want)))
    assert [text(r, i) for i in range(3)] == [want] * 3
    assert drafts(r["usage"])[0] >= 3 * (MAX // 2)
    one = chat(on, tiny_lm, p, prediction=predict(corrupt(want)))  # each choice counts its own
    assert predicted(r["usage"]) == tuple(3 * n for n in predicted(one["usage"]))
    assert predicted(one["usage"])[0] > 0
    assert r["usage"]["decode_steps"] <= 3 * (MAX // 2)


def test_a_stop_string_inside_a_taken_draft(urls, tiny_lm):
    """The whole answer asked first with ``speculate: false``: its token ids, saved, are the
    drafts of the same request with a stop string inside them."""
    on, off = urls
    for p in ("Hello there, how are you today?", "the quick brown fox", "Tell me about France."):
        full = text(chat(off, tiny_lm, p))
        at = next((i for i in range(10, len(full) - 2) if full[i:i + 2].isascii()
                   and full[i:i + 2].isalnum() and full.find(full[i:i + 2]) == i), None)
        if at is not None:
            break
    assert at is not None, "no answer has a stop string to use"
    stop = [full[at:at + 2]]
    ref = chat(off, tiny_lm, p, stop=stop)
    assert text(ref) == full[:at] and ref["choices"][0]["finish_reason"] == "stop"
    assert text(chat(on, tiny_lm, p, speculate=False)) == full
    r = chat(on, tiny_lm, p, stop=stop)
    assert text(r) == text(ref) and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert drafts(r["usage"])[0] >= ref["usage"]["completion_tokens"] // 2
    body = {"model": tiny_lm.name, "messages": [{"role": "user", "content": p}], "stop": stop,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", on + "/chat/completions", json=body, timeout=60) as s:
        chunks = [httpx.Response(200, content=line[6:]).json() for line in s.iter_lines()
                  if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    assert streamed == text(ref)
    assert drafts(chunks[-1]["usage"])[0] > 0


@pytest.mark.parametrize("m", [1, 2, 7, 13])
def test_max_tokens_exactly_with_longer_drafts(urls, tiny_lm, m):
    on, off = urls
    p = "Which is older, the sea or the mountains?"
    full = text(chat(off, tiny_lm, p))
    assert text(chat(on, tiny_lm, p, speculate=False)) == full  # its ids: the drafts
    ref = chat(off, tiny_lm, p, max_tokens=m)
    r = chat(on, tiny_lm, p, max_tokens=m)
    assert text(r) == text(ref)
    assert r["usage"]["completion_tokens"] == m and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["decode_steps"] <= max(m - 1, 0)
    if m >= 7:
        assert drafts(r["usage"])[0] >= m // 2


def test_logprobs_are_the_same_token_for_token(urls, tiny_lm):
    on, off = urls
    p = "Describe a river."
    kw = {"logprobs": True, "top_logprobs": 3, "max_tokens": 16}
    ref = chat(off, tiny_lm, p, **kw)
    # no saved ids of it: the changed prediction drafts, taken in part
    r = chat(on, tiny_lm, p, prediction=predict(corrupt(text(ref))), **kw)
    assert text(r) == text(ref)
    assert drafts(r["usage"])[0] > 0 and drafts(r["usage"])[1] > 0
    a, b = ref["choices"][0]["logprobs"]["content"], r["choices"][0]["logprobs"]["content"]
    assert len(a) == len(b) == 16
    for x, y in zip(a, b):
        assert x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) < 1e-4
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        assert all(abs(s["logprob"] - t["logprob"]) < 1e-4
                   for s, t in zip(x["top_logprobs"], y["top_logprobs"]))


API = {  # path, body, answer text, usage
    "completions": ("/completions", lambda lm, p: {"prompt": p, "max_tokens": MAX},
                    lambda r: r["choices"][0]["text"]),
    "responses": ("/responses", lambda lm, p: {"input": p, "max_output_tokens": MAX},
                  lambda r: r["output"][-1]["content"][0]["text"]),
    "messages": ("/messages", lambda lm, p: {"max_tokens": MAX,
                                             "messages": [{"role": "user", "content": p}]},
                 lambda r: r["content"][0]["text"]),
}


@pytest.mark.parametrize("api", API)
def test_each_api_same_answer_and_usage(urls, tiny_lm, api):
    """Asked with ``speculate: false`` (no drafts), then again: the first answer's token ids,
    saved, are the second's drafts. Both equal the answer of a server without speculation."""
    on, off = urls
    path, make, answer = API[api]
    body = {"model": tiny_lm.name, "temperature": 0, **make(tiny_lm, f"A question for {api}.")}
    ref = post(off, path, body)
    first = post(on, path, {**body, "speculate": False})
    again = post(on, path, body)
    assert answer(first) == answer(again) == answer(ref) != ""
    assert drafts(first["usage"]) == (0, 0) == drafts(ref["usage"])
    assert drafts(again["usage"])[0] >= MAX // 2
    assert predicted(again["usage"]) == (0, 0)  # drafts, and no prediction
    assert again["usage"]["decode_steps"] < first["usage"]["decode_steps"] == MAX - 1


def test_a_regenerated_answer_takes_no_more_steps_with_its_text_as_prediction(urls, tiny_lm):
    """A regenerate: the answer asked again with the first one's text as ``prediction``. The
    cache holds the first answer's token ids (a draft source that agrees with the whole prompt);
    the prediction is its text, which a random model's answer re-encodes to other tokens in
    places. The prediction is one source among the others, never forced ahead of the saved ids:
    no more decode steps than without it, the same answer, and its own counts."""
    on, off = urls
    for p in ("Regenerate this answer.", "Once more, please.", "Say that again."):
        want = text(chat(off, tiny_lm, p))
        first = chat(on, tiny_lm, p, speculate=False)  # its ids: saved, a draft source
        assert text(first) == want
        without = chat(on, tiny_lm, p)
        with_ = chat(on, tiny_lm, p, prediction=predict(want))
        assert text(without) == text(with_) == want
        steps = (with_["usage"]["decode_steps"], without["usage"]["decode_steps"])
        assert steps[0] <= steps[1] < MAX - 1, (p, steps)
        assert predicted(without["usage"]) == (0, 0)
        assert sum(predicted(with_["usage"])) == len(tiny_lm.tokenizer.encode(want))
        assert predicted(with_["usage"])[0] > 0


def test_a_turn_restored_from_disk_and_the_turn_after_a_rejected_draft(tiny_lm, urls,
                                                                       tmp_path):
    """Turn 2 starts from turn 1's pages read back from disk (a new server on the same folder)
    and takes part of a prediction, rejecting the rest; turn 3 goes on from turn 2's sequence,
    kept in memory after its trims. Every answer equals the uncached one of the server without
    speculation. (That the KV kept is exactly the accepted tokens' is checked token for token
    below, with token-id prompts: a random model's answer text re-encodes to other tokens.)"""
    _, off = urls
    cfg = ServerConfig(max_tokens=MAX, page_size=8, kv_cache_dir=tmp_path)
    msgs: list[dict] = []

    def turn(url: str, new: str, prediction: bool) -> dict:
        msgs.append({"role": "user", "content": new, "message_id": f"w-u{len(msgs)}"})
        ref = chat(off, tiny_lm, msgs, use_kv_cache=False)
        r = chat(url, tiny_lm, msgs, **({"prediction": predict(corrupt(text(ref)))}
                                        if prediction else {}))
        assert text(r) == text(ref)
        msgs.append({"role": "assistant", "content": text(r),
                     "message_id": r["choices"][0]["message"]["message_id"]})
        return r

    def cached(r: dict) -> int:
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]
    with running_server([tiny_lm], cfg) as url:
        r1 = turn(url, "Tell me about winter light.", prediction=False)
    with running_server([tiny_lm], cfg) as url:  # memory empty, the same folder
        r2 = turn(url, "And the rivers?", prediction=True)
        r3 = turn(url, "Say it shorter.", prediction=False)
    accepted, rejected = drafts(r2["usage"])
    assert accepted > 0 and rejected > 0
    # (a random model's answer re-encodes to other tokens: the prompts are what is reused)
    assert cached(r2) >= r1["usage"]["prompt_tokens"]
    assert cached(r3) >= r2["usage"]["prompt_tokens"]


# -- the scheduler driven directly --------------------------------------------------------------
# Predictions are set as token ids on the request (``Request.prediction``): exact drafts, where a
# random model's answer text would re-encode to other tokens.


class Raw(Collect):
    """A completions job (a prompt of token ids)."""

    def __init__(self, body: dict, lm):
        Job.__init__(self, completions.parse(body, ServerConfig(temperature=0.0)), lm, loop=None)
        self.log = []


def make_scheduler(lm, speculate: str = "ngram") -> Scheduler:
    manager = open_cache(lm.cache_spec, lm.fingerprint, page_size=8, max_ram_bytes=64 << 20,
                         policy="lru", disk_dir=None, max_disk_bytes=0, max_resident=4)
    return Scheduler(manager, Runner(lm.model, manager, lm.name), speculate=speculate,
                     num_draft_tokens=8)


def serve(s: Scheduler, jobs: list, predictions=()) -> list:
    """Run ``jobs`` together (``predictions``: token ids for each, or None); their requests."""
    reqs = []
    for job, pred in zip(jobs, list(predictions) + [None] * len(jobs)):
        s.add(job)
        reqs.append(s.requests[-1])
        if pred is not None:
            reqs[-1].prediction = list(pred)
    run(s, {0: []})
    return reqs


def usage(job: Collect) -> Usage:
    return next(e for e in job.log if isinstance(e, Usage))


def ask(content, max_tokens: int = 32, **kw) -> dict:
    msgs = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, **kw}


def reference(lm, body: dict, raw: bool = False) -> tuple[str, list[int]]:
    """The answer (text, token ids) without speculation and without the cache."""
    job = (Raw if raw else Collect)({**body, "use_kv_cache": False}, lm)
    req, = serve(make_scheduler(lm, "off"), [job])
    return job.answers()[0][0], list(req.choices[0].tokens)


def bent(ids: list[int]) -> list[int]:
    """``ids`` with two tokens changed (a third and two thirds in)."""
    out = list(ids)
    for i in (len(ids) // 3, 2 * len(ids) // 3):
        out[i] = ids[i] - 1 if ids[i] > 0 else 1
    return out


def watch(s: Scheduler, seen: list) -> None:
    """Record each verify pass's drafts (a constrained choice's must be valid in its grammar);
    after it, every running choice's sequence holds exactly its prompt and accepted tokens (all
    but the last, which is still to run)."""
    verify = s.speculation.verify

    def wrapped(group, ds):
        for c, d in zip(group, ds):  # the grammar's choices verify only what it allows
            m = c.sampler.matcher
            assert m is None or m.valid_prefix(d) == len(d)
        seen.append([(c, list(d), c.draft_source, len(c.seq.tokens),
                      getattr(c.drafter, "proposed", None)) for c, d in zip(group, ds)])
        out = verify(group, ds)
        for c in group:
            if not c.done:
                assert c.seq.tokens == c.request.prompt + c.tokens[:-1]
        return out

    s.speculation.verify = wrapped


def test_drafts_of_different_lengths_in_one_batch(tiny_lm):
    prompts = ["the sea is old", "rivers run fast", "mountains in winter", "stones and light",
               "over the sea"]
    refs = [reference(tiny_lm, ask(p)) for p in prompts]
    bodies = [ask(p, speculate=i != 2) for i, p in enumerate(prompts)]
    preds = [refs[0][1], bent(refs[1][1]), refs[2][1], None, refs[4][1][:3]]
    s, seen = make_scheduler(tiny_lm), []
    watch(s, seen)
    jobs = [Collect(b, tiny_lm) for b in bodies]
    serve(s, jobs, preds)
    assert [j.answers()[0][0] for j in jobs] == [r[0] for r in refs]
    mixed = [sorted(len(d) for _, d, _, _, _ in step) for step in seen if len(step) >= 4]
    assert any(lens[0] == 0 and len(set(lens)) >= 3 for lens in mixed), mixed
    u = [usage(j) for j in jobs]
    assert u[0].draft_rejected == 0 and u[0].draft_accepted + u[0].decode_steps == 31
    assert u[0].decode_steps <= 5  # drafts of 4, then 8
    assert u[1].draft_accepted >= 16 and u[1].draft_rejected > 0
    assert (u[2].draft_accepted, u[2].draft_rejected, u[2].decode_steps) == (0, 0, 31)
    assert u[4].draft_accepted + u[4].draft_rejected <= 3
    # the predictions' own counts: their tokens in the answer, whether drafted or not (u[2]
    # does not speculate); two tokens changed are two that did not appear
    assert [(x.prediction_accepted, x.prediction_rejected) for x in u] == \
        [(32, 0), (30, 2), (32, 0), (0, 0), (3, 0)]


SCHEMA = {"type": "object", "required": ["color", "size", "tags"], "additionalProperties": False,
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}


def test_a_json_schema_answer_forced_tokens_and_cut_drafts(tiny_lm, monkeypatch):
    """Forced tokens are drafts (taken), a prediction that breaks the schema is cut where the
    grammar would refuse it (never verified past that), and the answer is the same."""
    body = ask("Give me json", 64, response_format=FORMAT)
    want, ids = reference(tiny_lm, body)
    propose = Drafter.propose

    def record(self, room):  # what the drafter proposed, before the grammar cut it
        self.proposed = propose(self, room)
        return self.proposed

    monkeypatch.setattr(Drafter, "propose", record)
    s, seen, offered = make_scheduler(tiny_lm), [], []
    watch(s, seen)
    lengths = s.speculation._lengths

    def cut_by_cost(group, drafts):  # the drafts as the grammar left them, before the cost cut
        offered.extend((c.draft_source, list(d), getattr(c.drafter, "proposed", None))
                       for c, d in zip(group, drafts))
        return lengths(group, drafts)

    s.speculation._lengths = cut_by_cost
    jobs = [Collect(dict(body, speculate=i != 2), tiny_lm) for i in range(3)]
    digits = [i for i, t in enumerate(ids) if tiny_lm.tokenizer.decode([t]).isdigit()]
    at, x = digits[len(digits) // 2], tiny_lm.tokenizer.encode("x")
    bad = ids[:at] + x + ids[at + 1:]  # a letter inside the integer
    serve(s, jobs, [None, bad, ids])
    assert [j.answers()[0] for j in jobs] == [(want, "stop")] * 3
    sources = {src for step in seen for _, d, src, _, _ in step if d}
    assert {"grammar", "prediction"} <= sources, sources
    cut = [(d, p) for src, d, p in offered if src == "prediction" and len(d) < len(p)]
    assert any(p[len(d)] == x[0] for d, p in cut), "no draft was cut at the letter"
    u = [usage(j) for j in jobs]
    assert u[0].draft_accepted >= 10 and u[1].draft_accepted >= 10
    assert (u[2].draft_accepted, u[2].draft_rejected) == (0, 0)


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "gpt_oss", "qwen3_5", "lfm2"])
def family(request, tmp_path_factory):
    return resolve_and_load(str(make_tiny_family_dir(tmp_path_factory.mktemp(request.param),
                                                     request.param)))


def test_families_and_the_kv_left_after_rejected_drafts(family, caplog):
    """40-token answers taking part of a prediction (on sliding windows of 16 tokens, drafts
    that cross the window); the next turn, a prompt of token ids that holds the first answer's
    ids, goes on from its cached sequence, so that sequence's KV must be exactly the accepted
    tokens': it equals the uncached next turn. Recurrent state: speculation is off (logged),
    the prediction ignored, the answers the same."""
    lm = family
    caplog.set_level(logging.INFO, logger="mlx_kvserver.engine")
    s, seen = make_scheduler(lm), []
    watch(s, seen)
    recurrent = lm.cache_spec.has_state
    assert s.speculation.on is not recurrent
    assert ("decodes without speculation" in caplog.text) is recurrent
    first = ask([{"role": "user", "content": "Tell me about the sea."}], 40)
    want, ids = reference(lm, first)
    job1 = Collect(first, lm)
    req, = serve(s, [job1], [bent(ids)])
    assert job1.answers()[0][0] == want and req.choices[0].tokens == ids
    more = lm.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd the mountains?<|im_end|>\n"
                               "<|im_start|>assistant\n")
    second = {"prompt": req.prompt + ids + more, "max_tokens": 40, "temperature": 0}
    want2, ids2 = reference(lm, second, raw=True)
    job2 = Raw(second, lm)
    serve(s, [job2], [bent(ids2)])
    assert job2.answers()[0][0] == want2
    cached = next(e for e in job2.log if isinstance(e, Accepted)).cached_tokens
    for u in (usage(job1), usage(job2)):
        if recurrent:
            assert (u.draft_accepted, u.draft_rejected) == (0, 0)
            assert u.decode_steps in (u.completion_tokens - 1, u.completion_tokens)  # (an end)
        else:
            assert u.draft_accepted >= u.completion_tokens // 2 and u.draft_rejected > 0
    if not recurrent:
        assert cached >= len(req.prompt) + len(ids) - 1  # the first answer, from the cache
        assert any(n > 16 and d for step in seen for _, d, _, n, _ in step)  # past the window
