"""The server's KV-cache stats (``GET /v1/kv_cache/stats``) as a short table for a terminal: one
column per model, a row each for hits, tokens from the cache, RAM and disk use against their
budgets, entries and evictions, and speculative decoding (the mode, the draft tokens taken of
those verified, the tokens each decode forward pass produced)."""

from __future__ import annotations

from typing import Any


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def against(used: float | None, budget: float | None) -> str:
    if used is None:
        return "-"
    share = f" ({100 * used / budget:.1f}%)" if budget else ""
    return f"{human_bytes(used)} of {human_bytes(budget)}{share}"


def model_column(s: dict[str, Any]) -> list[str]:
    ram, disk = s.get("ram") or {}, s.get("disk")
    hits, misses = s.get("hits", 0), s.get("misses", 0)
    from_disk = f" ({s['disk_hits']} from disk)" if s.get("disk_hits") else ""
    return [
        f"{hits} of {hits + misses} lookups{from_disk}",
        f"{s.get('tokens_served', 0):,}",
        against(ram.get("bytes"), ram.get("budget_bytes")),
        f"{ram.get('entries', 0)}, {human_bytes(ram.get('bytes_shared'))} shared",
        against(disk.get("bytes_on_disk"), disk.get("budget")) if disk else "off",
        f"{disk.get('entries', 0)}" if disk else "-",
        f"{ram.get('evictions', 0)} pages / " + (f"{disk.get('evictions', 0)} entries"
                                                  if disk else "-"),
        *speculation_cells(s.get("speculation")),
    ]


def speculation_cells(spec: Any) -> list[str]:
    """The mode; draft tokens taken of those verified (the acceptance rate); tokens per decode
    step, one forward pass (the whole batch's tokens, after each answer's first). "-" from a
    server that does not say."""
    if not isinstance(spec, dict):
        return ["-", "-", "-"]
    drafted, accepted = spec.get("drafted", 0), spec.get("accepted", 0)
    steps, tokens = spec.get("decode_steps", 0), spec.get("tokens", 0)
    return [str(spec.get("mode", "-")),
            f"{accepted:,} of {drafted:,} ({100 * accepted / drafted:.1f}%)" if drafted
            else "none",
            f"{tokens / steps:.2f} ({tokens:,} tokens in {steps:,} passes)" if steps else "-"]


ROWS = ("cache hits", "tokens from cache", "RAM used", "RAM entries", "disk used",
        "disk entries", "evictions RAM / disk", "speculation", "drafts taken",
        "tokens per step")


def stats_table(body: Any) -> str:
    """The table for a ``/v1/kv_cache/stats`` answer; anything else as ``key: value`` lines."""
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        if isinstance(body, dict):
            return "\n".join(f"  {k}: {v}" for k, v in body.items())
        return f"  {body}"
    if not models:
        return "  (no models)"
    columns = [[name, *model_column(s)] for name, s in models.items()]
    labels = ["", *ROWS]
    widths = [max(map(len, col)) for col in columns]
    label_width = max(map(len, labels))
    lines = []
    for i, label in enumerate(labels):
        cells = "  ".join(col[i].ljust(w) for col, w in zip(columns, widths))
        lines.append(f"  {label.ljust(label_width)}  {cells}".rstrip())
    return "\n".join(lines)
