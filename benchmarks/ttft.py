"""Client-side time to first token on a ~2,400-token, 4-turn conversation with the default model.

Starts the real server as a subprocess on loopback and, in one run:
  cold     every turn with use_kv_cache=false (the whole history recomputed);
  warm     the same conversation with the cache (turns 2-4 reuse the history);
  restart  a second conversation (same content, its own message ids) runs turns 1-3; the server
           is stopped and started again on the same cache directory, and turn 4 is sent: a new
           message whose history comes from disk.
TTFT is measured from sending the request to the first streamed content byte.
The result goes to benchmarks/results/ttft/<run's UTC time>.json unless ``--json`` names a file.
Usage: .venv/bin/python -m benchmarks.ttft [--json FILE] [--max-tokens 32] [-- server flags]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.record import OVERRIDE_HELP, write

ROOT = Path(__file__).resolve().parent.parent

TOPICS = ["the river", "the old mill", "the harbour", "the northern forest", "the glass works",
          "the weather station", "the library", "the railway", "the salt marsh", "the observatory"]
FACTS = ["was founded in {y} by a group of {n} families", "employs {n} people in the summer",
         "is {n} kilometres from the town square", "was rebuilt in {y} after a fire",
         "records about {n} visitors a year", "has a stone bridge built in {y}",
         "keeps {n} ledgers from before {y}", "opens at {h} o'clock on weekdays"]


def document(n_sentences: int = 112) -> str:
    """A deterministic town guide of about 2,000 tokens (no external data)."""
    out = []
    for i in range(n_sentences):
        topic, fact = TOPICS[i % len(TOPICS)], FACTS[(i * 3) % len(FACTS)]
        out.append(f"Note {i + 1}: {topic.capitalize()} " + fact.format(
            y=1700 + (i * 37) % 300, n=3 + (i * 11) % 90, h=6 + i % 5) + ".")
    return " ".join(out)


QUESTIONS = ["When was the old mill rebuilt? Answer briefly.",
             "How far is the harbour from the town square?",
             "Which place records the most visitors?",
             "Summarise the guide in one sentence."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, log_name: str, what: str,
                  timeout: float = 300, ready=lambda: True) -> None:
    """Poll ``url`` every 0.5 s until it answers 200 and ``ready()`` holds (asked after each
    200); RuntimeError when ``proc`` exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200 and ready():
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start; see {log_name}")
        time.sleep(0.5)


class Server:
    def __init__(self, cache_dir: Path, port: int, extra: list[str], cwd: Path = ROOT):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log = open(cache_dir.parent / f"server-{port}-{time.time_ns()}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_kvserver", "--port", str(port),
             "--kv-cache-dir", str(cache_dir), *extra],
            cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_up(self.proc, self.url.removesuffix("/v1") + "/health", self.log.name, "server")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def ask(url: str, messages: list[dict], use_cache: bool | None, max_tokens: int,
        timeout: float = 600, model: str | None = None) -> dict:
    """One streamed greedy request; ``use_cache`` None leaves ``use_kv_cache`` out (a peer
    server); ``model`` names the model where the server needs it named."""
    body = {"messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if use_cache is not None:
        body["use_kv_cache"] = use_cache
    t0 = time.perf_counter()
    ttft, text, mid, usage = None, [], None, None
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                mid = chunk.get("message_id", mid)
                piece = c["delta"].get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "total": time.perf_counter() - t0, "text": "".join(text), "message_id": mid,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def conversation(url: str, tag: str, use_cache: bool, max_tokens: int, doc: str,
                 questions: list[str] = QUESTIONS):
    messages = [{"role": "system", "content": "You answer questions about this town guide.\n\n"
                 + doc, "message_id": f"{tag}-sys"}]
    turns = []
    for i, q in enumerate(questions):
        messages.append({"role": "user", "content": q, "message_id": f"{tag}-u{i}"})
        res = ask(url, messages, use_cache, max_tokens)
        turns.append(res)
        messages.append({"role": "assistant", "content": res["text"],
                         "message_id": res["message_id"]})
    return turns, messages


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("--no-restart", action="store_true", help="skip the restart phase")
    ap.add_argument("server_args", nargs="*", help="extra server flags (after --)")
    args = ap.parse_args()
    doc = document()
    work = Path(tempfile.mkdtemp(prefix="bench-ttft-"))
    cache_dir = work / "kv"
    port = free_port()
    server = Server(cache_dir, port, args.server_args)
    try:
        cold, _ = conversation(server.url, "cold", False, args.max_tokens, doc)
        warm, _ = conversation(server.url, "warm", True, args.max_tokens, doc)
        if not args.no_restart:
            _, before = conversation(server.url, "r", True, args.max_tokens, doc, QUESTIONS[:3])
    finally:
        server.stop()
    result = {"cold": cold, "warm": warm}
    if not args.no_restart:
        server = Server(cache_dir, port, args.server_args)
        try:
            # Turn 4, a new message, on a fresh process: the history comes from disk.
            before.append({"role": "user", "content": QUESTIONS[3], "message_id": "r-u3"})
            result["restart_turn4"] = ask(server.url, before, True, args.max_tokens)
        finally:
            server.stop()
    rows = []
    for i, (c, w) in enumerate(zip(cold, warm)):
        rows.append({"turn": i + 1, "prompt_tokens": w["prompt_tokens"],
                     "cached_tokens": w["cached_tokens"], "cold_ttft_s": round(c["ttft"], 3),
                     "warm_ttft_s": round(w["ttft"], 3),
                     "speedup": round(c["ttft"] / w["ttft"], 1),
                     "same_answer": c["text"] == w["text"]})
    summary = {"turns": rows,
               "median_speedup_turns_2_4": statistics.median(r["speedup"] for r in rows[1:])}
    if "restart_turn4" in result:
        r4 = result["restart_turn4"]
        summary["restart_turn4"] = {
            "ttft_s": round(r4["ttft"], 3), "cached_tokens": r4["cached_tokens"],
            "vs_warm_turn4": round(r4["ttft"] / warm[3]["ttft"], 2),
            "same_answer": r4["text"] == warm[3]["text"]}
    print(json.dumps(summary, indent=1))
    write("ttft", json.dumps({"summary": summary, "raw": result}, indent=1), override=args.json)


if __name__ == "__main__":
    main()
