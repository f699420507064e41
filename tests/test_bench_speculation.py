"""scripts/bench_speculation.py: its workloads in the shape mlx-lm's server reads (the peer
rows), the same conversation as ours otherwise."""

from __future__ import annotations

import json

from scripts.bench_speculation import WORKLOADS, as_openai, numbered, source


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
