"""benchmarks/speculation.py: its workloads in the shape mlx-lm's server reads (the peer
rows), the same conversation as ours otherwise."""

from __future__ import annotations

import json

from benchmarks.speculation import WORKLOADS, as_openai, numbered, source, summarize


def test_the_edit_workload_as_openai_tools_a_call_and_its_result():
    route, body = as_openai(*WORKLOADS["edit"](2, 64))
    assert route == "/v1/chat/completions"
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    call = body["messages"][2]["tool_calls"][0]
    assert call["function"]["name"] == "Read"
    assert json.loads(call["function"]["arguments"])["file_path"].endswith(source(2)[0])
    assert body["messages"][3]["tool_call_id"] == call["id"]
    assert body["messages"][3]["content"] == numbered(source(2)[1])  # the file, as read
    assert [t["function"]["name"] for t in body["tools"]] == ["Read", "Edit"]
    assert body["tools"][1]["function"]["parameters"]["required"] == [
        "file_path", "old_string", "new_string"]
    assert body["tool_choice"]["function"]["name"] == "Edit" and body["max_tokens"] == 64


def test_rewrite_loses_its_assistant_prefill_and_the_others_stay():
    route, body = WORKLOADS["rewrite"](0, 32)
    r2, b2 = as_openai(route, body)
    assert body["messages"][-1]["role"] == "assistant"
    assert r2 == route and b2["messages"] == body["messages"][:-1]
    for w in ("free", "json"):
        assert as_openai(*WORKLOADS[w](1, 32)) == WORKLOADS[w](1, 32)


def _fake_servers(tmp_path, monkeypatch, log: str = "DEBUG plain step: 8 sequences, 300 ms\n"
                  ) -> tuple[list, list]:
    """``benchmarks.speculation``'s servers (each writing ``log``) and client replaced: (each
    server's flags, each run's extra body fields)."""
    from types import SimpleNamespace

    import benchmarks.speculation as bench

    started, extras = [], []

    class FakeServer:
        def __init__(self, cache_dir, port, extra):
            started.append(extra)
            self.url = "http://127.0.0.1:1/v1"
            self.log = open(tmp_path / f"server-{len(started)}.log", "w")
            self.log.write(log)
            self.log.flush()

        def stop(self):
            self.log.close()

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "free_port", lambda: 1)
    monkeypatch.setattr(bench.httpx, "get", lambda url: SimpleNamespace(
        json=lambda: {"data": [{"id": "m"}]}))
    monkeypatch.setattr(bench, "run", lambda *a: extras.append(a[-1]) or {
        "decode_tok_s_median": 1.0, "aggregate_tok_s": 1.0, "tokens_per_step": 1.0,
        "accepted": 0, "drafted": 0, "clients": a[3], "texts": ["x"]})
    return started, extras


def test_debug_log_runs_the_servers_at_debug_and_keeps_each_rows_log(tmp_path, monkeypatch):
    """``--debug-log DIR``: each row's server gets ``--log-level debug`` and its log is copied
    to DIR under the row's name; without it, neither. ``--num-draft-tokens N`` goes to the
    servers; without it they keep their default."""
    from types import SimpleNamespace

    import benchmarks.speculation as bench

    started, _ = _fake_servers(tmp_path, monkeypatch)
    logs = tmp_path / "logs"
    args = SimpleNamespace(model="default", max_tokens=8, debug_log=logs, num_draft_tokens=None,
                           off_by_request=False)
    bench._row(tmp_path, args, 0, "edit", 8, "ngram")
    assert started[-1][-2:] == ["--log-level", "debug"]
    assert "--num-draft-tokens" not in started[-1]
    assert (logs / "ngram-0-edit-x8.log").read_text() == "DEBUG plain step: 8 sequences, 300 ms\n"
    bench._row(tmp_path, SimpleNamespace(model="default", max_tokens=8, debug_log=None,
                                         num_draft_tokens=15, off_by_request=False),
               0, "free", 1, "off")
    assert "--log-level" not in started[-1]
    i = started[-1].index("--num-draft-tokens")
    assert started[-1][i + 1] == "15"
    assert sorted(p.name for p in logs.iterdir()) == ["ngram-0-edit-x8.log"]


def test_summary_gives_each_rounds_own_ratio_beside_the_medians():
    """The machine slowed between rounds: each round's on/off pair is compared within it."""
    def run(mode, rnd, rate):
        return {"workload": "free", "clients": 1, "mode": mode, "round": rnd,
                "decode_tok_s_median": rate, "texts": ["x"], "accepted": 0, "drafted": 1,
                "tokens_per_step": 1.0}
    runs = [run("off", 0, 10.0), run("ngram", 0, 9.5), run("ngram", 1, 8.0), run("off", 1, 7.0)]
    (row,) = summarize(runs)
    assert row["speedup"] == round(8.75 / 8.5, 3)
    assert row["speedup_by_round"] == [0.95, round(8 / 7, 3)]


def test_off_by_request_runs_the_off_row_on_a_speculating_server_with_drafts_refused(
        tmp_path, monkeypatch):
    """``--off-by-request``: the off row's server is started with ``--speculate ngram`` like the
    on row's, and its requests carry ``"speculate": false``; without it, ``--speculate off``."""
    from types import SimpleNamespace

    import benchmarks.speculation as bench

    started, extras = _fake_servers(tmp_path, monkeypatch)

    def row(mode: str, by_request: bool) -> tuple[str, dict]:
        args = SimpleNamespace(model="default", max_tokens=8, debug_log=None,
                               num_draft_tokens=None, off_by_request=by_request)
        bench._row(tmp_path, args, 0, "free", 1, mode)
        return started[-1][started[-1].index("--speculate") + 1], extras[-1]

    assert row("off", True) == ("ngram", {"speculate": False})
    assert row("ngram", True) == ("ngram", {})
    assert row("off", False) == ("off", {})


def test_a_one_client_rows_speedup_in_its_run_reaches_the_summary(tmp_path, monkeypatch):
    """With ``--debug-log``, a speculating row's own steps give its in-run speedup
    (``benchmarks.steps.in_run``), and the summary lists it; a plain row has none."""
    from types import SimpleNamespace

    import benchmarks.speculation as bench

    _fake_servers(tmp_path, monkeypatch, log="DEBUG plain step: 1 sequences, 100 ms\n"
                  "DEBUG verify pass: 1 sequences, drafts [2], 130 ms, 3 tokens\n")
    args = SimpleNamespace(model="default", max_tokens=8, debug_log=tmp_path / "logs",
                           num_draft_tokens=None, off_by_request=False)
    on = bench._row(tmp_path, args, 0, "free", 1, "ngram")
    off = bench._row(tmp_path, args, 0, "free", 1, "off")
    assert on["in_run"]["speedup"] == round(4 * 100 / 230, 4)
    assert "in_run" not in off
    (row,) = summarize([off, on])
    assert row["speedup_in_run"] == [round(4 * 100 / 230, 4)]
