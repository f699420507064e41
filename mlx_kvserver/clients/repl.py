"""``mlx-kvchat`` / ``python -m mlx_kvserver.clients.repl``: a terminal chat on the KV-cached server.

With ``--url`` it talks to a running server; without, it loads the model(s) and serves them
in-process on a loopback port (same model and cache flags as ``mlx-kvserver``). Every turn sends
the whole conversation with the ``message_id`` of each message, so the server answers from its
KV cache; a status line after each answer shows time to first token, tokens/s, how many prompt
tokens came from the cache, tokens per decode forward pass and the drafts taken (speculative
decoding, where there were drafts). A thinking model's reasoning folds to a one-line summary
(``/reasoning`` shows it in full) and tool calls print as ``[tool call] name({...})``; both go
back to the server as it sent them. ``/image PATH`` attaches a picture to the next message (sent
as a data URL ``image_url`` part). Type ``/help`` for the commands.
"""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from ..chat.images import FORMATS, MEDIA_TYPES, decode_image
from ..errors import RequestError
from .client import ChatError, Client, Streamed, describe_error
from .repl_render import TurnPrinter, dim, draft_figures, reasoning_summary
from .stats_table import stats_table

HELP = """commands:
  /new           start a new conversation (the system prompt stays)
  /regen         drop the last answer and generate it again (your message's cache is reused)
  /fork          branch from here: keeps the history (and its server cache); /back returns here
  /back          leave the current branch: back to the point of the last /fork
  /system [TEXT] set the system prompt (no TEXT: clear it)
  /image [PATH]  attach an image file (PNG, JPEG, WebP, GIF) to the next message, for a model
                 that takes images; several may be attached; no PATH: list what is attached;
                 /image --clear drops them
  /reasoning     show a thinking model's reasoning in full (dimmed), or fold it to a one-line
                 summary (the default); showing it prints the last answer's reasoning too
  /stats         the server's KV cache (hits, tokens from cache, RAM and disk against their
                 budgets, evictions), speculative decoding (mode, drafts taken, tokens per
                 step) and this session's totals; /stats --json: the raw stats
  /help          this help
  /quit          leave (also Ctrl-D); Ctrl-C stops an answer"""

@dataclass(frozen=True)
class Attached:
    """An image file read for the next message: its path, size and the data URL sent."""

    path: str
    width: int
    height: int
    url: str

    def describe(self) -> str:
        return f"{self.path} ({self.width} x {self.height})"


def read_image(path: str) -> Attached:
    """The file at ``path`` checked to be an image as the server checks it (``decode_image``);
    ``ValueError`` with a message for a missing file or one that is not an image."""
    try:
        data = Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        raise ValueError(f"no such file: {path}") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        image = decode_image(data, path)
    except RequestError as e:
        raise ValueError(e.message) from None
    from PIL import Image as PILImage  # the file's format: its media type in the data URL

    with PILImage.open(io.BytesIO(data), formats=FORMATS) as im:
        media = dict(zip(FORMATS, MEDIA_TYPES))[im.format]
    return Attached(path, image.width, image.height,
                    f"data:{media};base64,{base64.b64encode(data).decode()}")


def user_content(text: str, images: list[Attached]) -> str | list[dict]:
    """A user message's content: the images as ``image_url`` parts, then the text; the text
    alone without images."""
    if not images:
        return text
    return [*({"type": "image_url", "image_url": {"url": a.url}} for a in images),
            {"type": "text", "text": text}]


class Conversation:
    """The messages of the current branch, each with its ``message_id``, and a stack of forks."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.forks: list[list[dict]] = []

    @staticmethod
    def new_id(role: str) -> str:
        return f"{role}-{uuid.uuid4().hex}"

    def add(self, role: str, content: str | list[dict], message_id: str | None = None) -> dict:
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
    answer: Streamed = field(default_factory=Streamed)
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
        self.show_reasoning = False
        self.images: list[Attached] = []  # for the next message
        self.color = self.out.isatty() and os.environ.get("TERM") != "dumb" \
            and "NO_COLOR" not in os.environ

    def say(self, text: str, dimmed: bool = False) -> None:
        self.out.write(dim(text, self.color and dimmed) + "\n")
        self.out.flush()

    def prompt(self) -> str:
        return f"[fork {len(self.conv.forks)}] >>> " if self.conv.forks else ">>> "

    def generate(self) -> Reply:
        """Stream an answer to the current messages; Ctrl-C stops it (partial answer kept)."""
        t0 = time.perf_counter()
        printer = TurnPrinter(self.out, self.color, self.show_reasoning)
        reply = Reply(printer.answer)
        stream = self.client.chat_stream(self.conv.messages, **self.params)
        try:
            for chunk in stream:
                reply.message_id = chunk.get("message_id") or reply.message_id
                reply.usage = chunk.get("usage") or reply.usage
                for choice in chunk.get("choices") or []:
                    printer.feed(choice.get("delta") or {})
        except KeyboardInterrupt:
            reply.interrupted = True
        finally:
            stream.close()
            t_end = time.perf_counter()
            printer.finish()
        n, t_first = reply.usage.get("completion_tokens", 0), printer.t_first
        if t_first is not None:  # decode rate: tokens after the first over the time they took
            reply.ttft = t_first - t0
            reply.rate = (n - 1) / (t_end - t_first) if n > 1 else None
        return reply

    def turn(self, restore: list[dict]) -> bool:
        """Answer the current messages; on an error (or a stop before any text) the
        conversation goes back to ``restore`` and the answer is False."""
        try:
            reply = self.generate()
        except (ChatError, httpx.HTTPError) as e:
            self.conv.messages = restore
            self.say(f"error: {e}" if isinstance(e, ChatError)
                     else f"error: cannot talk to {self.client.base_url}: {e}")
            return False
        answer = reply.answer
        if reply.interrupted:
            self.say("[stopped]", dimmed=True)
            if not (answer.text or answer.tool_calls):
                self.conv.messages = restore
                return False
        # as the server sent it: the next turn renders the same tokens (and hits the cache)
        self.conv.messages.append(answer.message(reply.message_id))
        if reply.usage:
            self.status(reply)
        return True

    def send(self, text: str) -> None:
        """A user message with the attached images; they stay attached when it fails."""
        before = list(self.conv.messages)
        self.conv.add("user", user_content(text, self.images))
        if self.turn(restore=before):
            self.images = []
        elif self.images:
            n = len(self.images)
            self.say(f"({n} image{'s' if n > 1 else ''} still attached: /image lists them, "
                     "/image --clear drops them)", dimmed=True)

    def image(self, arg: str) -> None:
        """``/image PATH`` attaches a file; ``/image`` lists; ``/image --clear`` drops all."""
        path = arg.strip()
        if len(path) > 1 and path[0] == path[-1] and path[0] in "'\"":
            path = path[1:-1]  # a quoted path (spaces are fine unquoted too)
        if path == "--clear":
            self.images = []
            self.say("no images attached")
        elif path:
            try:
                self.images.append(read_image(path))
            except ValueError as e:
                self.say(f"error: {e}")
                return
            self.say(f"attached {self.images[-1].describe()} to the next message "
                     f"({len(self.images)} attached)")
        elif self.images:
            self.say("attached to the next message:\n" + "\n".join(
                f"  {i}. {a.describe()}" for i, a in enumerate(self.images, 1)))
        else:
            self.say("no images attached (/image PATH attaches one)")

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
        parts = [f"ttft {ttft}", f"{rate} tok/s", f"{done} tokens",
                 f"cached {cached}/{prompt} prompt tokens", *draft_figures(u)]
        self.say(f"[{' | '.join(parts)}]", dimmed=True)

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

    def reasoning_toggle(self) -> None:
        self.show_reasoning = not self.show_reasoning
        self.say("reasoning: shown in full" if self.show_reasoning
                 else "reasoning: folded to a summary", dimmed=True)
        last = next((m for m in reversed(self.conv.messages) if m["role"] == "assistant"), None)
        if self.show_reasoning and last and last.get("reasoning_content"):
            thought = last["reasoning_content"]
            self.say(f"{reasoning_summary(thought, None)} of the last answer:", dimmed=True)
            printer = TurnPrinter(self.out, self.color, True)
            printer.write(thought, dimmed=True)
            printer.newline()

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
        elif name == "/image":
            self.image(arg)
        elif name == "/reasoning":
            self.reasoning_toggle()
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
                    self.send(line)
            except KeyboardInterrupt:  # e.g. during /stats; answers handle their own
                self.say("[stopped]", dimmed=True)


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
    from ..flags import build_parser

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

    from ..flags import config_from_args
    from ..platform.blas import blas_status
    from ..server import load_server

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    config.max_tokens = 512 if args.max_tokens is None else args.max_tokens
    config.temperature = args.temp or 0.0
    print(f"loading {', '.join(config.models)} (BLAS: {blas_status()}) ...", file=sys.stderr,
          flush=True)
    server = load_server(config)
    return server.start(args.log_level), server.stop


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    stop = None
    if args.url:
        url, model = args.url, (args.models or [None])[-1]
    else:
        if os.environ.get("MLX_KVSERVER_NO_BLAS") is None and args.no_fast_blas:
            os.environ["MLX_KVSERVER_NO_BLAS"] = "1"
        if argv is None:  # NOTE: sys.orig_argv keeps `-m mlx_kvserver.clients.repl` for the re-exec
            from ..platform import blas
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
    repl.say(f"mlx-kvchat: {where}. /help for commands, /quit or Ctrl-D to leave.", dimmed=True)
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
