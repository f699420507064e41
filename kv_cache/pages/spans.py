"""Image spans: where a prompt's images sit among its tokens, and what they mean for a reuse.

A vision-language model replaces an image's placeholder tokens by the image's features, so the
token ids alone do not say what those positions hold: two prompts with the same ids and
different images have different keys and values there and after. A ``Span`` says that the
``length`` positions from ``start`` hold the image whose identity (a hash of its pixels) is
``image``. Spans go into the page hashes (``kv_cache.pages.hashing``: each page's extra keys,
``page_extras``), and a reuse holds only as far as the stored spans and the prompt's agree
(``agree``), never ending inside an image (its tokens are never split between reused and new).
A text prompt has no spans, and everything about it is as without them.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

Extra = tuple[str, int, int]  # a page's extra key: (image, page start - span start, length)


class Span(NamedTuple):
    """An image's tokens: ``length`` positions from ``start`` hold image ``image``."""

    start: int
    length: int
    image: str

    @property
    def end(self) -> int:
        return self.start + self.length


def as_spans(spans: Iterable[Sequence] = ()) -> tuple[Span, ...]:
    """``spans`` (``Span``s or ``(start, length, image)`` triples) checked and in order of
    start; ``ValueError`` for one that is malformed or overlaps another."""
    out = []
    for s in spans:
        if isinstance(s, Span):
            out.append(s)
            continue
        if not isinstance(s, (tuple, list)) or len(s) != 3:
            raise ValueError(f"an image span is (start, length, image): {s!r}")
        start, length, image = s
        out.append(Span(start, length, image))
    out.sort()
    for s in out:
        if type(s.start) is not int or type(s.length) is not int or s.start < 0 \
                or s.length <= 0 or not isinstance(s.image, str) or not s.image:
            raise ValueError(f"an image span is a start >= 0, a length > 0 and an image hash: "
                             f"{tuple(s)!r}")
    for a, b in zip(out, out[1:]):
        if b.start < a.end:
            raise ValueError(f"image spans overlap: {tuple(a)!r} and {tuple(b)!r}")
    return tuple(out)


def before(spans: Sequence[Span], n: int) -> tuple[Span, ...]:
    """The spans that begin before position ``n`` (whole: one may reach past ``n``)."""
    return tuple(s for s in spans if s.start < n)


def outside(n: int, spans: Sequence[Span]) -> int:
    """``n``, or the start of the span it falls inside (a reuse of ``n`` positions would split
    that image's tokens)."""
    for s in spans:
        if s.start < n < s.end:
            return s.start
    return n


def agree(n: int, a: Sequence[Span], b: Sequence[Span]) -> int:
    """The longest reuse up to ``n`` positions between two sequences with spans ``a`` and
    ``b`` (whose first ``n`` token ids agree): up to the first span that begins before ``n`` in
    one and not, the same, in the other, and never inside a span of either."""
    sa, sb = set(before(a, n)), set(before(b, n))
    for s in sa ^ sb:
        n = min(n, s.start)
    while True:
        m = outside(outside(n, a), b)
        if m == n:
            return n
        n = m


def page_extras(spans: Sequence[Span], start: int, n: int) -> tuple[Extra, ...]:
    """The extra keys of the page whose ``n`` positions begin at ``start``: per span it
    overlaps, ``(image, start - span start, length)`` (the offset into the image at the page's
    start, negative where the image begins inside the page). Empty for a text page."""
    return tuple((s.image, start - s.start, s.length) for s in spans
                 if s.start < start + n and start < s.end)


def head_extras(extras: Sequence[Extra], n: int) -> tuple[Extra, ...]:
    """The extra keys of a page's first ``n`` positions, from the page's ``extras``."""
    return tuple(e for e in extras if -e[1] < n)


def extras_agree(n: int, a: Sequence[Extra], b: Sequence[Extra]) -> int:
    """``agree`` for the first ``n`` positions of two pages (that start at one position) with
    extra keys ``a`` and ``b``."""
    return agree(n, _relative(a), _relative(b))


def _relative(extras: Sequence[Extra]) -> list[Span]:
    """A page's extra keys as spans counted from the page's start (a start may be negative)."""
    return [Span(-offset, length, image) for image, offset, length in extras]
