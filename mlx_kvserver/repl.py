"""``mlx-kvchat`` / ``python -m mlx_kvserver.repl``: a terminal chat on the KV-cached server.

With ``--url`` it talks to a running server; without, it loads the model(s) and serves them
in-process on a loopback port (same model and cache flags as ``mlx-kvserver``). Every turn sends
the whole conversation with the ``message_id`` of each message, so the server answers from its
KV cache; a status line after each answer shows time to first token, tokens/s and how many prompt
tokens came from the cache. Type ``/help`` for the commands.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlparse

import httpx

from .stats_table import stats_table

HELP = """commands:
  /new           start a new conversation (the system prompt stays)
  /regen         drop the last answer and generate it again (your message's cache is reused)
  /fork          branch from here: keeps the history (and its server cache); /back returns here
  /back          leave the current branch: back to the point of the last /fork
  /system [TEXT] set the system prompt (no TEXT: clear it)
  /stats         the server's KV cache (hits, tokens from cache, RAM and disk against their
                 budgets, evictions) and this session's totals; /stats --json: the raw stats
  /help          this help
  /quit          leave (also Ctrl-D); Ctrl-C stops an answer"""

# C0/C1 control characters except tab and newline: never let model output drive the terminal.
_CONTROL = {c: "\ufffd" for c in (*range(0, 9), *range(11, 32), *range(127, 160))}


class ChatError(Exception):
    """Something the user should read: an HTTP error from the server or a broken stream."""


def parse_sse(lines: Iterable[str]) -> Iterator[dict]:
    """JSON payloads of the ``data:`` events in SSE lines; stops at ``[DONE]``. An event that
    carries ``{"error": ...}`` raises :class:`ChatError`."""
    data: list[str] = []

    def dispatch() -> Any:
        payload = "\n".join(data)
        data.clear()
        if payload.strip() == "[DONE]":
            return None
        try:
            event = json.loads(payload)
        except ValueError:
            raise ChatError(f"the server sent a malformed event: {payload[:200]!r}")
        if isinstance(event, dict) and "error" in event:
            raise ChatError(describe_error(event))
        return event

    for line in lines:
        if line == "":
            if data:
                if (event := dispatch()) is None:
                    return
                yield event
        elif not line.startswith(":"):  # ':' starts a comment (keep-alive)
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if data and (event := dispatch()) is not None:
        yield event


def describe_error(body: Any, status: int | None = None) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    head = f"HTTP {status}" if status else "server error"
    if isinstance(err, dict):
        kind = f" {err['type']}" if err.get("type") else ""
        return f"{head}{kind}: {err.get('message', err)}"
    return f"{head}: {str(body)[:500]}"


class Client:
    """A small OpenAI-style client over httpx for the chat server (base URL ends with /v1)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None):
        base = base_url.rstrip("/")
        if urlparse(base).path in ("", "/"):
            base += "/v1"
        self.base_url, self.model = base, model
        self.root = base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers,
                                 timeout=httpx.Timeout(30.0, read=600.0, write=60.0))

    def close(self) -> None:
        self.http.close()

    def get(self, url: str) -> tuple[int, Any]:
        r = self.http.get(url)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def chat_stream(self, messages: list[dict], **params: Any) -> Iterator[dict]:
        """Stream a chat completion: yields the chunks; raises :class:`ChatError` on an HTTP
        error. Closing the generator closes the connection (the server cancels generation)."""
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                **{k: v for k, v in params.items() if v is not None}}
        if self.model:
            body["model"] = self.model
        with self.http.stream("POST", f"{self.base_url}/chat/completions", json=body) as r:
            if r.status_code >= 400:
                r.read()
                try:
                    body = r.json()
                except ValueError:
                    body = r.text
                raise ChatError(describe_error(body, r.status_code))
            yield from parse_sse(r.iter_lines())


class Conversation:
    """The messages of the current branch, each with its ``message_id``, and a stack of forks."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.forks: list[list[dict]] = []

    @staticmethod
    def new_id(role: str) -> str:
        return f"{role}-{uuid.uuid4().hex}"

    def add(self, role: str, content: str, message_id: str | None = None) -> dict:
        m = {"role": role, "content": content}
        if message_id := message_id or (None if role == "assistant" else self.new_id(role)):
            m["message_id"] = message_id
        self.messages.append(m)
        return m

    def new(self) -> None:
        """Forget the conversation and its forks; the system prompt stays."""
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self.forks.clear()

    def set_system(self, text: str) -> None:
        if self.messages and self.messages[0]["role"] == "system":
            self.messages.pop(0)
        if text:  # a new text is a new message: a new id
            self.messages.insert(0, {"role": "system", "content": text,
                                     "message_id": self.new_id("system")})

    def drop_answer(self) -> bool:
        """For /regen: drop a trailing answer; True when a user message is left to answer."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def fork(self) -> int:
        """Push the current point; this branch goes on from the same messages (and their
        cached KV). Returns the new depth."""
        self.forks.append(list(self.messages))
        return len(self.forks)

    def back(self) -> bool:
        """Return to the point of the last fork; False when there is none."""
        if not self.forks:
            return False
        self.messages = self.forks.pop()
        return True


@dataclass
class Reply:
    text: str = ""
    message_id: str | None = None
    usage: dict = field(default_factory=dict)
    ttft: float | None = None
    rate: float | None = None
    interrupted: bool = False


class Repl:
    def __init__(self, client: Client, params: dict, out=None):
        self.client, self.params = client, params
        self.out = out or sys.stdout
        self.conv = Conversation()
        self.totals = {"turns": 0, "prompt": 0, "cached": 0, "completion": 0}
        self.ttfts: list[float] = []
        self.color = self.out.isatty() and os.environ.get("TERM") != "dumb" \
            and "NO_COLOR" not in os.environ

    def say(self, text: str, dim: bool = False) -> None:
        if dim and self.color:
            text = f"\x1b[2m{text}\x1b[0m"
        self.out.write(text + "\n")
        self.out.flush()

    def prompt(self) -> str:
        return f"[fork {len(self.conv.forks)}] >>> " if self.conv.forks else ">>> "

    def generate(self) -> Reply:
        """Stream an answer to the current messages; Ctrl-C stops it (partial answer kept)."""
        reply, t0 = Reply(), time.perf_counter()
        t_first = None
        stream = self.client.chat_stream(self.conv.messages, **self.params)
        try:
            for chunk in stream:
                reply.message_id = chunk.get("message_id") or reply.message_id
                reply.usage = chunk.get("usage") or reply.usage
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        t_first = t_first or time.perf_counter()
                        reply.text += text
                        self.out.write(text.translate(_CONTROL))
                        self.out.flush()
        except KeyboardInterrupt:
            reply.interrupted = True
        finally:
            stream.close()
            t_end = time.perf_counter()
            if reply.text and not reply.text.endswith("\n"):
                self.out.write("\n")
        n = reply.usage.get("completion_tokens", 0)
        if t_first is not None:  # decode rate: tokens after the first over the time they took
            reply.ttft = t_first - t0
            reply.rate = (n - 1) / (t_end - t_first) if n > 1 else None
        return reply

    def turn(self, restore: list[dict]) -> None:
        """Answer the current messages; on an error (or a stop before any text) the
        conversation goes back to ``restore``."""
        try:
            reply = self.generate()
        except (ChatError, httpx.HTTPError) as e:
            self.conv.messages = restore
            self.say(f"error: {e}" if isinstance(e, ChatError)
                     else f"error: cannot talk to {self.client.base_url}: {e}")
            return
        if reply.interrupted:
            self.say("[stopped]", dim=True)
            if not reply.text:
                self.conv.messages = restore
                return
        self.conv.add("assistant", reply.text, reply.message_id)
        if reply.usage:
            self.status(reply)

    def status(self, reply: Reply) -> None:
        u = reply.usage
        prompt, done = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        for k, v in (("turns", 1), ("prompt", prompt), ("cached", cached), ("completion", done)):
            self.totals[k] += v
        if reply.ttft is not None:
            self.ttfts.append(reply.ttft)
        ttft = f"{reply.ttft:.3f}s" if reply.ttft is not None else "-"
        rate = f"{reply.rate:.1f}" if reply.rate is not None else "-"
        self.say(f"[ttft {ttft} | {rate} tok/s | {done} tokens | "
                 f"cached {cached}/{prompt} prompt tokens]", dim=True)

    def stats(self, raw: bool = False) -> None:
        try:
            code, body = self.client.get(f"{self.client.base_url}/kv_cache/stats")
            if code == 404:
                code, body = self.client.get(f"{self.client.root}/health")
                self.say("server /health (this server has no /v1/kv_cache/stats):")
            else:
                self.say("server KV cache (/v1/kv_cache/stats):")
            if code >= 400:
                self.say(describe_error(body, code))
            else:
                self.say(json.dumps(body, indent=2) if raw else stats_table(body))
        except httpx.HTTPError as e:
            self.say(f"error: cannot talk to {self.client.root}: {e}")
        t = self.totals
        share = f" ({100 * t['cached'] / t['prompt']:.0f}%)" if t["prompt"] else ""
        ttft = f", median ttft {statistics.median(self.ttfts):.3f}s" if self.ttfts else ""
        self.say(f"session: {t['turns']} turns, {t['prompt']} prompt tokens, {t['cached']} "
                 f"from cache{share}, {t['completion']} completion tokens{ttft}")

    def command(self, line: str) -> bool:
        """Run one /command; False means quit."""
        name, _, arg = line.partition(" ")
        conv = self.conv
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/new":
            conv.new()
            self.say("new conversation")
        elif name == "/regen":
            before = list(conv.messages)
            if conv.drop_answer():
                self.turn(restore=before)
            else:
                self.say("nothing to regenerate")
        elif name == "/fork":
            depth = conv.fork()
            self.say(f"forked after {len(conv.messages)} messages (depth {depth}): this branch "
                     "reuses their cache; /back returns here")
        elif name == "/back":
            self.say(f"back at the fork point ({len(conv.messages)} messages)" if conv.back()
                     else "no fork to go back to")
        elif name == "/system":
            conv.set_system(arg.strip())
            self.say("system prompt set" if arg.strip() else "system prompt cleared")
        elif name == "/stats":
            if arg.strip() in ("", "--json"):
                self.stats(raw=arg.strip() == "--json")
            else:
                self.say("usage: /stats [--json]")
        else:
            if name != "/help":
                self.say(f"unknown command {name}")
            self.say(HELP)
        return True

    def run(self, read_line: Callable[[str], str]) -> None:
        while True:
            try:
                line = read_line(self.prompt()).strip()
            except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line
                continue
            except EOFError:
                break
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        break
                elif line:
                    before = list(self.conv.messages)
                    self.conv.add("user", line)
                    self.turn(restore=before)
            except KeyboardInterrupt:  # e.g. during /stats; answers handle their own
                self.say("[stopped]", dim=True)


def line_reader(args) -> Callable[[str], str]:
    """prompt_toolkit with history on a terminal; plain lines when piped (scriptable)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        def plain(_prompt: str) -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line
        return plain
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(args.history or Path(cache) / "mlx-kvserver" / "chat_history").expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.open("a").close()
        history = FileHistory(str(path))
    except OSError as e:
        print(f"note: history not saved ({path}: {e})", file=sys.stderr)
        history = InMemoryHistory()
    return PromptSession(history=history).prompt


def build_arg_parser():
    from .cli import build_parser

    p = build_parser()
    p.prog = "mlx-kvchat"
    p.description = ("Terminal chat with the KV-cached MLX server: with --url, talk to a running "
                     "server (--model names the model); otherwise serve --model in-process.")
    p.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--history", default=os.environ.get("MLX_KVCHAT_HISTORY"),
                   help="input history file (env MLX_KVCHAT_HISTORY; default "
                        "~/.cache/mlx-kvserver/chat_history)")
    # NOTE: None = the server's default (sent only when given); port 0 = a free port.
    p.set_defaults(port=0, log_level="warning", max_tokens=None, temp=None)
    return p


def start_server(args):
    """Load the models and serve them on a loopback thread; returns (base URL, stop)."""
    import logging
    import socket
    import threading

    import uvicorn

    from .api import build_app
    from .blas import blas_status
    from .cli import config_from_args, load_engine

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    config.max_tokens = 512 if args.max_tokens is None else args.max_tokens
    config.temperature = args.temp or 0.0
    print(f"loading {', '.join(config.models)} (BLAS: {blas_status()}) ...", file=sys.stderr,
          flush=True)
    registry, engine = load_engine(config)
    app = build_app(config, registry, engine)
    # NOTE: with the protocol given, asyncio sets TCP_NODELAY on accepted connections (with
    # proto 0 it does not, and Nagle + delayed ACKs add ~40 ms to every response and chunk).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level.lower(), lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the in-process server failed to start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}/v1", stop


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    stop = None
    if args.url:
        url, model = args.url, (args.models or [None])[-1]
    else:
        if os.environ.get("MLX_KVSERVER_NO_BLAS") is None and args.no_fast_blas:
            os.environ["MLX_KVSERVER_NO_BLAS"] = "1"
        if argv is None:  # NOTE: sys.orig_argv keeps `-m mlx_kvserver.repl` for the re-exec
            from . import blas
            blas.maybe_reexec()
        try:
            url, stop = start_server(args)
        except KeyboardInterrupt:
            return 130
        except (OSError, ValueError) as e:  # a missing model, a bad spec, a taken port
            print(f"mlx-kvchat: cannot start the server: {e}", file=sys.stderr)
            return 1
        model = None
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    client = Client(url, args.api_key, model)
    repl = Repl(client, {"max_tokens": args.max_tokens, "temperature": args.temp})
    try:
        code, body = client.get(f"{client.base_url}/models")
        names = [m["id"] for m in body["data"]] if code == 200 else []
        where = f"{client.base_url} ({', '.join(names)})" if code == 200 \
            else f"{client.base_url} - {describe_error(body, code)}"
    except (httpx.HTTPError, KeyError, TypeError) as e:
        where = f"{client.base_url} - not reachable yet: {e}"
    repl.say(f"mlx-kvchat: {where}. /help for commands, /quit or Ctrl-D to leave.", dim=True)
    try:
        repl.run(line_reader(args))
    except BrokenPipeError:  # piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        client.close()
        if stop is not None:
            stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
