"""Decode tokens/s with a JSON schema (grammar-constrained decoding) against without, at 1 and 8
clients at once, on the default model through the real server.

Rounds alternate free and schema runs. Each client sends a short question and asks for
``--max-tokens`` tokens (the cache off, so every round reads its prompt); the schema run adds
``response_format: json_schema`` with a schema whose answer is long enough to fill them (a list
of records). Decode tokens/s per client = (completion tokens - 1) / (time after the first
token); reported as the median over clients and rounds, and the ratio without / with.
The result goes to benchmarks/results/structured/<run's UTC time>.json unless --json names a file.
Usage: .venv/bin/python -m benchmarks.structured [--json FILE] [--rounds 3] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import jsonschema

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import Server, free_port

SCHEMA = {  # bounded, so that answers can close within the token budget and be checked
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "facts": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"topic": {"type": "string", "maxLength": 24},
                           "year": {"type": "integer", "minimum": 0, "maximum": 2100},
                           "note": {"type": "string", "maxLength": 48}},
            "required": ["topic", "year", "note"]}},
    },
    "required": ["city", "facts"],
}
QUESTIONS = ["List facts about Paris as JSON.", "List facts about Rome as JSON.",
             "List facts about Lisbon as JSON.", "List facts about Oslo as JSON.",
             "List facts about Vienna as JSON.", "List facts about Prague as JSON.",
             "List facts about Dublin as JSON.", "List facts about Madrid as JSON."]


def one(url: str, i: int, schema: bool, max_tokens: int, out: list) -> None:
    body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, "use_kv_cache": False}
    if schema:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "facts", "schema": SCHEMA}}
    t0 = time.perf_counter()
    first, usage, text = None, None, []
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(c["delta"]["content"])
    end = time.perf_counter()
    n = usage["completion_tokens"]
    out.append({"tokens": n, "ttft": (first or end) - t0,
                "decode_tps": (n - 1) / (end - first) if first and n > 1 else None,
                "text": "".join(text)})


def round_(url: str, clients: int, schema: bool, max_tokens: int) -> list[dict]:
    out: list[dict] = []
    threads = [threading.Thread(target=one, args=(url, i, schema, max_tokens, out))
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    report: dict = {"max_tokens": args.max_tokens, "rounds": args.rounds, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp) / "kv", free_port(), [])
        try:
            round_(server.url, 1, True, 8)  # warm-up: loads the grammar library once
            for clients in [int(c) for c in args.clients.split(",")]:
                by_kind: dict[bool, list] = {False: [], True: []}
                for _ in range(args.rounds):  # alternated, so both see the same machine
                    for schema in (False, True):
                        by_kind[schema] += round_(server.url, clients, schema, args.max_tokens)
                for schema in (False, True):
                    runs = by_kind[schema]
                    tps = [r["decode_tps"] for r in runs if r["decode_tps"]]
                    valid = sum(1 for r in runs if schema and _parses(r["text"]))
                    key = f"{clients}-{'schema' if schema else 'free'}"
                    report["runs"][key] = {
                        "clients": clients, "schema": schema,
                        "decode_tps_median": statistics.median(tps),
                        "per_client_tokens": statistics.median(r["tokens"] for r in runs),
                        "json_valid": valid if schema else None, "answers": len(runs)}
                    print(key, json.dumps(report["runs"][key]), flush=True)
        finally:
            server.stop()
    for clients in [int(c) for c in args.clients.split(",")]:
        free = report["runs"][f"{clients}-free"]["decode_tps_median"]
        with_ = report["runs"][f"{clients}-schema"]["decode_tps_median"]
        report[f"slowdown_{clients}"] = free / with_
        print(f"{clients} client(s): {free:.1f} tok/s free, {with_:.1f} with the schema: "
              f"{free / with_:.2f}x slower")
    write("structured", json.dumps(report, indent=2), override=args.json)


def _parses(text: str) -> bool:
    """The answer is a whole instance of the schema."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False  # cut off at max_tokens before the object closed


if __name__ == "__main__":
    main()
