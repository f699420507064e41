"""benchmarks/router.py: the workload's texts and the figures made of a run's requests."""

from __future__ import annotations

from benchmarks import router


def test_the_workload_is_deterministic_sized_by_the_count_and_varied():
    def count(text: str) -> int:  # a stand-in tokenizer: four characters a token
        return len(text) // 4

    sizes = router.Sizes(system=300, case=400, turn=60)
    a = router.build_workload(3, sizes, count)
    assert a == router.build_workload(3, sizes, count)
    assert abs(count(a.system) - 300) < 30 and abs(count(a.cases[0]) - 400) < 40
    assert len({a.user_turn(c, t) for c in range(3) for t in range(1, 5)}) == 12
    assert all(a.user_turn(c, 1) == a.cases[c] for c in range(3))


def rec(conv, turn, server, prompt=100, cached=90, ttft=1.0, ok=True):
    return {"conv": conv, "turn": turn, "server": server, "ok": ok, "ttft": ttft,
            "prompt_tokens": prompt, "cached_tokens": cached}


def test_summary_counts_cached_tokens_moves_and_failures():
    records = [rec(0, 1, 0, cached=10, ttft=5.0), rec(1, 1, 1, cached=10, ttft=7.0),
               rec(0, 2, 0, ttft=1.0), rec(1, 2, 2, ttft=3.0),
               rec(0, 3, 0, ttft=2.0), rec(1, 3, None, ok=False, prompt=0, cached=0)]
    s = router.summarize(records, {"after_turn": 2})
    assert s["failed"] == 1 and s["requests"] == 6
    assert s["cached_share_turns_1_4"] == round(290 / 500, 4)
    assert s["cached_share_turns_2_4"] == 0.9
    assert s["median_ttft_turn_1_s"] == 6.0 and s["median_ttft_turns_2_4_s"] == 2.0
    assert (s["turns_2_4_moved"], s["turns_2_4_server_known"]) == (1, 3)
    assert s["answers_per_server_by_turn"]["3"] == {"0": 1, "None": 1}
    assert s["median_ttft_after_kill_s"] == 2.0


def test_overall_compares_the_aware_run_with_round_robin_without_the_store():
    def summary(ttft, share=0.95, failed=0):
        return {"summary": {"median_ttft_turns_2_4_s": ttft, "cached_share_turns_2_4": share,
                            "cached_share_turns_1_4": share, "failed": failed,
                            "median_ttft_after_kill_s": ttft}}

    o = router.overall({"aware+store": summary(1.0), "round_robin": summary(4.0, 0.3),
                        "aware+store+kill": summary(1.5, failed=2)})
    assert o["ttft_turns_2_4_aware_store_over_round_robin"] == 0.25
    assert o["goals"] == {"cached_share_turns_2_4_at_least_0.9": True,
                          "ttft_ratio_at_most_0.5": True, "kill_no_failed_request": False}
