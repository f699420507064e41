"""How the terminal chat prints a streamed answer: its reasoning (dimmed in full, or folded to a
one-line summary), its text as it comes, then its tool calls, one line each. Model output is
untrusted: control characters never reach the terminal."""

from __future__ import annotations

import json
import time
from typing import TextIO

from .client import Streamed

# C0/C1 control characters except tab and newline: never let model output drive the terminal.
_CONTROL = {c: "\ufffd" for c in (*range(0, 9), *range(11, 32), *range(127, 160))}


def dim(text: str, color: bool) -> str:
    return f"\x1b[2m{text}\x1b[0m" if color and text else text


def clean(text: str) -> str:
    return text.translate(_CONTROL)


def tool_call_line(call: dict) -> str:
    """``[tool call] name({...})``: the arguments as compact JSON (as sent when not JSON)."""
    fn = call.get("function") or {}
    args = fn.get("arguments") or ""
    try:
        args = json.dumps(json.loads(args), ensure_ascii=False)
    except ValueError:
        pass
    return clean(f"[tool call] {fn.get('name') or '?'}({args})")


def draft_figures(usage: dict) -> list[str]:
    """An answer's speculative decoding from its usage: tokens per decode forward pass
    (``completion_tokens / decode_steps``: the first token comes from the prompt's pass, and the
    end token, not counted, from the last decode pass, so an answer that ends on its own reads
    1.00 without drafts), and the drafts taken where there were drafts."""
    steps, done = usage.get("decode_steps") or 0, usage.get("completion_tokens") or 0
    details = usage.get("completion_tokens_details") or {}
    taken = details.get("accepted_draft_tokens") or 0  # the server's drafts, every source
    drafted = taken + (details.get("rejected_draft_tokens") or 0)
    out = [f"{done / steps:.2f} tok/pass"] if steps > 0 else []
    return out + ([f"drafts: {taken} of {drafted} taken"] if drafted else [])


def reasoning_summary(reasoning: str, seconds: float | None) -> str:
    took = f", {seconds:.1f}s" if seconds is not None else ""
    return f"[reasoning: {len(reasoning)} chars{took}]"


class TurnPrinter:
    """Feed it the deltas of one answer (:meth:`feed`), then :meth:`finish`. With
    ``show_reasoning`` the reasoning streams dimmed under a ``[reasoning]`` line; otherwise a
    terminal shows ``[reasoning…]`` while it streams, and a one-line summary replaces it when the
    answer starts (piped output gets the summary alone)."""

    def __init__(self, out: TextIO, color: bool, show_reasoning: bool):
        self.out, self.color, self.show = out, color, show_reasoning
        self.answer = Streamed()
        self.t_first: float | None = None  # the first token of any kind (reasoning included)
        self.t_reasoning: float | None = None
        self.reasoning_s: float | None = None
        self.at_line_start = True

    def write(self, text: str, dimmed: bool = False, raw: bool = False) -> None:
        if not text:
            return
        self.out.write(dim(text if raw else clean(text), self.color and dimmed))
        self.out.flush()
        self.at_line_start = text.endswith("\n") or text.endswith("\r\x1b[K")

    def newline(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def feed(self, delta: dict) -> None:
        now = time.perf_counter()
        before = len(self.answer.reasoning), len(self.answer.text), len(self.answer.tool_calls)
        self.answer.add(delta)
        thought = self.answer.reasoning[before[0]:]
        text = self.answer.text[before[1]:]
        calls = delta.get("tool_calls") or len(self.answer.tool_calls) > before[2]
        if thought or text or calls:
            self.t_first = self.t_first or now
        if thought:
            if self.t_reasoning is None:
                self.t_reasoning = now
                if self.show:
                    self.write("[reasoning]\n", dimmed=True)
                elif self.color:  # a terminal: a placeholder the summary overwrites
                    self.write("[reasoning…]", dimmed=True)
            if self.show:
                self.write(thought, dimmed=True)
        if text or calls:
            self.end_reasoning(now)
        self.write(text)

    def end_reasoning(self, now: float) -> None:
        """Once, when the answer (or a tool call, or the end) comes after the reasoning."""
        if self.t_reasoning is None or self.reasoning_s is not None:
            return
        self.reasoning_s = now - self.t_reasoning
        if self.show:
            self.newline()
            return
        if self.color:
            self.write("\r\x1b[K", raw=True)
        self.write(reasoning_summary(self.answer.reasoning, self.reasoning_s)
                   + " /reasoning shows it\n", dimmed=True)

    def finish(self) -> None:
        """After the stream (or a Ctrl-C): the summary if still due, then the tool calls."""
        self.end_reasoning(time.perf_counter())
        self.newline()
        for call in self.answer.tool_calls:
            self.write(tool_call_line(call) + "\n")
