"""Speculative decoding, on and off in the same run: decode tokens/s per workload, 1 and 8
clients, on the default model (greedy), against mlx-lm's server on the same model folder.

Workloads (each answer's prompt is read before the clock starts; decode speed is the answer's
tokens after its first over the time from its first to its last token):

- ``rewrite``: a real source file (CPython's ``asyncio/queues.py``, 244 lines, and for 8
  clients seven more files of the standard library of 150-300 lines) read into the conversation,
  then written back with one change; the answer begins with the file's first lines (an assistant
  prefill: the default model copies a file once its answer has begun with it);
- ``edit``: a Claude-Code-shaped ``Edit`` call (``file_path``, ``old_string``, ``new_string``)
  after a ``Read`` result that holds the file, through Anthropic's Messages API with the tool
  forced (``tool_choice``), so its ``old_string`` is copied from the file;
- ``free``: an answer that is not in the context (a story);
- ``json``: an answer under a JSON schema (``response_format``).

    .venv/bin/python -m benchmarks.speculation [--peer-mlx-lm] [--off-by-request]
        [--debug-log DIR] [--json FILE]   (--help says each; the debug log holds every step's
        drafts, rows and ms, and a one-client row's speedup in its run: benchmarks/steps.py)

The result goes to benchmarks/results/speculation/<run's UTC time>.json (saved after every row)
and its plot beside it (.png), unless --json names another file (the plot then beside that one).

Each server runs as its own process with the same BLAS. Every row (a workload at 1 or 8
clients) runs on fresh servers, so no answer of an earlier row is there to draft from; ours with
``--speculate off`` and ``--speculate ngram`` taking turns row by row (off first in even rounds,
on first in odd ones), so a drift in the machine's speed falls on both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.record import OVERRIDE_HELP, run_file
from benchmarks.steps import in_run
from benchmarks.ttft import Server, free_port

LIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["asyncio/queues.py", "asyncio/runners.py", "asyncio/taskgroups.py", "http/__init__.py",
         "email/policy.py", "concurrent/futures/thread.py", "urllib/robotparser.py",
         "asyncio/protocols.py"]
EDIT = {"name": "Edit", "description": "Performs exact string replacements in files.",
        "input_schema": {"type": "object", "properties": {
            "file_path": {"type": "string", "description": "The absolute path to the file"},
            "old_string": {"type": "string", "description": "The text to replace"},
            "new_string": {"type": "string", "description": "The text to replace it with"}},
            "required": ["file_path", "old_string", "new_string"]}}
READ = {"name": "Read", "description": "Reads a file from the local filesystem.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                         "required": ["file_path"]}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "languages": {"type": "array", "items": {"type": "string"}},
    "employer": {"type": "object", "properties": {"name": {"type": "string"},
                                                  "since": {"type": "integer"}},
                 "required": ["name", "since"], "additionalProperties": False}},
    "required": ["name", "age", "city", "languages", "employer"], "additionalProperties": False}


def source(i: int) -> tuple[str, str]:
    name = FILES[i % len(FILES)]
    return name, (LIB / name).read_text()


def numbered(text: str) -> str:
    """A file as Claude Code's Read tool returns it (line numbers, a tab)."""
    return "\n".join(f"{n:6d}\t{line}" for n, line in enumerate(text.splitlines(), 1))


def rewrite_request(i: int, max_tokens: int) -> tuple[str, dict]:
    name, text = source(i)
    head = "\n".join(text.splitlines()[:3])
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Here is {name}:\n```python\n{text}\n```\n"
                      "Write the whole file again, with `_loop` renamed to `_event_loop`."},
                     {"role": "assistant", "content": f"```python\n{head}\n"}],
        "max_tokens": max_tokens, "temperature": 0}


def edit_request(i: int, max_tokens: int) -> tuple[str, dict]:
    name, text = source(i)
    path = f"/work/project/{name}"
    return "/v1/messages", {
        "system": "You are a coding agent. Use the tools to change files.",
        "tools": [READ, EDIT], "tool_choice": {"type": "tool", "name": "Edit"},
        "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": f"In {path}, add a comment above the first class."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}",
                                               "name": "Read", "input": {"file_path": path}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                          "content": numbered(text)}]}]}


def free_request(i: int, max_tokens: int) -> tuple[str, dict]:
    topics = ["a lighthouse keeper", "a clockmaker", "a desert caravan", "a winter garden",
              "a lost violin", "a night train", "a mountain school", "a river ferry"]
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Write a short story about {topics[i % 8]}."}],
        "max_tokens": max_tokens, "temperature": 0}


def json_request(i: int, max_tokens: int) -> tuple[str, dict]:
    people = ["a retired sailor", "a young chemist", "a chef in Lyon", "a pilot",
              "a carpenter", "a violinist", "a nurse in Oslo", "a farmer"]
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Describe {people[i % 8]} as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}},
        "max_tokens": max_tokens, "temperature": 0}


WORKLOADS = {"rewrite": rewrite_request, "edit": edit_request, "free": free_request,
             "json": json_request}


def stream(base: str, route: str, body: dict, model: str, extra: dict) -> dict:
    """One streamed answer: its first and last token times and its usage."""
    body = {**body, "model": model, "stream": True, **extra}
    if route.endswith("completions"):
        body["stream_options"] = {"include_usage": True}
    t_first = t_last = None
    usage: dict = {}
    text = []
    with httpx.stream("POST", base + route, json=body, timeout=1800,
                      headers={"x-api-key": "x", "anthropic-version": "2023-06-01"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            piece = _piece(ev)
            if piece:
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                text.append(piece)
            usage = ev.get("usage") or (ev.get("message") or {}).get("usage") or usage
    return {"first": t_first, "last": t_last, "usage": usage, "text": "".join(text)}


def _piece(ev: dict) -> str:
    if "choices" in ev:
        d = ev["choices"][0]["delta"] if ev["choices"] else {}
        calls = d.get("tool_calls") or []
        return (d.get("content") or "") + "".join(
            (c.get("function") or {}).get("arguments") or "" for c in calls)
    d = ev.get("delta") or {}
    return d.get("text") or d.get("partial_json") or ""


def as_openai(route: str, body: dict) -> tuple[str, dict]:
    """A request in the shape mlx-lm's server reads (OpenAI's chat completions only, no
    assistant prefill): the Anthropic ``edit`` request as OpenAI tools, a tool call and its
    result; ``rewrite`` without its assistant prefill (mlx-lm closes the assistant turn and
    answers anew). The same conversation otherwise; mlx-lm's answers differ (it ignores
    ``tool_choice`` and ``response_format``): its row is its decode speed on these prompts."""
    if route == "/v1/messages":
        msgs = [{"role": "system", "content": body["system"]}]
        for m in body["messages"]:
            if isinstance(m["content"], str):
                msgs.append(m)
            elif m["role"] == "assistant":
                msgs.append({"role": "assistant", "content": "", "tool_calls": [
                    {"id": b["id"], "type": "function", "function": {
                        "name": b["name"], "arguments": json.dumps(b["input"])}}
                    for b in m["content"]]})
            else:
                msgs += [{"role": "tool", "tool_call_id": b["tool_use_id"],
                          "content": b["content"]} for b in m["content"]]
        tools = [{"type": "function", "function": {
            "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
            for t in body["tools"]]
        return "/v1/chat/completions", {
            "messages": msgs, "tools": tools, "max_tokens": body["max_tokens"], "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": body["tool_choice"]["name"]}}}
    msgs = body["messages"]
    if msgs[-1]["role"] == "assistant":
        body = {**body, "messages": msgs[:-1]}
    return route, body


def run(base: str, model: str, workload: str, clients: int, max_tokens: int,
        extra: dict, peer: bool = False) -> dict:
    reqs = [WORKLOADS[workload](i, max_tokens) for i in range(clients)]
    if peer:
        reqs = [as_openai(*rb) for rb in reqs]
    for route, body in reqs:  # read every prompt first: the clock measures decoding only
        stream(base, route, {**body, "max_tokens": 1}, model, extra)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outs = list(pool.map(lambda rb: stream(base, rb[0], rb[1], model, extra), reqs))
    wall = time.perf_counter() - t0
    toks = [_completion(o["usage"]) for o in outs]
    timed = [(n, o) for n, o in zip(toks, outs) if o["first"] is not None]  # streamed a piece
    rates = [(n - 1) / (o["last"] - o["first"]) for n, o in timed
             if n > 1 and o["last"] > o["first"]]
    span = (max(o["last"] for _, o in timed) - min(o["first"] for _, o in timed)) if timed else 0
    steps = [o["usage"].get("decode_steps") for o in outs]
    acc = sum(_details(o["usage"]).get("accepted_draft_tokens", 0) for o in outs)
    rej = sum(_details(o["usage"]).get("rejected_draft_tokens", 0) for o in outs)
    return {"clients": clients, "tokens": toks, "texts": [o["text"] for o in outs],
            "decode_tok_s_median": statistics.median(rates) if rates else None,
            "aggregate_tok_s": (sum(toks) - len(toks)) / span if span > 0 else None,
            "wall_s": wall, "decode_steps": steps,
            "tokens_per_step": (sum(toks) - len(toks)) / sum(steps) if all(steps) else None,
            "drafted": acc + rej, "accepted": acc}


def _completion(u: dict) -> int:
    return int(u.get("completion_tokens", u.get("output_tokens", 0)))


def _details(u: dict) -> dict:
    return u.get("completion_tokens_details") or u.get("output_tokens_details") or {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2, help="on/off alternations")
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-draft-tokens", type=int,
                    help="the servers' --num-draft-tokens (default: theirs)")
    ap.add_argument("--warmup", action="store_true", help="each workload once first, unrecorded "
                    "(on a GPU, MLX compiles kernels at first use: else in the first rows' clocks)")
    ap.add_argument("--off-by-request", action="store_true", help="the off rows' servers speculate"
                    " too, their requests with \"speculate\": false (one code path, drafts apart)")
    ap.add_argument("--peer-mlx-lm", action="store_true",
                    help="also mlx-lm's server on the same model as an MLX folder (each workload "
                         "as chat completions: no Messages API, assistant prefill or grammars)")
    ap.add_argument("--debug-log", type=Path, metavar="DIR",
                    help="run our servers with --log-level debug (each step's drafts, rows and "
                         "ms) and keep each row's server log in DIR")
    args = ap.parse_args()
    out = run_file("speculation", ".json", args.json)
    results: dict = {"argv": sys.argv[1:], "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.warmup:
            results["warmup_s"] = warmup(Path(tmp), args)
        for rnd in range(args.rounds):
            for w in args.workloads:
                for n in args.clients:
                    # fresh servers for each row (no answer of an earlier row to draft from), one
                    # after the other (off first in even rounds, on first in odd ones)
                    for mode in (("off", "ngram") if rnd % 2 == 0 else ("ngram", "off")):
                        results["runs"].append(_row(Path(tmp), args, rnd, w, n, mode))
                        out.write_text(json.dumps(results, indent=1))
        if args.peer_mlx_lm:
            results["runs"] += peer_runs(Path(tmp), args, out, results)
    summary = summarize(results["runs"])
    results["summary"] = summary
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    plot(summary, run_file("speculation", ".png", args.json and args.json.with_suffix(".png")))
    for row in summary:
        print(row)


def _row(tmp: Path, args, rnd: int, w: str, n: int, mode: str) -> dict:
    """One workload at ``n`` clients on a fresh server with ``--speculate mode``."""
    debug = ["--log-level", "debug"] if args.debug_log else []
    drafts = ["--num-draft-tokens", str(args.num_draft_tokens)] if args.num_draft_tokens else []
    by_request = args.off_by_request and mode == "off"
    srv = Server(tmp / f"kv-{mode}-{rnd}-{w}-{n}", free_port(),
                 ["--model", args.model, "--speculate", "ngram" if by_request else mode,
                  "--no-disk-cache", "--max-batch", "16", *drafts, *debug])
    try:
        name = httpx.get(srv.url + "/models").json()["data"][0]["id"]
        r = run(srv.url.removesuffix("/v1"), name, w, n, args.max_tokens,
                {"speculate": False} if by_request else {})
    finally:
        srv.stop()
        if args.debug_log:
            args.debug_log.mkdir(parents=True, exist_ok=True)
            shutil.copy(srv.log.name, args.debug_log / f"{mode}-{rnd}-{w}-x{n}.log")
    r.update(mode=mode, round=rnd, workload=w)
    if args.debug_log and mode == "ngram":  # its own plain steps against its passes
        r["in_run"] = in_run(Path(srv.log.name).read_text())
    print(f"{mode:5s} {w:8s} x{n}: {r['decode_tok_s_median']:.2f} tok/s median, "
          f"{r['aggregate_tok_s']:.2f} in all, {r['tokens_per_step']} tok/step, "
          f"{r['accepted']}/{r['drafted']} drafts taken", flush=True)
    return r


def warmup(tmp: Path, args) -> float:
    """Every workload at every client count, 32 tokens, on one speculating server; unrecorded."""
    t0 = time.perf_counter()
    srv = Server(tmp / "kv-warmup", free_port(), ["--model", args.model, "--speculate", "ngram",
                                                  "--no-disk-cache", "--max-batch", "16"])
    try:
        name = httpx.get(srv.url + "/models").json()["data"][0]["id"]
        for w in args.workloads:
            for n in args.clients:
                run(srv.url.removesuffix("/v1"), name, w, n, 32, {})
    finally:
        srv.stop()
    print(f"warm-up: {time.perf_counter() - t0:.1f} s", flush=True)
    return round(time.perf_counter() - t0, 1)


def plot(summary: list[dict], path: Path) -> None:
    """Decode tokens/s per workload and clients: speculation off, on, and mlx-lm's server."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, n in zip(axes, (1, 8)):
        rows = [r for r in summary if r["clients"] == n]
        xs = range(len(rows))
        for k, (key, label) in enumerate((("off", "speculation off"), ("on", "speculation on"),
                                          ("mlx_lm", "mlx-lm server"))):
            vals = [r.get(key) or 0 for r in rows]
            ax.bar([x + (k - 1) * 0.27 for x in xs], vals, 0.27, label=label)
        for x, r in zip(xs, rows):
            ax.text(x, max(r["on"], r["off"]) * 1.02, f"{r['speedup']:.2f}x", ha="center",
                    fontsize=8)
        ax.set_xticks(list(xs), [r["workload"] for r in rows])
        ax.set_title(f"{n} client{'s' if n > 1 else ''}: decode tok/s"
                     + (" (in all)" if n > 1 else " (median)"))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def peer_runs(tmp: Path, args, out: Path, results: dict) -> list[dict]:
    """mlx-lm's server (no prompt lookup; its draft models turn batching off) on the default
    model's MLX folder, every workload in the shape it reads (``as_openai``), plain decoding."""
    from mlx_kvserver.models.convert import save_mlx_folder
    from mlx_kvserver.models.loading import resolve_and_load
    from benchmarks.multiturn import MlxLmServer

    folder = save_mlx_folder(resolve_and_load(args.model), tmp / "model-mlx")
    runs = []
    peer = MlxLmServer(folder, free_port(), tmp)
    try:
        for w in args.workloads:
            for n in args.clients:
                r = run(peer.url.removesuffix("/v1"), str(folder), w, n, args.max_tokens, {},
                        peer=True)
                r.update(mode="mlx-lm", round=0, workload=w)
                runs.append(r)
                print(f"mlx-lm {w:8s} x{n}: {r['decode_tok_s_median']} tok/s median, "
                      f"{r['aggregate_tok_s']} in all, tokens {r['tokens']}", flush=True)
                results["runs"].append(r)
                out.write_text(json.dumps(results, indent=1))
    finally:
        peer.stop()
    results["runs"] = results["runs"][:len(results["runs"]) - len(runs)]
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for w in dict.fromkeys(r["workload"] for r in runs):
        for n in dict.fromkeys(r["clients"] for r in runs):
            pick = {m: [r for r in runs if r["workload"] == w and r["clients"] == n
                        and r["mode"] == m] for m in ("off", "ngram")}
            if not all(pick.values()):
                continue
            key = "decode_tok_s_median" if n == 1 else "aggregate_tok_s"
            med = {m: statistics.median(r[key] for r in rs) for m, rs in pick.items()}
            same = all(a["texts"] == b["texts"] for a, b in zip(pick["off"], pick["ngram"]))
            on = pick["ngram"]
            # each round's on/off: both ran back to back in it (order alternating), so the
            # machine's drift between rounds, which the medians above carry, falls out
            by_round = [round(a[key] / b[key], 3) for b in pick["off"] for a in on
                        if a["round"] == b["round"] and a[key] and b[key]]
            peer = [r[key] for r in runs if r["workload"] == w and r["clients"] == n
                    and r["mode"] == "mlx-lm"]
            rows.append({"workload": w, "clients": n, "off": round(med["off"], 3),
                         "on": round(med["ngram"], 3),
                         "speedup": round(med["ngram"] / med["off"], 3),
                         "speedup_by_round": by_round,
                         "speedup_in_run": [r["in_run"]["speedup"] for r in on if r.get("in_run")],
                         "same_text": same,
                         "acceptance": round(sum(r["accepted"] for r in on)
                                             / max(1, sum(r["drafted"] for r in on)), 3),
                         "tokens_per_step": statistics.median(r["tokens_per_step"] for r in on),
                         "mlx_lm": round(statistics.median(peer), 3) if peer else None})
    return rows


if __name__ == "__main__":
    main()
