"""Images read once: time to first token of a 4-turn chat about one picture, side by side with
mlx-vlm's own server, measured at the client.

The model is a random-weight Qwen2.5-VL built with mlx-vlm's own classes
(``harness/tiny_vlm.py``): Qwen2.5-VL-3B-Instruct's shape (widths, heads, M-RoPE sections,
14-pixel patches merged 2 by 2, its image processor config) with ``--layers`` of its 36 language
layers and ``--vision-depth`` of its 32 vision blocks, attending inside 112-pixel windows only
(the blocks that attend over the whole image would hold 16 x 16,384^2 float32 scores, 17 GB, for
the large picture on a CPU). Two pictures made with Pillow (gradients and shapes, JPEG), sized with
the model's own image processor to about 1,000 and about 4,000 image tokens, each get a chat of
their own (greedy, ``--max-tokens`` per answer, streamed; TTFT is from sending the request to the
first content delta):
  ours            this server: turn 1 (nothing cached), turns 2-4 (the history cached); then the
                  server is stopped and started again on the same --kv-cache-dir and turn 2 is
                  sent again with another question (its history up to turn 1's answer read
                  back from disk, its question new: as many new tokens as warm turn 2's)
  mlx-vlm         with --mlx-vlm PYTHON (an interpreter with mlx-vlm installed):
                  ``python -m mlx_vlm.server`` on the same folder, its prefix cache on
                  (APC_ENABLED=1, disk tier under APC_DISK_PATH): turn 1, turn 2; then restarted on
                  the same APC disk path and turn 2 sent again with the other question
Each server start first answers one short text request, not measured, so that a TTFT is the image
chat's and not the first request's one-time setup. Each server holds its own conversation (its
own answers in the history). Prompt and cached tokens come from each answer's usage; the vision
encoder's runs from our server's ``/metrics`` (a counter whose name has ``encoder`` and ``run``)
or ``/v1/kv_cache/stats`` (such a key), null when it exposes none.

Summary per picture: ours turn 2 / turn 1 (goal <= 0.1), ours restarted / warm turn 2 (goal <= 1.2),
ours warm and restarted turn 2 over mlx-vlm's restarted turn 2 (goal <= 0.5), encoder runs.
The result goes to benchmarks/results/vision/<run's UTC time>.json (and .md, the table) unless
``--json`` names a file. ``--quick``: the tiny Qwen2.5-VL and pictures of ~100 and ~400 tokens.
Usage: .venv/bin/python -m benchmarks.vision [--mlx-vlm PYTHON] [--layers 4] [--vision-depth 4]
       [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import tempfile
import time
from pathlib import Path

from mlx_kvserver.platform import blas

blas.maybe_reexec()

import httpx  # noqa: E402

from benchmarks.multiturn import MlxVlmServer  # noqa: E402
from benchmarks.record import OVERRIDE_HELP, write  # noqa: E402
from benchmarks.ttft import Server, ask, free_port  # noqa: E402

TARGETS = (1000, 4000)  # image tokens of the two pictures
QUICK_TARGETS = (100, 400)
QUESTIONS = ["Describe this picture.", "Which colours are in its top left corner?",
             "How many shapes are there?", "Summarise the picture in one sentence."]
# turn 2 after a restart asks this instead of QUESTIONS[1]: a turn the server has not seen (its
# history up to turn 1's answer read back from disk, its question new), not a repeat of warm
# turn 2 whose whole prompt the cache already holds
RESTART_QUESTION = "Which colours are in its bottom right corner?"
FIELDS = ("ttft", "total", "prompt_tokens", "cached_tokens", "completion_tokens", "encoder_runs")
GOALS = {"turn2_over_turn1": 0.1, "restart_over_warm_turn2": 1.2,
         "turn2_over_mlxvlm_restart_turn2": 0.5, "restart_turn2_over_mlxvlm_restart_turn2": 0.5}


def build_model(args, folder: Path) -> tuple[Path, str]:
    """The model folder and the honest name of its shape."""
    from harness.tiny_vlm import (
        make_tiny_vlm_dir, make_vlm_dir, preprocessor_config, qwen25_vl_3b_config)

    if args.quick:
        return (make_tiny_vlm_dir(folder), "tiny Qwen2.5-VL (harness/tiny_vlm.py: hidden 64, "
                "2 layers, 8-pixel patches), float32 random weights")
    config = qwen25_vl_3b_config(args.layers, args.vision_depth, full_attention=False)
    path = make_vlm_dir(folder, config, preprocessor_config(14, 2, 3136, 12845056))
    return path, (f"Qwen2.5-VL-3B shape, {args.layers} of 36 language layers, "
                  f"{args.vision_depth} of 32 vision blocks (window attention only), float32 "
                  f"random weights, {config['vocab_size']}-token vocabulary")


def picture(width: int, height: int, seed: int) -> bytes:
    """A JPEG with structure: colour gradients under a few filled shapes."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                    ((x + y + 40 * seed) * 3) % 256], axis=-1).astype(np.uint8)
    im = Image.fromarray(rgb)
    draw = ImageDraw.Draw(im)
    rng = np.random.default_rng(seed)
    for i in range(6):
        x0, y0 = int(rng.integers(0, width * 3 // 4)), int(rng.integers(0, height * 3 // 4))
        box = (x0, y0, x0 + width // 6, y0 + height // 6)
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if i % 2 else draw.rectangle)(box, fill=fill, outline=(0, 0, 0))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=90)
    return out.getvalue()


def pictures(folder: Path, targets) -> list[dict]:
    """Per target: a picture of about that many image tokens in the folder's own image processor
    (4:3, each side a whole number of merged patches), its size and token count."""
    from mlx_vlm.utils import load_processor
    from PIL import Image

    ip = load_processor(folder).image_processor
    unit = ip.patch_size * ip.merge_size
    out = []
    for i, target in enumerate(targets):
        cols = round(math.sqrt(target * 4 / 3))
        rows = round(target / cols)
        data = picture(cols * unit, rows * unit, seed=i)
        grid = ip(images=[Image.open(io.BytesIO(data))], return_tensors="np")["image_grid_thw"]
        out.append({"target": target, "size": f"{cols * unit}x{rows * unit}",
                    "image_tokens": int(grid.prod()) // ip.merge_size ** 2, "jpeg_bytes": len(data),
                    "url": "data:image/jpeg;base64," + base64.b64encode(data).decode()})
    return out


def encoder_runs(url: str) -> float | None:
    """The vision encoder's runs so far as the server exposes them, or None."""
    base = url.removesuffix("/v1")
    found = None
    try:
        for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            if (not line.startswith("#") and "encoder" in name and "run" in name
                    and not name.endswith("_created")):
                found = (found or 0) + float(value)
    except (httpx.HTTPError, ValueError):
        pass
    if found is not None:
        return found

    def walk(node, path=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{path}.{k}")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            key = path.lower()
            if "encoder" in key and "run" in key:
                yield node
    try:
        values = list(walk(httpx.get(base + "/v1/kv_cache/stats", timeout=30).json()))
    except (httpx.HTTPError, ValueError):
        return None
    return sum(values) if values else None


def turn(url, history, use_cache, args, model=None, count_encoder=False) -> dict:
    """One streamed request; with ``count_encoder``, the encoder runs it caused."""
    before = encoder_runs(url) if count_encoder else None
    res = ask(url, history, use_cache, args.max_tokens, model=model)
    after = encoder_runs(url) if count_encoder else None
    res["encoder_runs"] = after - before if before is not None and after is not None else None
    return res


def chat(url, image: dict, turns: int, use_cache, args, model=None, count_encoder=False):
    """Turns 1..``turns`` about ``image``; returns each turn's record and turn 2's request."""
    history = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image["url"]}},
        {"type": "text", "text": QUESTIONS[0]}]}]
    records, turn2 = [], None
    for n in range(1, turns + 1):
        if n > 1:
            history = history + [{"role": "user", "content": QUESTIONS[n - 1]}]
        if n == 2:
            turn2 = list(history)
        res = turn(url, history, use_cache, args, model, count_encoder)
        records.append({"turn": n, **{k: res[k] for k in FIELDS}})
        history = history + [{"role": "assistant", "content": res["text"]}]
    return records, turn2


def again(url, turn2, use_cache, args, model=None, count_encoder=False) -> dict:
    """Turn 2 sent to a restarted server, with :data:`RESTART_QUESTION` for its question."""
    fresh = turn2[:-1] + [{"role": "user", "content": RESTART_QUESTION}]
    res = turn(url, fresh, use_cache, args, model, count_encoder)
    return {"turn": 2, "restarted": True, **{k: res[k] for k in FIELDS}}


def warm_up(url, args, model=None) -> None:
    ask(url, [{"role": "user", "content": "Hello."}], None, 2, model=model)


def run_ours(folder: Path, work: Path, images, args) -> dict:
    port, extra = free_port(), ["--model", str(folder)]
    runs = {}
    server = Server(work / "kv", port, extra)
    try:
        warm_up(server.url, args)
        for im in images:
            runs[im["key"]], im["turn2"] = chat(server.url, im, 4, True, args, count_encoder=True)
    finally:
        server.stop()
    server = Server(work / "kv", port, extra)
    try:
        warm_up(server.url, args)
        for im in images:
            runs[im["key"]].append(again(server.url, im.pop("turn2"), True, args,
                                         count_encoder=True))
    finally:
        server.stop()
    return runs


def run_mlx_vlm(python: str, folder: Path, work: Path, images, args) -> dict:
    port, runs, sent = free_port(), {}, {}
    for phase in ("warm", "restart"):
        peer = MlxVlmServer(python, folder, port, work)  # the same APC disk path both times
        try:
            warm_up(peer.url, args, peer.model)
            for im in images:
                if phase == "warm":
                    runs[im["key"]], sent[im["key"]] = chat(peer.url, im, 2, None, args,
                                                            peer.model)
                else:
                    runs[im["key"]].append(again(peer.url, sent[im["key"]], None, args,
                                                 peer.model))
        finally:
            peer.stop()
    return runs


def summarize(images, ours, peer) -> dict:
    summary = {}
    for im in images:
        o = {r["turn"] if not r.get("restarted") else "restart": r for r in ours[im["key"]]}
        row = {"picture": im["size"], "image_tokens": im["image_tokens"],
               "prompt_tokens": {f"turn{t}": o[t]["prompt_tokens"] for t in (1, 2, 3, 4)},
               "ours": {**{f"turn{t}_ttft_s": o[t]["ttft"] for t in (1, 2, 3, 4)},
                        "restart_turn2_ttft_s": o["restart"]["ttft"],
                        **{f"turn{t}_cached_tokens": o[t]["cached_tokens"] for t in (1, 2, 3, 4)},
                        "restart_turn2_cached_tokens": o["restart"]["cached_tokens"]},
               "turn2_over_turn1": o[2]["ttft"] / o[1]["ttft"],
               "restart_over_warm_turn2": o["restart"]["ttft"] / o[2]["ttft"]}
        runs = [o[t]["encoder_runs"] for t in (1, 2, 3, 4)]
        row["encoder_runs"] = {
            "turns_1_4": None if None in runs else sum(runs),
            "restart_turn2": o["restart"]["encoder_runs"]}
        if peer:
            p = {r["turn"] if not r.get("restarted") else "restart": r for r in peer[im["key"]]}
            row["mlx_vlm"] = {"turn1_ttft_s": p[1]["ttft"], "turn2_ttft_s": p[2]["ttft"],
                              "restart_turn2_ttft_s": p["restart"]["ttft"],
                              **{f"{k}_cached_tokens": p[t]["cached_tokens"]
                                 for k, t in (("turn1", 1), ("turn2", 2), ("restart_turn2",
                                                                          "restart"))}}
            row["turn2_over_mlxvlm_restart_turn2"] = o[2]["ttft"] / p["restart"]["ttft"]
            row["restart_turn2_over_mlxvlm_restart_turn2"] = (o["restart"]["ttft"]
                                                              / p["restart"]["ttft"])
        row["goals_met"] = {k: row[k] <= goal for k, goal in GOALS.items() if k in row}
        summary[im["key"]] = row
    return summary


def seconds(v: float | None) -> str:
    return f"{v:.3f} s" if v is not None else "-"


def table(summary: dict) -> str:
    lines = ["| picture | image tokens | ours turn 1 | ours turn 2 | ours turns 3-4 | "
             "ours restarted turn 2 | mlx-vlm turn 1 | mlx-vlm turn 2 | mlx-vlm restarted "
             "turn 2 | encoder runs (turns 1-4, restart) |", "|" + "---|" * 10]
    for row in summary.values():
        o, p, s = row["ours"], row.get("mlx_vlm", {}), seconds
        enc = row["encoder_runs"]
        lines.append(
            f"| {row['picture']} | {row['image_tokens']} | {s(o['turn1_ttft_s'])} | "
            f"{s(o['turn2_ttft_s'])} | {s(o['turn3_ttft_s'])}, {s(o['turn4_ttft_s'])} | "
            f"{s(o['restart_turn2_ttft_s'])} | {s(p.get('turn1_ttft_s'))} | "
            f"{s(p.get('turn2_ttft_s'))} | {s(p.get('restart_turn2_ttft_s'))} | "
            f"{'-' if enc['turns_1_4'] is None else enc['turns_1_4']}, "
            f"{'-' if enc['restart_turn2'] is None else enc['restart_turn2']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="language layers (of 36)")
    ap.add_argument("--vision-depth", type=int, default=4, help="vision blocks (of 32)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true",
                    help="the tiny Qwen2.5-VL and pictures of ~100 and ~400 image tokens")
    ap.add_argument("--mlx-vlm", metavar="PYTHON",
                    help="also run mlx-vlm's server (prefix cache on) with this interpreter")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    t0 = time.perf_counter()
    folder, model = build_model(args, work / "model")
    images = pictures(folder, QUICK_TARGETS if args.quick else TARGETS)
    for im in images:
        im["key"] = f"tokens_{im['target']}"
    print(f"model: {model}; pictures: "
          + ", ".join(f"{im['size']} ({im['image_tokens']} tokens)" for im in images), flush=True)
    ours = run_ours(folder, work, images, args)
    peer = run_mlx_vlm(args.mlx_vlm, folder, work, images, args) if args.mlx_vlm else None
    summary = summarize(images, ours, peer)
    report = {"model": model, "summary": summary, "goals": GOALS,
              "pictures": [{k: im[k] for k in ("key", "size", "image_tokens", "jpeg_bytes")}
                           for im in images],
              "raw": {"ours": ours, "mlx_vlm": peer},
              "settings": {**{k: str(v) for k, v in vars(args).items()},
                           "wall_s": round(time.perf_counter() - t0, 1)}}
    out = write("vision", json.dumps(report, indent=1), ".json", args.json)
    md = table(summary) + "\n" + json.dumps(
        {k: {g: v[g] for g in GOALS if g in v} for k, v in summary.items()}, indent=1) + "\n"
    write("vision", md, ".md", out.with_suffix(".md") if args.json else None)
    print(md)


if __name__ == "__main__":
    main()
