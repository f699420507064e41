"""Multi-turn workload, side by side with mlx-lm's own server, measured at the client.

Several conversations of --turns turns share a ~2,000-token system document and are sent
round-robin; one conversation forks from another, and one edits an earlier message. Runs, in one
go, on loopback, with the default model:
  ours-nocache   this server with use_kv_cache=false (every turn recomputed)
  ours-warm      this server with its cache
  ours-restart   this server restarted on the same cache directory; every conversation (and the
                 fork) resumed with one new turn
  mlxlm-warm     mlx-lm's server (python -m mlx_lm.server) on the same model, converted to an MLX
                 folder by mlx_kvserver.models.convert, with its in-memory prompt cache
  mlxlm-restart  mlx-lm's server restarted; every conversation resumed with one new turn
  mlxvlm-warm    mlx-vlm's server (python -m mlx_vlm.server, with --mlx-vlm PYTHON: an
                 interpreter with mlx-vlm installed) on the same folder, its prefix cache on
                 (APC_ENABLED=1: paged prefix blocks, with a disk tier under APC_DISK_PATH)
  mlxvlm-restart mlx-vlm's server restarted on the same APC disk path; one new turn each
  floor          in-process: prefill of only the new tokens on a resident cache
Writes benchmarks/results/multiturn/<run's UTC time>.json (the raw result), .md (the table) and
.png (TTFT per turn, log scale), or multiturn.json, multiturn.md and multiturn_ttft.png into
``--out DIR`` when given.
Usage: .venv/bin/python -m benchmarks.multiturn [--conversations 3] [--turns 6] [--quick]
       [--mlx-vlm /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_kvserver.platform import blas

blas.maybe_reexec()

from benchmarks import record  # noqa: E402
from benchmarks.ttft import (  # noqa: E402
    ROOT, Server, ask, document, free_port, wait_until_up)

QUESTIONS = ["When was the old mill rebuilt?", "How far is the harbour from the square?",
             "Which place records the most visitors?", "What opens earliest on weekdays?",
             "Name two places founded before 1800.", "Summarise the guide in one sentence.",
             "What does the library keep?", "Which place has a stone bridge?"]


class MlxLmServer(Server):
    """mlx-lm's server as a subprocess (same BLAS as ours)."""

    def __init__(self, folder: Path, port: int, workdir: Path):
        import subprocess

        env = dict(os.environ, PYTHONUNBUFFERED="1", **(blas.blas_env(os.environ) or {}))
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log = open(workdir / f"mlxlm-{port}-{time.time_ns()}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--port", str(port),
             "--max-tokens", "512"], cwd=ROOT, env=env, stdout=self.log,
            stderr=subprocess.STDOUT)
        wait_until_up(self.proc, self.url + "/models", self.log.name, "mlx-lm server")


class MlxVlmServer(Server):
    """mlx-vlm's server as a subprocess, its prefix cache on with a disk tier in ``workdir``;
    requests name the model by the folder it was started with."""

    def __init__(self, python: str, folder: Path, port: int, workdir: Path):
        import subprocess

        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", APC_ENABLED="1",
                   APC_DISK_PATH=str(workdir / "mlx-vlm-apc"), **(blas.blas_env(os.environ) or {}))
        self.url, self.model = f"http://127.0.0.1:{port}/v1", str(folder)
        self.log = open(workdir / f"mlxvlm-{port}-{time.time_ns()}.log", "w")
        python = os.path.abspath(python) if os.sep in python else python  # it runs in workdir
        self.proc = subprocess.Popen(
            [python, "-m", "mlx_vlm.server", "--model", str(folder), "--host", "127.0.0.1",
             "--port", str(port), "--max-tokens", "512"], cwd=workdir, env=env, stdout=self.log,
            stderr=subprocess.STDOUT)
        wait_until_up(self.proc, self.url + "/models", self.log.name, "mlx-vlm server")


def workload(url, tag, use_cache, args, doc, strip_ids=False, model=None):
    """Runs the workload; returns per-request records and the requests as sent (for replay)."""
    system = {"role": "system", "content": "Answer from this town guide.\n\n" + doc,
              "message_id": f"{tag}-sys"}
    convs = {c: [dict(system)] for c in range(args.conversations)}
    records, sent = [], {}

    def send(name, messages, turn):
        body = [{k: v for k, v in m.items() if not (strip_ids and k == "message_id")}
                for m in messages]
        res = ask(url, body, use_cache, args.max_tokens, model=model)
        sent[name] = body + [{"role": "assistant", "content": res["text"],
                              "message_id": res["message_id"] or f"{tag}-{name}-a{turn}"}]
        records.append({"conv": name, "turn": turn, **{k: res[k] for k in
                        ("ttft", "total", "prompt_tokens", "cached_tokens")}})
        return res

    for turn in range(args.turns):
        for c, messages in convs.items():
            q = QUESTIONS[(turn + c) % len(QUESTIONS)]
            messages.append({"role": "user", "content": f"{q} (conversation {c})",
                             "message_id": f"{tag}-c{c}-u{turn}"})
            res = send(f"c{c}", messages, turn + 1)
            messages.append({"role": "assistant", "content": res["text"],
                             "message_id": res["message_id"] or f"{tag}-c{c}-a{turn}"})
        if turn == 2:  # a fork of conversation 0 after its third answer
            fork = [dict(m) for m in convs[0]]
            fork.append({"role": "user", "content": "Instead, list three places.",
                         "message_id": f"{tag}-fork-u"})
            send("fork", fork, turn + 1)
        if turn == 3 and args.conversations > 1:  # an edited earlier message in conversation 1
            edited = [dict(m) for m in convs[1]]
            edited[3] = dict(edited[3], content=edited[3]["content"] + " Be precise.")
            edited.append({"role": "user", "content": "Go on.", "message_id": f"{tag}-edit-u"})
            send("edit", edited, turn + 1)
    return records, sent


def resume(url, sent, use_cache, args, strip_ids=False, model=None):
    """After a restart: one new turn in every conversation (and the fork), as a user coming back
    to each of them would send."""
    records = []
    for name, history in sent.items():
        body = history + [{"role": "user", "content": "One more question: what is note 5 about?",
                           "message_id": f"resume-{name}"}]
        if strip_ids:
            body = [{k: v for k, v in m.items() if k != "message_id"} for m in body]
        res = ask(url, body, use_cache, args.max_tokens, model=model)
        records.append({"conv": name, "turn": args.turns + 1, **{k: res[k] for k in
                        ("ttft", "total", "prompt_tokens", "cached_tokens")}})
    return records


def floor(records, args):
    """In-process: prefill only each request's new tokens on a resident cache of its cached part."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(args.model)
    out = []
    for r in records:
        cache = [KVCache() for _ in range(lm.num_layers)]
        cached = max(r["cached_tokens"], 0)
        toks = [(i * 17) % 5000 + 100 for i in range(r["prompt_tokens"])]
        for s in range(0, cached, 512):
            mx.eval(lm.model(mx.array(toks[s:min(s + 512, cached)])[None], cache=cache))
        t0 = time.perf_counter()
        logits = lm.model(mx.array(toks[cached:])[None], cache=cache)
        mx.eval(mx.argmax(logits[0, -1]))
        out.append({**r, "ttft": time.perf_counter() - t0})
    return out


def summarize(runs):
    table = {}
    for name, recs in runs.items():
        first = [r["ttft"] for r in recs if r["turn"] == 1] or [float("nan")]
        later = [r["ttft"] for r in recs if r["turn"] > 1]
        table[name] = {"median_ttft_turn1": statistics.median(first),
                       "median_ttft_later": statistics.median(later),
                       "mean_cached_fraction": statistics.mean(
                           r["cached_tokens"] / r["prompt_tokens"] for r in recs)}
    return table


def plot(runs, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, recs in runs.items():
        ax.plot(range(1, len(recs) + 1), [r["ttft"] for r in recs], marker="o", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("request (round-robin over conversations, in order sent)")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title("Multi-turn workload: TTFT per request")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--doc-sentences", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="2 conversations, 3 turns, short doc")
    ap.add_argument("--skip-mlxlm", action="store_true")
    ap.add_argument("--mlx-vlm", metavar="PYTHON",
                    help="also run mlx-vlm's server (prefix cache on) with this interpreter, "
                         "e.g. a venv's bin/python with `pip install 'mlx-vlm[cpu]'`")
    ap.add_argument("--out", type=Path, help="a folder to write multiturn.json, .md and _ttft.png "
                    "to, instead of benchmarks/results/multiturn/<run's UTC time>.*")
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.doc_sentences = 2, 4, 30
    doc = document(args.doc_sentences)
    work = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    runs = {}
    port = free_port()
    server = Server(work / "kv", port, ["--model", args.model])
    try:
        runs["ours-nocache"], _ = workload(server.url, "nc", False, args, doc)
        runs["ours-warm"], sent = workload(server.url, "w", True, args, doc)
    finally:
        server.stop()
    server = Server(work / "kv", port, ["--model", args.model])
    try:
        runs["ours-restart"] = resume(server.url, sent, True, args)
    finally:
        server.stop()
    if not args.skip_mlxlm or args.mlx_vlm:
        from mlx_kvserver.models.convert import save_mlx_folder
        from mlx_kvserver.models.loading import resolve_and_load

        folder = save_mlx_folder(resolve_and_load(args.model), work / "mlx-model")
    if args.mlx_vlm:
        for run in ("warm", "restart"):
            peer = MlxVlmServer(args.mlx_vlm, folder, port, work)
            try:
                if run == "warm":
                    runs["mlxvlm-warm"], vlm_sent = workload(
                        peer.url, "v", None, args, doc, strip_ids=True, model=peer.model)
                else:
                    runs["mlxvlm-restart"] = resume(peer.url, vlm_sent, None, args,
                                                    strip_ids=True, model=peer.model)
            finally:
                peer.stop()
    if not args.skip_mlxlm:
        peer = MlxLmServer(folder, port, work)
        try:
            runs["mlxlm-warm"], peer_sent = workload(peer.url, "m", True, args, doc,
                                                     strip_ids=True)
        finally:
            peer.stop()
        peer = MlxLmServer(folder, port, work)
        try:
            runs["mlxlm-restart"] = resume(peer.url, peer_sent, True, args, strip_ids=True)
        finally:
            peer.stop()
    runs["floor"] = floor(runs["ours-warm"], args)
    table = summarize(runs)
    later = {k: v["median_ttft_later"] for k, v in table.items()}
    checks = {"warm_vs_floor": later["ours-warm"] / later["floor"]}
    if "mlxlm-warm" in later:
        checks["warm_vs_mlxlm_warm"] = later["ours-warm"] / later["mlxlm-warm"]
        checks["mlxlm_restart_vs_ours_restart"] = (
            statistics.median(r["ttft"] for r in runs["mlxlm-restart"])
            / statistics.median(r["ttft"] for r in runs["ours-restart"]))
    if "mlxvlm-warm" in later:
        checks["warm_vs_mlxvlm_warm"] = later["ours-warm"] / later["mlxvlm-warm"]
        checks["mlxvlm_restart_vs_ours_restart"] = (
            statistics.median(r["ttft"] for r in runs["mlxvlm-restart"])
            / statistics.median(r["ttft"] for r in runs["ours-restart"]))

    def given(name: str) -> Path | None:
        return args.out / name if args.out else None

    plot(runs, record.run_file("multiturn", ".png", given("multiturn_ttft.png")))
    lines = ["| run | median TTFT turn 1 (s) | median TTFT later turns (s) | cached fraction |",
             "|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['median_ttft_turn1']:.3f} | "
                     f"{row['median_ttft_later']:.3f} | {row['mean_cached_fraction']:.2f} |")
    report = {"table": table, "checks": checks, "runs": runs,
              "settings": {k: str(v) for k, v in vars(args).items()}}
    record.write("multiturn", json.dumps(report, indent=1), ".json", given("multiturn.json"))
    record.write("multiturn", "\n".join(lines) + "\n\n" + json.dumps(checks, indent=1) + "\n",
                 ".md", given("multiturn.md"))
    print("\n".join(lines))
    print(json.dumps(checks, indent=1))


if __name__ == "__main__":
    main()
