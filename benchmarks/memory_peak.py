"""Peak memory against ``--memory-limit``: a sweep of prompt lengths and batch sizes.

For each limit (the model's weights, plus what the server process holds outside MLX at rest as
the probe server reports it (``outside_mlx_bytes``: Python, the tokenizer, libraries), plus
``--extras`` GB, so that the budget binds) and each cell
(``--contexts`` prompt tokens x ``--batches`` requests sent at once), a fresh server process is
started on the default model (real weights; on MLX's CPU backend dequantized to float32) with
``--memory-limit``; at rest its resident memory (VmRSS), its peak so far (VmHWM: the model's
load) and MLX's figures are read (the load's MLX peak and its estimate from the files among
them); then the cell's requests are sent together to ``/v1/completions`` as token-id prompts of
exactly that length (distinct per request, so nothing is shared), ``--max-tokens`` answer tokens
each. A request answered 503 (memory busy) is sent again after its Retry-After, as a client
would; a 400 (cannot fit alone) is counted as refused. At the end: the process's peak resident
memory (``/proc/PID/status`` VmHWM) and MLX's peak (``mlx_peak_bytes`` of
``/v1/kv_cache/stats``), both from the process's start: nothing is reset, the load counts.

Reported per cell, against the limit (goal <= 1.0 for each): MLX's peak, the process's peak
resident memory (VmHWM), and both again at rest (the model's load); VmHWM / (limit + what the
process holds outside MLX at rest: VmRSS at rest less MLX's active and cached bytes then) beside
them. The raw result goes to ``benchmarks/results/memory_peak/<run's UTC time>.json`` (and
``.png``) unless ``--json`` (``--plot``) names another file.

Usage: .venv/bin/python -m benchmarks.memory_peak [--quick] [--json FILE] [--plot FILE]
       [--extras 0.3 0.6 1.2] [--contexts 512 2000 6000] [--batches 1 4 8] [-- server flags]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.memory_growth import proc_status
from benchmarks.record import OVERRIDE_HELP, run_file, write
from benchmarks.ttft import Server, free_port

GB, MB = 1 << 30, 1 << 20


def memory(url: str) -> dict:
    """The model's memory report, with its prefix views' bytes and resident sequences' tokens
    (the parts of ``working_bytes`` that outlive a pass)."""
    stats = next(iter(httpx.get(f"{url}/kv_cache/stats", timeout=300).json()["models"].values()))
    ram = stats.get("ram") or {}
    return {**stats["memory"], "view_bytes": ram.get("prefix_view_bytes", 0),
            "resident_tokens": ram.get("resident_sequence_tokens", 0)}


def send(url: str, prompt: list[int], args, out: dict) -> None:
    """One request; 503s sent again after their Retry-After (counted), the last status kept."""
    t0 = time.monotonic()
    out.update(retries=0, status=None)
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
    if args.no_cache:
        body["use_kv_cache"] = False
    try:
        while True:
            r = httpx.post(f"{url}/completions", json=body, timeout=3600)
            if r.status_code != 503:
                break
            out["retries"] += 1
            time.sleep(float(r.headers.get("retry-after", 5)))
    except httpx.HTTPError as e:  # the server was stopped (a hung cell)
        out.update(status="no answer", error=repr(e), seconds=round(time.monotonic() - t0, 1))
        return
    out.update(status=r.status_code, seconds=round(time.monotonic() - t0, 1))
    if r.status_code == 200:
        out["completion_tokens"] = r.json()["usage"]["completion_tokens"]
    else:
        out["error"] = r.text[:400]


def watch(url: str, threads: list, args, seen: list) -> str | None:
    """Poll the server's memory every 5 s while ``threads`` run; "spinning" when the scheduler
    meets memory pressure over 1,000 times a second for 15 s (no pass fits: it retries without
    end), "timeout" after ``--cell-timeout`` s; None when the requests ended."""
    t0, fast = time.monotonic(), 0
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        try:
            m = memory(url)
        except httpx.HTTPError:
            continue
        seen.append({"t_s": round(time.monotonic() - t0, 1), **{k: m[k] for k in (
            "mlx_active_bytes", "pages_bytes", "working_bytes", "mlx_cache_bytes",
            "mlx_peak_bytes", "pressure_events", "view_bytes", "resident_tokens")}})
        rate = (seen[-1]["pressure_events"] - seen[-2]["pressure_events"]) / 5 \
            if len(seen) > 1 else 0
        fast = fast + 1 if rate > 1000 else 0
        if fast >= 3:
            return "spinning"
        if time.monotonic() - t0 > args.cell_timeout:
            return "timeout"
    return None


def cell(limit: int, ctx: int, batch: int, args, work: Path, seed: int) -> dict:
    cache = work / f"kv-{seed}"
    flags = ["--memory-limit", f"{limit / GB:.4f}", "--log-level", "warning",
             "--max-kv-size-gb", "8", *args.server_args]
    server = Server(cache, free_port(), flags)
    pid = server.proc.pid
    try:
        time.sleep(2)
        rest, rest_mem = proc_status(pid), memory(server.url)  # VmHWM so far: the load's
        rng = random.Random(seed)
        outs = [{} for _ in range(batch)]
        threads = [threading.Thread(target=send, args=(
            server.url, [rng.randrange(1000, 40000) for _ in range(ctx)], args, o))
            for o in outs]
        t0, seen = time.monotonic(), [dict(rest_mem, t_s=0)]
        for t in threads:
            t.start()
        hung = watch(server.url, threads, args, seen)
        wall = time.monotonic() - t0
        end, end_mem = proc_status(pid), memory(server.url)
        if hung:  # what the pool and the budget hold while it spins
            st = next(iter(httpx.get(f"{server.url}/kv_cache/stats", timeout=300).json()[
                "models"].values()))
            hung = {"why": hung, "ram": st["ram"], "memory": st["memory"]}
            server.stop()  # the clients' requests end with it
        for t in threads:
            t.join()
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)
    outside = rest["VmRSS"] - rest_mem["mlx_active_bytes"] - rest_mem["mlx_cache_bytes"]
    row = {"limit_bytes": limit, "context": ctx, "batch": batch, "wall_s": round(wall, 1),
           "ok": sum(o["status"] == 200 for o in outs),
           "refused_400": sum(o["status"] == 400 for o in outs),
           "hung": hung, "timeline": seen[1:],
           "other_errors": [o for o in outs if o["status"] not in (200, 400)],
           "retries_503": sum(o["retries"] for o in outs),
           "rest_rss": rest["VmRSS"], "rest_rss_anon": rest["RssAnon"],
           "rest_mlx_active": rest_mem["mlx_active_bytes"],
           "rest_mlx_cache": rest_mem["mlx_cache_bytes"], "outside_mlx_at_rest": outside,
           "rest_mlx_peak": rest_mem["mlx_peak_bytes"], "rest_vm_hwm": rest["VmHWM"],
           "weights_bytes": rest_mem["weights_bytes"], "vm_hwm": end["VmHWM"],
           "reserved_outside_mlx": rest_mem.get("outside_mlx_bytes"),
           "load_peak": rest_mem.get("load_peak_bytes"),
           "load_estimate": rest_mem.get("load_estimate_bytes"),
           "end_rss": end["VmRSS"], "end_rss_anon": end["RssAnon"], "end_rss_file": end["RssFile"],
           "rest_rss_file": rest["RssFile"], "mlx_peak": end_mem["mlx_peak_bytes"],
           "end_mlx_active": end_mem["mlx_active_bytes"],
           "end_mlx_cache": end_mem["mlx_cache_bytes"], "end_pages": end_mem["pages_bytes"],
           "pressure_events": end_mem["pressure_events"], "refused": end_mem["refused"],
           "seconds": [o["seconds"] for o in outs]}
    row["mlx_peak_over_limit"] = round(row["mlx_peak"] / limit, 4)  # from the process's start
    row["load_mlx_peak_over_limit"] = round(row["rest_mlx_peak"] / limit, 4)
    row["load_hwm_over_limit"] = round(row["rest_vm_hwm"] / limit, 4)
    row["hwm_over_limit_plus_outside"] = round(row["vm_hwm"] / (limit + outside), 4)
    row["hwm_over_limit"] = round(row["vm_hwm"] / limit, 4)
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    limits = sorted({r["limit_bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(limits), figsize=(5 * len(limits), 4.2), squeeze=False)
    for ax, lim in zip(axes[0], limits):
        cells = [r for r in rows if r["limit_bytes"] == lim]
        labels = [f"{r['context']}x{r['batch']}" for r in cells]
        x = range(len(cells))
        w = 0.27
        ax.bar([i - w for i in x], [r["mlx_peak_over_limit"] for r in cells], w,
               label="MLX peak / limit (from the process's start)")
        ax.bar(list(x), [r["hwm_over_limit_plus_outside"] for r in cells], w,
               label="VmHWM / (limit + outside MLX at rest)")
        ax.bar([i + w for i in x], [r["hwm_over_limit"] for r in cells], w,
               label="VmHWM / limit (from the start)", alpha=0.5)
        for i, r in enumerate(cells):
            note = "hung (spinning)" if r["hung"] else (
                f"{r['refused_400']} refused" if r["refused_400"] else "")
            ax.text(i, 0.05, note, rotation=90, fontsize=7)
        ax.axhline(1.0, color="red", lw=0.8)
        ax.set_xticks(list(x), labels, rotation=45, fontsize=8)
        ax.set(title=f"limit {lim / GB:.2f} GB (weights {cells[0]['weights_bytes'] / GB:.2f})",
               xlabel="prompt tokens x requests at once", ylim=(0, 1.6))
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", type=float, nargs="+", default=[0.3, 0.6, 1.2],
                    help="limits: the weights plus these GB")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2000, 6000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-cache", action="store_true", help="requests with use_kv_cache false")
    ap.add_argument("--cell-timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true", help="one limit, 512 and 2000 x 1 and 4")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("--plot", type=Path, help=OVERRIDE_HELP)
    ap.add_argument("server_args", nargs="*", help="extra server flags (after --)")
    args = ap.parse_args()
    if args.quick:
        args.extras, args.contexts, args.batches = [0.3], [512, 2000], [1, 4]
    work = Path(tempfile.mkdtemp(prefix="bench-mempeak-"))
    probe = Server(work / "kv-probe", free_port(), ["--log-level", "warning", *args.server_args])
    try:
        at_rest = memory(probe.url)
        weights, outside = at_rest["weights_bytes"], at_rest.get("outside_mlx_bytes", 0)
    finally:
        probe.stop()
    print(f"weights {weights / GB:.3f} GB, outside MLX {outside / GB:.3f} GB", flush=True)
    rows, t0 = [], time.monotonic()
    for extra in args.extras:
        limit = weights + outside + int(extra * GB)
        for ctx in args.contexts:
            for batch in args.batches:
                r = cell(limit, ctx, batch, args, work, len(rows))
                rows.append(r)
                print(f"limit {limit / GB:.3f} GB  {ctx:5d} x {batch}: {r['ok']} ok, "
                      f"{r['refused_400']} refused, {r['retries_503']} 503s, {r['wall_s']} s;"
                      f" MLX peak {r['mlx_peak'] / MB:.0f} MiB ({r['mlx_peak_over_limit']}),"
                      f" VmHWM {r['vm_hwm'] / MB:.0f} MiB (/(limit+outside) "
                      f"{r['hwm_over_limit_plus_outside']}, /limit {r['hwm_over_limit']}), "
                      f"outside MLX at rest {r['outside_mlx_at_rest'] / MB:.0f} MiB, "
                      f"pressure {r['pressure_events']}; at rest (the load): MLX peak "
                      f"{r['load_mlx_peak_over_limit']}, VmHWM {r['load_hwm_over_limit']}"
                      + (f"; HUNG ({r['hung']['why']})" if r["hung"] else ""), flush=True)
                write("memory_peak", json.dumps({"rows": rows}, indent=1),  # saved as it goes
                      override=args.json)
    worst = {k: max(r[k] for r in rows) for k in
             ("mlx_peak_over_limit", "hwm_over_limit_plus_outside", "hwm_over_limit",
              "load_mlx_peak_over_limit", "load_hwm_over_limit")}
    summary = {"weights_bytes": weights, "outside_mlx_bytes": outside, "extras_gb": args.extras,
               "load_peak_bytes": rows[0]["load_peak"], "load_estimate_bytes": rows[0][
                   "load_estimate"], "peaks_from": "the process's start (nothing reset)",
               "contexts": args.contexts,
               "batches": args.batches, "max_tokens": args.max_tokens, "worst": worst,
               "goal": 1.0, "all_finished_or_refused": all(
                   r["ok"] + r["refused_400"] == r["batch"] for r in rows),
               "seconds": round(time.monotonic() - t0, 1), "server_flags": args.server_args}
    print(json.dumps(summary, indent=1))
    write("memory_peak", json.dumps({"summary": summary, "rows": rows}, indent=1),
          override=args.json)
    out = run_file("memory_peak", ".png", args.plot)
    plot(rows, out)
    print(f"wrote {out}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
