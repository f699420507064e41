"""Which files one cached request runs through: a turn of a chat whose history is cached.

Serves a tiny random-weight model in-process, sends a first turn, then profiles the second
turn (every thread) and lists the project's files whose functions it called, in the order each
was first entered, split into the library (``kv_cache/``) and the server (``mlx_kvserver/``).
``docs/ARCHITECTURE.md`` ("The path of a request") is this list, explained.

Usage: .venv/bin/python -m scripts.request_path [--from-disk]
  --from-disk   restart the server on the same cache folder before the second turn (the
                history restored from disk rather than found in memory)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import openai

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import resolve_and_load
from harness.server_utils import running_server
from harness.tiny_model import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent

HISTORY = "Tell me about the harbour town: its streets, its boats and its market. " * 12


class Tracer:
    """Records the project files whose functions any thread enters while ``on``; installed
    before the server's threads start (Python 3.11 cannot hook threads already running)."""

    def __init__(self):
        self.on = False
        self.seen: dict[str, None] = {}
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def hook(self, frame, event, arg):
        if self.on and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(str(ROOT)) and "/tests/" not in f and "/scripts/" not in f:
                self.seen.setdefault(str(Path(f).relative_to(ROOT)), None)

    def run(self, fn) -> list[str]:
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return list(self.seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-disk", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_tiny_model_dir(model_dir)
        lm = resolve_and_load(str(model_dir))
        config = ServerConfig(kv_cache_dir=Path(tmp) / "kv", page_size=8)
        msgs = [{"role": "user", "content": HISTORY}]

        def ask(url: str) -> str:
            client = openai.OpenAI(base_url=url, api_key="x")
            r = client.chat.completions.create(model=lm.name, messages=msgs, max_tokens=8,
                                               temperature=0)
            return r.choices[0].message.content or ""

        tracer = Tracer()
        with running_server([lm], config) as url:
            msgs.append({"role": "assistant", "content": ask(url)})
            msgs.append({"role": "user", "content": "And the market?"})
            if not args.from_disk:
                files = tracer.run(lambda: ask(url))
        if args.from_disk:
            with running_server([resolve_and_load(str(model_dir))], config) as url:
                files = tracer.run(lambda: ask(url))
    lib = [f for f in files if f.startswith("kv_cache/")]
    server = [f for f in files if f.startswith("mlx_kvserver/")]
    print(f"kv_cache ({len(lib)} files): " + ", ".join(lib))
    print(f"mlx_kvserver ({len(server)} files): " + ", ".join(server))


if __name__ == "__main__":
    main()
