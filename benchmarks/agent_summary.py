"""What a benchmarks/agent.py result says about each server's cache, derived from its JSON alone.

For ours and the peer (if the run had one): the share of prompt tokens taken from the cache over
turns 2 to the last (the restart turn included); the turns that did not reuse all of the previous
turn's prompt, with how many of those tokens they read again and how many tokens they read in all;
and, over the turns after the first but the restart turn (as benchmarks/agent.py's own summary), the
median TTFT and ours / peer TTFT per turn (the median, and the median over the turns where the peer
reused all of its previous prompt).

Usage: .venv/bin/python -m benchmarks.agent_summary
       benchmarks/results/agent/<name>/<stamp>.json [more ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def side(rows: list[dict], restart: int | None) -> dict:
    later = [r for r in rows[1:] if r["turn"] != restart]
    short = {}
    for prev, r in zip(rows, rows[1:]):
        again = prev["prompt_tokens"] - r["cached_tokens"]
        if again > 0:
            short[r["turn"]] = {"reread_of_previous_prompt": again,
                                "read": r["prompt_tokens"] - r["cached_tokens"]}
    return {"from_cache": round(sum(r["cached_tokens"] for r in rows[1:])
                                / sum(r["prompt_tokens"] for r in rows[1:]), 4),
            "turns_not_reusing_all": short,
            "median_ttft_s": round(statistics.median(r["ttft_s"] for r in later), 3)}


def summary(path: Path) -> dict:
    d = json.loads(path.read_text())
    argv = d["command"].split()
    restart = int(argv[argv.index("--restart-at") + 1]) if "--restart-at" in argv else None
    out = {"file": str(path), "restart_turn": restart, "ours": side(d["turns"], restart)}
    if d.get("peer"):
        out["peer_name"] = d["peer_name"]
        out["peer"] = side(d["peer"], restart)
        pairs = [(a, b) for a, b in zip(d["turns"][1:], d["peer"][1:]) if a["turn"] != restart]
        full = [(a, b) for a, b in pairs if b["turn"] not in out["peer"]["turns_not_reusing_all"]]
        out["ours_over_peer_median"] = round(
            statistics.median(a["ttft_s"] / b["ttft_s"] for a, b in pairs), 3)
        out["ours_over_peer_median_where_peer_reused_all"] = round(
            statistics.median(a["ttft_s"] / b["ttft_s"] for a, b in full), 3)
        out["turns_where_peer_reused_all"] = [a["turn"] for a, _ in full]
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(summary(Path(arg)), indent=1))
