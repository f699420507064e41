"""Many clients at once: ours against mlx-lm's server (continuous batching on both).

Each of N clients holds its own conversation on one shared ~2,000-token document. Round 1: all
N send their first question at the same moment (cold: a fresh server). Round 2: all N send the
next turn of their conversation at the same moment. 64-token greedy answers, streamed.
Per server, per N, per round: time to first token (min / median / p95 / max), the round's
wall time, aggregate completion tokens/s, per-client decode tokens/s.

    .venv/bin/python -m benchmarks.batching                       # N = 1, 4, 8, 16, both servers
    .venv/bin/python -m benchmarks.batching --clients 1 --ours-root ../old-checkout --skip-mlxlm
    .venv/bin/python -m benchmarks.batching --kv-only              # KV bytes, in-process
    .venv/bin/python -m benchmarks.batching --plot run1.log run2.json  # one plot of both

``--kv-only`` measures the KV memory held while 8 conversations sharing the document decode
together (pages + prefix views + working buffers) against one conversation alone, in-process
with the scheduler, and what mlx-lm's batch (one contiguous KVCache per sequence) holds.
Writes benchmarks/results/batching/<run's UTC time>.json (and .png; ``--kv-only``:
benchmarks/results/batching/kv/), or ``<--name>.json`` (and ``.png``) into ``--out DIR`` when
given.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import record
from benchmarks.multiturn import MlxLmServer
from benchmarks.ttft import ROOT, Server, ask, document, free_port


QUESTIONS = ["When was the old mill rebuilt?", "How far is the harbour from the square?",
             "Which place records the most visitors?", "What opens earliest on weekdays?",
             "Name two places founded before 1800.", "What does the library keep?",
             "Which place has a stone bridge?", "Where can one buy bread?"]
FOLLOW_UP = "Thanks. Now say it again in other words."


def question(i: int) -> str:
    return f"(Reader {i + 1}) {QUESTIONS[i % len(QUESTIONS)]}"


def round_(url: str, convs: list[list[dict]], args, ours: bool) -> dict:
    results: list[dict | None] = [None] * len(convs)
    barrier = threading.Barrier(len(convs))

    def client(i: int) -> None:
        barrier.wait()
        results[i] = ask(url, convs[i], True if ours else None, args.tokens, timeout=3600)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["completion_tokens"] for r in results)
    decode = [(r["completion_tokens"] - 1) / (r["total"] - r["ttft"]) for r in results
              if r["completion_tokens"] > 1 and r["total"] > r["ttft"]]
    return {"ttft_min": ttfts[0], "ttft_median": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "ttft_max": ttfts[-1], "wall": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "decode_tokens_per_s_per_client": statistics.median(decode) if decode else None,
            "cached": [r["cached_tokens"] for r in results], "results": results}


def session(url: str, n: int, args, ours: bool, doc: str) -> dict:
    convs = []
    for i in range(n):
        system = {"role": "system", "content": doc}
        user = {"role": "user", "content": question(i)}
        if ours:
            system["message_id"], user["message_id"] = f"doc-{i}", f"c{i}-u0"
        convs.append([system, user])
    r1 = round_(url, convs, args, ours)
    for i, conv in enumerate(convs):
        answer = {"role": "assistant", "content": r1["results"][i]["text"]}
        user = {"role": "user", "content": FOLLOW_UP}
        if ours:
            answer["message_id"], user["message_id"] = r1["results"][i]["message_id"], f"c{i}-u1"
        conv += [answer, user]
    r2 = round_(url, convs, args, ours)
    for res in r1["results"] + r2["results"]:
        res.pop("text")
    return {"round1": r1, "round2": r2}


def run_server(kind: str, args, doc: str, work: Path, out: dict | None = None,
               save=lambda: None) -> dict:
    out = {} if out is None else out
    for n in args.clients:
        port = free_port()
        if kind == "ours":
            server = Server(work / f"kv-{n}-{time.time_ns()}", port,
                            ["--model", args.model, "--max-tokens", "512"], cwd=args.ours_root)
        else:
            server = MlxLmServer(args.mlx_folder, port, work)
        try:
            out[str(n)] = session(server.url, n, args, kind == "ours", doc)
        finally:
            server.stop()
        save()
        r1, r2 = out[str(n)]["round1"], out[str(n)]["round2"]
        print(f"{kind} N={n}: round 1 TTFT median {r1['ttft_median']:.2f}s, "
              f"{r1['tokens_per_s']:.2f} tok/s; round 2 TTFT median {r2['ttft_median']:.2f}s "
              f"p95 {r2['ttft_p95']:.2f}s, {r2['tokens_per_s']:.2f} tok/s, decode/client "
              f"{r2['decode_tokens_per_s_per_client']}", flush=True)
    return out


def on_document(lm, doc: str | list[str], n: int, chunk: int = 256):
    """``n`` conversations on ``doc`` prompted the way the scheduler does (pages committed per
    chunk, so each later one finds the document in pages and reads it through a view): the
    pool, its manager, the runner, the sequences and each one's next (greedy) token. A list of
    ``n`` documents gives each conversation its own."""
    import mlx.core as mx

    from kv_cache.model.views import PrefixViews
    from kv_cache.manager import CacheManager
    from kv_cache.pages.pool import PagePool
    from mlx_kvserver.engine.runner import Runner

    tok = lm.tokenizer
    pool = PagePool(spec=lm.cache_spec, page_size=32, max_bytes=8 << 30,
                    fingerprint=lm.fingerprint)
    manager = CacheManager(pool)
    runner = Runner(lm.model, manager, lm.name)
    if runner.batched:
        manager.views = PrefixViews(pool)
    seqs, nxt = [], []
    for i in range(n):
        prompt = tok.encode(tok.render([{"role": "system",
                                         "content": doc if isinstance(doc, str) else doc[i]},
                                        {"role": "user", "content": question(i)}],
                                       add_generation_prompt=True))
        seq, match = manager.start(prompt, [])
        for at in range(match.tokens, len(prompt), chunk):
            logits = runner.prefill(seq, prompt[at : at + chunk])
            seq.commit()
        seqs.append(seq)
        nxt.append(int(mx.argmax(logits).item()))
    return pool, manager, runner, seqs, nxt


def kv_bytes(args, doc: str) -> dict:
    """KV bytes held while 8 conversations on the document decode together, against one."""
    import mlx.core as mx

    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load(args.model)

    def held(n: int) -> dict:
        """After the prompts, 50 tokens decoded together (greedy, end tokens ignored)."""
        pool, manager, runner, seqs, nxt = on_document(lm, doc, n)
        for _ in range(50):
            logits = runner.decode(seqs, nxt)
            nxt = mx.argmax(logits, axis=-1).tolist()
        mx.eval([layer.keys for q in seqs for layer in q.paged_layers])
        pages = pool.stats().used_bytes
        views = manager.views.nbytes if manager.views else 0
        working = sum(layer.nbytes for q in seqs for layer in q.paged_layers)
        tokens = [len(q.tokens) for q in seqs]
        for q in seqs:
            q.close()
        return {"sequences": n, "tokens": tokens, "pages_bytes": pages, "view_bytes": views,
                "working_bytes": working, "total_bytes": pages + views + working}

    one, eight = held(1), held(8)
    g = lm.cache_spec.groups[0]
    per_token = sum(gr.page_bytes(1) for gr in lm.cache_spec.groups)
    # mlx-lm's batch: one contiguous cache per sequence, grown in steps of 256 positions
    mlxlm = sum(-(-t // 256) * 256 * per_token for t in eight["tokens"])
    return {"one": one, "eight": eight, "ratio": eight["total_bytes"] / one["total_bytes"],
            "mlx_lm_batch_bytes": mlxlm, "dtype": g.dtype}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, runs in report["servers"].items():
        ns = sorted(int(n) for n in runs)
        for rnd, style in (("round1", "--"), ("round2", "-")):
            a.plot(ns, [runs[str(n)][rnd]["ttft_median"] for n in ns], style, marker="o",
                   label=f"{kind} {rnd}")
            b.plot(ns, [runs[str(n)][rnd]["tokens_per_s"] for n in ns], style, marker="o",
                   label=f"{kind} {rnd}")
    a.set(xlabel="clients", ylabel="median time to first token (s)", yscale="log")
    b.set(xlabel="clients", ylabel="completion tokens/s, all clients")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


LINE = re.compile(r"(\S+) N=(\d+): round 1 TTFT median ([\d.]+)s, ([\d.]+) tok/s; round 2 TTFT "
                  r"median ([\d.]+)s p95 ([\d.]+)s, ([\d.]+) tok/s")


def from_sources(paths: list[Path]) -> dict:
    """Runs gathered from reports (json) and from this script's printed lines (a log), for a
    plot of several runs: the later source wins for a server and N."""
    servers: dict = {}
    for path in paths:
        if path.suffix == ".json":
            for kind, runs in json.loads(path.read_text()).get("servers", {}).items():
                servers.setdefault(kind, {}).update(runs)
            continue
        for m in LINE.finditer(path.read_text()):
            kind, n = m[1], m[2]
            servers.setdefault(kind, {})[n] = {
                "round1": {"ttft_median": float(m[3]), "tokens_per_s": float(m[4])},
                "round2": {"ttft_median": float(m[5]), "ttft_p95": float(m[6]),
                           "tokens_per_s": float(m[7])}}
    return {"servers": servers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--skip-mlxlm", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--ours-root", type=Path, default=ROOT, help="checkout whose server runs")
    p.add_argument("--kv-only", action="store_true")
    p.add_argument("--out", type=Path, help="a folder to write <--name>.json and .png to, "
                   "instead of benchmarks/results/batching/<run's UTC time>.json and .png")
    p.add_argument("--name", default="batching", help="the files' stem with --out")
    p.add_argument("--plot", type=Path, nargs="+",
                   help="only plot: reports (.json) and logs of this script, later ones win")
    args = p.parse_args()
    if args.plot:
        plot(from_sources(args.plot), run_file(args, ".png"))
        return
    doc = document()
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.kv_only:
        report["kv"] = kv_bytes(args, doc)
        print(json.dumps(report["kv"], indent=1))
    else:
        report["servers"] = {}
        save = lambda: write(report, args)  # noqa: E731  (after every N: a long run keeps what it has)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if not args.skip_ours:
                report["servers"]["ours"] = {}
                run_server("ours", args, doc, work, report["servers"]["ours"], save)
            if not args.skip_mlxlm:
                from mlx_kvserver.models.convert import save_mlx_folder
                from mlx_kvserver.models.loading import resolve_and_load

                args.mlx_folder = save_mlx_folder(resolve_and_load(args.model), work / "mlx")
                report["servers"]["mlx-lm"] = {}
                run_server("mlx-lm", args, doc, work, report["servers"]["mlx-lm"], save)
        if len(report["servers"]) and len(args.clients) > 1:
            plot(report, run_file(args, ".png"))
    write(report, args)


def _given(args, suffix: str) -> Path | None:
    return args.out / f"{args.name}{suffix}" if args.out else None


def run_file(args, suffix: str) -> Path:
    """This run's file: under benchmarks/results/batching/, or in ``--out`` when given."""
    return record.run_file(_name(args), suffix, _given(args, suffix))


def _name(args) -> str:
    return "batching/kv" if args.kv_only else "batching"


def write(report: dict, args) -> None:
    record.write(_name(args), json.dumps(report, indent=1, default=str), ".json",
                 _given(args, ".json"))


if __name__ == "__main__":
    main()
