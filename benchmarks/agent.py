"""One coding-agent session against the server, measured per turn at the client.

The session comes from harness/agent_sessions.py (Claude Code's, OpenCode's or Codex's request
shapes; an initial prompt of --initial-tokens tokens of tools and system prompt, then each turn
the server's answer plus a scripted tool call and a 200-3,000-token tool result). No message ids
are sent: what the server reuses it finds by the prompt's content. Per turn it prints and saves:
prompt tokens, tokens from the cache, new tokens, TTFT at the client (request sent -> first
streamed text, reasoning or tool-call byte), the server's own time to first token (its
/metrics histogram, from the request reaching its handler; none when the answer is empty), and
from its log line the time from the prompt's start (checked, rendered, tokenized) to the end of
prefill, the part of it in the model's forward passes, and where the cached part came from
(resident, memory, disk, disk-prefix, ...). "own" is the client's TTFT less the forward passes:
everything that is not the model (HTTP, JSON, rendering, tokenizing, lookup, restore
bookkeeping, the queue, the client reading the stream). Optionally:

Each server start is followed by one tiny uncached request (no turn pays start-up costs).

  --restart-at N   the server is stopped after turn N-1 and started again on the same
                   --kv-cache-dir before turn N (the peer too): turn N's history comes from disk
  --floor          per turn, the TTFT of prefilling only that turn's new tokens (a
                   /v1/completions request of that many token ids, use_kv_cache false,
                   max_tokens 1; no attention over the history), run after the session
  --peer NAME      the same session (OpenAI chat only) against a peer server on the same model
                   folder, restarted the same way: mlx-lm (`python -m mlx_lm.server`), rapid-mlx
                   or vllm-mlx (each from its own venv: --peer-bin; benchmarks/peers.py).
                   SmolLM2's template cannot render tools, so by default (--peer-tools inline)
                   the peer gets the tools, calls and results written into the messages as this
                   server's fallback renders them: the same prompt text (compare the
                   prompt-token columns); --peer-tools native sends the body as is (the peer's
                   template then drops the tools and the calls)

--model default writes the default model (real weights, float32) to a folder with its context
raised to --context (a 20-turn session grows past its 8,192 tokens), and both servers serve that
folder; a folder path (e.g. from scripts/agent_model.py) is served as it is.

The result goes to benchmarks/results/agent/<API>-<first prompt, thousands of tokens>k[-<peer>]/
<run's UTC time>.json (e.g. agent/openai-24k-rapid-mlx/), its plot beside it (.png), unless
--json (--plot) names another file.

  .venv/bin/python -m benchmarks.agent --api anthropic --turns 20 --initial-tokens 7000 \\
      --restart-at 11 --floor
  .venv/bin/python -m benchmarks.agent --api openai --peer mlx-lm --restart-at 11 --floor
  .venv/bin/python -m benchmarks.agent --api openai --peer rapid-mlx \\
      --peer-bin /tmp/peers/rapid-venv/bin/rapid-mlx --restart-at 11 ...
  .venv/bin/python -m benchmarks.agent --model /tmp/agent-model --initial-tokens 24000 ...
Extra server flags go after `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from mlx_kvserver.platform import blas

blas.maybe_reexec()  # before anything runs MLX here (the default model's conversion)

import itertools

import httpx

from benchmarks.peers import PEERS, fetch_line, peer_body, peer_exe, persist_lines, start_peer
from benchmarks.record import OVERRIDE_HELP, run_file, write
from benchmarks.ttft import Server, free_port
from harness.agent_sessions import APIS, Result, Session, load_tokenizer, send

TTFT_SUM = "mlx_kvserver_time_to_first_token_seconds_sum"
PREFILL_LINE = re.compile(r"(\d+) prompt tokens, (\d+) from cache \(([^)]*)\), ([\d.]+)s since it "
                          r"arrived, ([\d.]+)s of it in forward passes")


def model_folder(spec: str, work: Path, context: int) -> Path:
    """A model folder both servers can load: ``spec`` itself, or the default model written out
    with its context raised."""
    if spec != "default":
        return Path(spec).expanduser().resolve()
    from mlx_kvserver.models.convert import save_mlx_folder
    from mlx_kvserver.models.loading import resolve_and_load
    from scripts.agent_model import raise_context

    out = work / "model"
    save_mlx_folder(resolve_and_load("default"), out)
    raise_context(out, context)
    return out


def server_ttft_sum(client: httpx.Client, base: str) -> float | None:
    """The sum of the server's time-to-first-token histogram (all models), or None."""
    try:
        text = client.get(base + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(TTFT_SUM))


def log_size(server) -> int:
    return os.path.getsize(server.log.name)


def prefill_line(server, offset: int) -> tuple[str | None, float | None, float | None]:
    """Where the server found the last prompt's cached part, its time from its start (checked,
    rendered, tokenized) to the end of prefill, and the part of it in the model's forward
    passes, from its log line after ``offset``."""
    with open(server.log.name, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        found = PREFILL_LINE.findall(f.read())
    return (found[-1][2], float(found[-1][3]), float(found[-1][4])) if found else (None,) * 3


def warm_up(server, ours: bool) -> None:
    """One tiny uncached request, so that no turn pays a fresh process's one-time costs."""
    body = {"prompt": "Hello there", "max_tokens": 1, "temperature": 0}
    if ours:
        body["use_kv_cache"] = False
    elif getattr(server, "model", None):  # vllm-mlx refuses a request without one
        body["model"] = server.model
    httpx.post(server.url + "/completions", json=body, timeout=600).raise_for_status()


def run_session(session: Session, start_server, args, *, ours: bool,
                label: str) -> tuple[list, object]:
    """Send every turn; restart before --restart-at. Returns the rows and the live server."""
    def start():
        server = start_server()
        warm_up(server, ours)
        return server

    server = start()
    rows: list[dict] = []
    with httpx.Client(timeout=args.timeout) as client:
        for turn in range(1, session.turns + 1):
            if turn == args.restart_at:
                server.stop()
                persisted = persist_lines(server)  # a peer's SAVED line
                server = start()
                persisted += persist_lines(server)  # and its LOADED line
            base = server.url.removesuffix("/v1")
            path, body, headers = session.request(turn)
            if not ours:
                body = peer_body(body, args.peer_tools == "inline", getattr(server, "model", None))
            before = server_ttft_sum(client, base) if ours else None
            offset = log_size(server)
            res: Result = send(client, base, path, body, headers)
            after = server_ttft_sum(client, base) if ours else None
            source, prefill, forward = prefill_line(server, offset) if ours else (None,) * 3
            if not ours:  # the peer's own lookup, where it logs one (its usage may have none)
                source, logged = fetch_line(server, offset)
                res.cached_tokens = res.cached_tokens or logged or 0
            if res.status != 200 or res.error:
                server.stop()
                raise SystemExit(f"{label} turn {turn}: HTTP {res.status}: {res.error}")
            session.record(turn, res.text, res.thinking)
            row = {"turn": turn, "prompt_tokens": res.prompt_tokens,
                   "cached_tokens": res.cached_tokens,
                   "new_tokens": res.prompt_tokens - res.cached_tokens,
                   "ttft_s": round(res.ttft if res.ttft is not None else res.total, 3),
                   "server_ttft_s": round(after - before, 3)
                   if before is not None and after is not None and after > before else None,
                   "server_prefill_s": prefill, "forward_s": forward, "cache_source": source,
                   "total_s": round(res.total, 3), "completion_tokens": res.completion_tokens,
                   "after_restart": turn == args.restart_at}
            if not ours and turn == args.restart_at:
                row["peer_persist"] = persisted
            if forward is not None:  # everything but the model: HTTP, JSON, rendering,
                # tokenizing, lookup, restore bookkeeping, the queue (and the client's reading)
                row["own_s"] = round(row["ttft_s"] - forward, 3)
                if row["server_ttft_s"] is not None:
                    row["server_own_s"] = round(row["server_ttft_s"] - forward, 3)
            rows.append(row)
            print(f"{label} turn {turn:>2}: prompt {row['prompt_tokens']:>6}, cached "
                  f"{row['cached_tokens']:>6} ({source}), TTFT {row['ttft_s']:>7.3f} s, "
                  f"server TTFT {row['server_ttft_s']} s, prefill {prefill} s", flush=True)
    return rows, server


def floors(server, session: Session, rows: list[dict], tokenizer, args) -> None:
    """Per turn: TTFT of a cache-less prefill of as many token ids as the turn's new tokens."""
    base = server.url.removesuffix("/v1")
    with httpx.Client(timeout=args.timeout) as client:
        for row in rows:
            n = row["new_tokens"]
            if n <= 0:
                row["floor_s"] = None
                continue
            ids = tokenizer.encode(session.appended_text(row["turn"]), add_special_tokens=False)
            ids = (ids * (n // max(len(ids), 1) + 1))[:n]
            res = send(client, base, "/v1/completions", {
                "prompt": ids, "max_tokens": 1, "use_kv_cache": False, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}})
            if res.status != 200:
                raise SystemExit(f"floor turn {row['turn']}: HTTP {res.status}: {res.error}")
            row["floor_s"] = round(res.ttft if res.ttft is not None else res.total, 3)
            print(f"floor turn {row['turn']:>2}: {n:>6} new tokens, {row['floor_s']:.3f} s",
                  flush=True)


def summarize(rows: list[dict], peer: list[dict] | None, restart_at: int | None) -> dict:
    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 3) if xs else None

    later = [r for r in rows[1:] if r["turn"] != restart_at]
    s = {"turn1_ttft_s": rows[0]["ttft_s"],
         "median_ttft_later_s": med(r["ttft_s"] for r in later),
         "median_server_ttft_later_s": med(r["server_ttft_s"] for r in later),
         "median_server_prefill_later_s": med(r["server_prefill_s"] for r in later),
         "median_own_later_s": med(r.get("own_s") for r in later),
         "median_server_own_later_s": med(r.get("server_own_s") for r in later),
         "max_own_later_s": max((r["own_s"] for r in later if r.get("own_s") is not None),
                                default=None),
         "cached_fraction_later": round(sum(r["cached_tokens"] for r in later) /
                                        max(1, sum(r["prompt_tokens"] for r in later)), 3),
         "min_cached_vs_previous_prompt": min(
             (round(b["cached_tokens"] / a["prompt_tokens"], 3)
              for a, b in itertools.pairwise(rows)), default=None)}
    if any("floor_s" in r for r in rows):
        s["median_ttft_over_floor_later"] = med(
            r["ttft_s"] / r["floor_s"] for r in later if r.get("floor_s"))
    if restart_at and restart_at <= len(rows):
        r = rows[restart_at - 1]
        s["restart_turn"] = {k: r.get(k) for k in (
            "turn", "prompt_tokens", "cached_tokens", "cache_source", "ttft_s", "server_ttft_s",
            "server_prefill_s", "floor_s")}
    if peer:
        pl = [r for r in peer[1:] if r["turn"] != restart_at]
        s["peer_median_ttft_later_s"] = med(r["ttft_s"] for r in pl)
        s["median_ours_over_peer_later"] = med(
            a["ttft_s"] / b["ttft_s"] for a, b in zip(rows[1:], peer[1:])
            if a["turn"] != restart_at)
        if restart_at and restart_at <= len(peer):
            p = peer[restart_at - 1]
            s["peer_restart_turn"] = {k: p.get(k) for k in (
                "prompt_tokens", "cached_tokens", "cache_source", "ttft_s", "peer_persist")}
            s["restart_ours_over_peer"] = round(rows[restart_at - 1]["ttft_s"] / p["ttft_s"], 3)
    return s


def table(rows: list[dict], peer: list[dict] | None) -> str:
    head = ("turn | prompt | cached | source | new | TTFT s | server TTFT s | prefill s | "
            "forward s | own s | floor s")
    if peer:
        head += " | peer prompt | peer cached | peer TTFT s"
    out = [head, "-" * len(head)]
    for i, r in enumerate(rows):
        cells = [f"{r['turn']}{'*' if r['after_restart'] else ''}", r["prompt_tokens"],
                 r["cached_tokens"], r["cache_source"] or "", r["new_tokens"], r["ttft_s"],
                 r["server_ttft_s"], r["server_prefill_s"], r.get("forward_s"),
                 r.get("own_s"), r.get("floor_s", "")]
        if peer and i < len(peer):
            cells += [peer[i]["prompt_tokens"], peer[i]["cached_tokens"], peer[i]["ttft_s"]]
        out.append(" | ".join(str(c) for c in cells))
    return "\n".join(out) + "\n(* the first turn after the restart)"


def plot(path: Path, rows: list[dict], peer: list[dict] | None, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    turns = [r["turn"] for r in rows]
    ax.plot(turns, [r["ttft_s"] for r in rows], "o-", label="this server")
    if any(r.get("floor_s") for r in rows):
        ax.plot(turns, [r.get("floor_s") for r in rows], "x:", label="floor (new tokens only)")
    if peer:
        ax.plot([r["turn"] for r in peer], [r["ttft_s"] for r in peer], "s--",
                label=f"{args.peer} server")
    if args.restart_at:
        ax.axvline(args.restart_at - 0.5, color="grey", lw=1, ls="--")
        ax.text(args.restart_at - 0.45, ax.get_ylim()[1], "restart", va="top", fontsize=8)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT at the client (s)")
    ax.set_title(f"Agent session ({args.api}, {rows[0]['prompt_tokens']:,}-token first prompt)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", choices=APIS, default="anthropic")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--initial-tokens", type=int, default=7000)
    ap.add_argument("--result-tokens", type=int, nargs=2, default=[200, 3000],
                    metavar=("MIN", "MAX"), help="size range of the tool results")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cap on each answer (default: the agent's own, 32,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="default", help="'default' or a model folder")
    ap.add_argument("--context", type=int, default=65536,
                    help="context of the folder written for --model default")
    ap.add_argument("--kv-cache-dir", type=Path, default=None,
                    help="default: a new temporary folder")
    ap.add_argument("--max-kv-ram-gb", type=float, default=8.0)
    ap.add_argument("--restart-at", type=int, default=None)
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--peer", choices=PEERS, default=None)
    ap.add_argument("--peer-bin", default=None,
                    help="the rapid-mlx or vllm-mlx executable (default: on PATH)")
    ap.add_argument("--peer-tools", choices=["inline", "native"], default="inline")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("--plot", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("server_args", nargs="*", help="extra flags for this server (after --)")
    args = ap.parse_args()
    if args.peer and args.api != "openai":
        ap.error("--peer runs the OpenAI chat API only (--api openai)")
    exe = peer_exe(args.peer, args.peer_bin) if args.peer not in (None, "mlx-lm") else None
    if args.restart_at is not None and not 2 <= args.restart_at <= args.turns:
        ap.error("--restart-at must be a turn from 2 to --turns")
    work = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    folder = model_folder(args.model, work, args.context)
    tokenizer = load_tokenizer(str(folder))

    def session() -> Session:
        return Session(api=args.api, seed=args.seed, initial_tokens=args.initial_tokens,
                       turns=args.turns, tokenizer=tokenizer,
                       result_tokens=tuple(args.result_tokens), max_tokens=args.max_tokens)

    kv = args.kv_cache_dir or work / "kv"
    kv.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ours = session()
    # NOTE: the agent's own model name only: '*=default' recurses in ModelRegistry.get when
    # the served model is not itself named 'default'.
    extra = ["--model", str(folder), "--model-alias", f"{ours.model}=default",
             "--max-kv-ram-gb", str(args.max_kv_ram_gb), *args.server_args]
    print(f"work folder {work}; model {folder}", flush=True)
    rows, server = run_session(ours, lambda: Server(kv, port, extra), args, ours=True,
                               label="ours")
    try:
        if args.floor:
            floors(server, ours, rows, tokenizer, args)
    finally:
        server.stop()
    peer_rows = None
    if args.peer:
        peer_rows, peer = run_session(
            session(), lambda: start_peer(args.peer, exe, folder, free_port(), work,
                                          args.timeout), args, ours=False, label=args.peer)
        peer.stop()
    summary = summarize(rows, peer_rows, args.restart_at)
    print(table(rows, peer_rows))
    print(json.dumps(summary, indent=1))
    name = f"agent/{args.api}-{round(args.initial_tokens / 1000)}k" + (
        f"-{args.peer}" if args.peer else "")
    write(name, json.dumps({
        "command": " ".join(sys.argv), "model": str(folder),
        "initial_tokens_measured": ours.initial_measured, "tools": len(ours.tools),
        "summary": summary, "turns": rows, "peer_name": args.peer, "peer": peer_rows},
        indent=1), override=args.json)
    plot(run_file(name, ".png", args.plot), rows, peer_rows, args)


if __name__ == "__main__":
    main()
