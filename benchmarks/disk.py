"""Disk bytes of the KV store after each turn of a 20-turn conversation, against the final
turn's KV bytes (content-addressed pages are stored once; one full file per turn would sum every
turn's KV).

Usage: .venv/bin/python -m benchmarks.disk [--turns 20] [--max-tokens 24] [--json FILE]
The result goes to benchmarks/results/disk/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import Server, ask, document, free_port


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--doc-sentences", type=int, default=40)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-disk-"))
    server = Server(work / "kv", free_port(), [])
    rows = []
    try:
        model = httpx.get(server.url + "/models").json()["data"][0]["id"]
        messages = [{"role": "system", "content": document(args.doc_sentences),
                     "message_id": "sys"}]
        per_turn_sum = 0
        for t in range(args.turns):
            messages.append({"role": "user", "content": f"Question {t + 1}: tell me one more "
                             f"fact about note {3 * t + 1}.", "message_id": f"u{t}"})
            res = ask(server.url, messages, True, args.max_tokens)
            messages.append({"role": "assistant", "content": res["text"],
                             "message_id": res["message_id"]})
            stats = httpx.get(server.url + "/kv_cache/stats").json()["models"][model]
            page_bytes = stats["ram"]["bytes"] / max(stats["ram"]["pages"], 1)
            token_bytes = page_bytes / stats["ram"]["page_size"]
            turn_kv = (res["prompt_tokens"] + args.max_tokens) * token_bytes
            per_turn_sum += turn_kv
            rows.append({"turn": t + 1, "tokens": res["prompt_tokens"],
                         "disk_bytes": stats["disk"]["bytes_on_disk"],
                         "turn_kv_bytes": int(turn_kv), "one_file_per_turn_bytes": int(per_turn_sum),
                         "cached_tokens": res["cached_tokens"]})
    finally:
        server.stop()
    final_kv = rows[-1]["turn_kv_bytes"]
    for r in rows:
        r["disk_over_final_kv"] = round(r["disk_bytes"] / final_kv, 3)
    summary = {"final_turn_kv_mb": round(final_kv / 2**20, 1),
               "disk_mb": round(rows[-1]["disk_bytes"] / 2**20, 1),
               "disk_over_final_kv": rows[-1]["disk_over_final_kv"],
               "one_file_per_turn_over_final_kv": round(rows[-1]["one_file_per_turn_bytes"]
                                                        / final_kv, 2)}
    print(json.dumps({"summary": summary, "turns": rows}, indent=1))
    write("disk", json.dumps({"summary": summary, "turns": rows}, indent=1), override=args.json)


if __name__ == "__main__":
    main()
