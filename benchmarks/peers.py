"""The peer servers benchmarks/agent.py runs the same session against, on the same model folder.

  mlx-lm     ``python -m mlx_lm.server`` from this interpreter (its own in-memory prompt cache;
             nothing kept across a restart)
  rapid-mlx  ``rapid-mlx serve`` (its in-memory prefix cache, written to disk at shutdown within
             a 3.5 s budget by default and read back at start)
  vllm-mlx   ``vllm-mlx serve --continuous-batching`` (its in-memory prefix cache, which needs
             the batching engine, written to disk at shutdown and read back at start)

Rapid-MLX and vllm-mlx pin their own mlx-lm (< 0.32), so they run from their own virtual
environment: install each one there (on Linux with ``mlx[cpu]``) and pass its executable with
``--peer-bin``, e.g. ``python3 -m venv /tmp/peers/rapid-venv && /tmp/peers/rapid-venv/bin/pip
install rapid-mlx 'mlx[cpu]'``. Each gets HOME in the benchmark's work folder (where both keep
their prefix-cache snapshots: a fresh one per run, kept across the restart), no telemetry, no
downloads, no version check, and the same BLAS environment as this server (inherited).

Both write one line a request, ``[cache_fetch] request=... HIT prompt_tokens=N cached=M`` (or
MISS): the benchmark takes the cached count from there when the answer's usage has none
(vllm-mlx reports no cached tokens) and the lines saying how many entries were saved and loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.multiturn import MlxLmServer
from benchmarks.ttft import ROOT, Server, wait_until_up

PEERS = ("mlx-lm", "rapid-mlx", "vllm-mlx")
CACHE_FETCH = re.compile(r"\[cache_fetch\] request=\S+ (HIT|MISS) prompt_tokens=(\d+)"
                         r"(?: cached=(\d+))?")
# Rapid-MLX reads its snapshot back after it says it is ready: each start waits for the end of
# that read (or its refusal), so that no turn races it.
LOAD_DONE = re.compile(r"\[cache_persist\] (?:LOADED|no index|refusing|unsupported|index\.json"
                       r"|mlx_lm not)|Failed to load cache|skipping automatic load")
PERSIST = re.compile(r"\[cache_persist\] ((?:SAVED|LOADED) \d+(?:/\d+)? entries.*?)"
                     r"(?: to | from )\S+ (in [\d.]+s \(\d+MB total\))")


class CliPeer(Server):
    """Rapid-MLX's or vllm-mlx's server as a subprocess on ``folder``."""

    def __init__(self, name: str, exe: str, folder: Path, port: int, workdir: Path,
                 timeout: float):
        self.name, self.model = name, str(folder)
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log = open(workdir / f"{name}-{port}-{time.time_ns()}.log", "w")  # noqa: SIM115
        home = workdir / f"{name}-home"  # its prefix-cache snapshot lives under ~/.cache
        home.mkdir(exist_ok=True)
        env = dict(os.environ, HOME=str(home), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   RAPID_MLX_TELEMETRY="0", RAPID_MLX_DISABLE_VERSION_CHECK="1",
                   RAPID_MLX_DISABLE_MODEL_DOWNLOADS="1")
        common = ["--host", "127.0.0.1", "--port", str(port), "--timeout", str(int(timeout))]
        if name == "rapid-mlx":
            cmd = [exe, "--no-telemetry", "--no-banner", "serve", self.model, *common]
        else:
            cmd = [exe, "serve", self.model, *common, "--continuous-batching", "--offline",
                   "--max-request-tokens", str(context_of(folder))]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        up: list[float] = []  # when it first answered

        def loaded() -> bool:  # Rapid-MLX loads its saved cache after it answers
            up.append(time.monotonic())
            return name != "rapid-mlx" or up[-1] - up[0] > 120 or bool(LOAD_DONE.search(
                Path(self.log.name).read_text(encoding="utf-8", errors="replace")))

        wait_until_up(self.proc, self.url + "/models", self.log.name, name, 600, loaded)


def context_of(folder: Path) -> int:
    try:
        return int(json.loads((folder / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return 65536


def peer_exe(name: str, given: str | None) -> str:
    """The peer's executable: ``given``, else on PATH; exits with how to install it."""
    exe = given or shutil.which(name)
    if not exe or not Path(exe).exists():
        raise SystemExit(f"--peer {name}: no executable (give --peer-bin); install it in its own "
                         f"venv: python3 -m venv /tmp/peers/{name} && /tmp/peers/{name}/bin/pip "
                         f"install {name} 'mlx[cpu]'")
    return exe


def start_peer(name: str, exe: str | None, folder: Path, port: int, workdir: Path,
               timeout: float):
    if name == "mlx-lm":
        return MlxLmServer(folder, port, workdir)
    return CliPeer(name, exe, folder, port, workdir, timeout)


def fetch_line(server, offset: int) -> tuple[str | None, int | None]:
    """The peer's own cache lookup for the last request after ``offset``: ("hit"/"miss",
    cached tokens), or (None, None) for a peer that logs none (mlx-lm)."""
    if not isinstance(server, CliPeer):
        return None, None
    with open(server.log.name, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        found = CACHE_FETCH.findall(f.read())
    if not found:
        return None, None
    kind, _, cached = found[-1]
    return kind.lower(), int(cached or 0)


def persist_lines(server) -> list[str]:
    """What the peer said it saved to and loaded from disk (its log so far)."""
    if not isinstance(server, CliPeer):
        return []
    with open(server.log.name, encoding="utf-8", errors="replace") as f:
        return [" ".join(m) for m in PERSIST.findall(f.read())]


def peer_body(body: dict, inline: bool, model: str | None) -> dict:
    """The OpenAI body for a peer: the model as the peer names it (none for mlx-lm, which would
    load another), and with ``inline`` the tools, calls and results as text, as this server's
    fallback renders them."""
    from mlx_kvserver.chat.conversation import Tool, ToolCall
    from mlx_kvserver.chat.render import fallback_call, tools_block

    out = {k: v for k, v in body.items() if k != "model"}
    if model:
        out["model"] = model
    if not inline:
        return out
    tools = [Tool(f["name"], f.get("description", ""), f["parameters"])
             for f in (t["function"] for t in body.get("tools", []))]
    msgs: list[dict] = []
    for m in body["messages"]:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if msgs and msgs[-1].get("_result"):
                msgs[-1]["content"] += "\n" + text
            else:
                msgs.append({"role": "user", "content": text, "_result": True})
        elif m.get("tool_calls"):
            calls = "\n".join(fallback_call(ToolCall(c["id"], c["function"]["name"],
                                                      c["function"]["arguments"]))
                               for c in m["tool_calls"])
            msgs.append({"role": "assistant", "content": f"{m['content']}\n{calls}"
                         if m.get("content") else calls})
        else:
            msgs.append(dict(m))
    if tools:
        block = tools_block(tools)
        msgs[0] = {**msgs[0], "content": f"{block}\n\n{msgs[0]['content']}"}
    out["messages"] = [{k: v for k, v in m.items() if k != "_result"} for m in msgs]
    out.pop("tools", None)
    out.pop("tool_choice", None)
    return out
