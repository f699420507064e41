"""Figures that cannot drift: every result the README and the benchmark report quote, checked
against the raw file it comes from.

A claim is listed once in ``benchmarks/claims.toml``::

    [[claim]]
    id = "ttft.warm.ours"                                   # what the text names it by
    file = "benchmarks/results/ttft/20261128-195232.json"   # a kept run's raw result
    value = "summary.ours.warm_median_s"                    # a dotted path into the JSON
    format = "{:.2f} s"                                     # how the text writes it

or computed from several fields: ``value = "a / b"`` with ``[claim.fields]`` naming each path
(``+ - * /``, parentheses and numbers only). The text writes the figure followed at once by an
HTML comment naming the claim (``0.36 s<!-- ttft.warm.ours -->``), which a Markdown page does not
show. The check (``python -m benchmarks.claims``; ``tests/benchmarks/test_claims.py`` runs it):

- every claim's value, formatted, is what the text says right before each of its markers;
- every marker names a claim, and every claim is quoted somewhere (listed once, used);
- every claim's file is its benchmark's latest run on that machine (quote the latest, met or not);
- in the README and the report, no result-like figure (a number with ``x``, ``ms``, ``s``,
  ``tok/s``, ``%`` or a byte unit) stands without a marker, unless it is a goal or a bound the
  sentence sets (``goal``, ``<=``, ``at most``, ...) or sits in code.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = ROOT / "benchmarks" / "claims.toml"
RESULTS = ROOT / "benchmarks" / "results"
# The pages whose every result-like figure must be a claim; markers are checked in all of docs/.
QUOTING = ("README.md", "docs/BENCHMARKS.md")

MARKER = re.compile(r"<!--\s*([a-z0-9_]+(?:\.[a-z0-9_\-]+)+)\s*-->")
FIGURE = re.compile(
    r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?\s?(?:x|×|ms|s|tok/s|%|GB|GiB|MB|MiB|KB|KiB)(?![\w/])")
BOUND = re.compile(r"(goal|target|<=|>=|≤|≥|<|>|at most|at least|under|over|limit|up to)\W{0,3}"
                   r"(\*\*)?\s*~?$", re.IGNORECASE)
# A run's stem: its UTC time, then the machine if not this project's CPU box.
STEM = re.compile(r"^(\d{8}-\d{6})(?:-(.+))?$")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


@dataclass(frozen=True)
class Claim:
    id: str
    file: str
    value: str
    format: str
    fields: dict[str, str]

    def compute(self, root: Path = ROOT) -> float | int | str:
        data = json.loads((root / self.file).read_text())
        if not self.fields:
            return lookup(data, self.value)
        names = {name: lookup(data, path) for name, path in self.fields.items()}
        return _evaluate(ast.parse(self.value, mode="eval").body, names, self.id)

    def text(self, root: Path = ROOT) -> str:
        return self.format.format(self.compute(root))


def lookup(data, path: str):
    """The value at a dotted path (``a.b.0.c``: a number indexes a list)."""
    node = data
    for part in path.split("."):
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(f"{path!r}: no {part!r}")
    return node


def _evaluate(node, names: dict, claim: str):
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, names, claim),
                                   _evaluate(node.right, names, claim))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand, names, claim))
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    raise ValueError(f"claim {claim}: only + - * /, numbers and its fields may be used")


def load(path: Path = CLAIMS) -> list[Claim]:
    raw = tomllib.loads(path.read_text()).get("claim", [])
    return [Claim(c["id"], c["file"], c["value"], c["format"], dict(c.get("fields", {})))
            for c in raw]


def latest_run(path: Path) -> Path:
    """The newest raw result beside ``path`` from the same machine."""
    stem = STEM.match(path.stem)
    if stem is None:
        raise ValueError(f"{path.name}: not named <YYYYMMDD-HHMMSS>[-machine]{path.suffix}")
    runs = [p for p in path.parent.glob(f"*{path.suffix}")
            if (m := STEM.match(p.stem)) and m.group(2) == stem.group(2)]
    return max(runs, key=lambda p: STEM.match(p.stem).group(1))


def _outside_code(text: str) -> str:
    """The text with fenced blocks and inline code blanked (same length, so offsets hold)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    text = re.sub(r"^```.*?^```", blank, text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", blank, text)


def unclaimed(text: str) -> list[str]:
    """Result-like figures with no claim marker right after them."""
    plain = _outside_code(text)
    found = []
    for m in FIGURE.finditer(plain):
        after = plain[m.end():m.end() + 12]
        if re.match(r"[*)\]]*\s*<!--", after):
            continue
        line_start = plain.rfind("\n", 0, m.start()) + 1
        before = re.split(r"[|;:(]", plain[line_start:m.start()])[-1]
        if plain[line_start:].lstrip().startswith("#") or BOUND.search(before[-40:]):
            continue
        line = plain.count("\n", 0, m.start()) + 1
        context = plain[max(line_start, m.start() - 50):m.end() + 20].strip()
        found.append(f"line {line}: {m.group(0)!r} in {context!r}")
    return found


def problems(root: Path = ROOT, claims_file: Path | None = None,
             pages: list[Path] | None = None) -> list[str]:
    """What is wrong with the claims and the pages quoting them (nothing: an empty list).

    By default the project's claims and pages; ``claims_file`` and ``pages`` check a draft (a
    report section and its claims) before it joins them: every page given must then quote only
    figures that are claims."""
    claims = load(claims_file or root / CLAIMS.relative_to(ROOT))
    results = (root / RESULTS.relative_to(ROOT)).resolve()
    out: list[str] = []
    by_id: dict[str, Claim] = {}
    for c in claims:
        if c.id in by_id:
            out.append(f"claim {c.id} is listed twice")
        by_id[c.id] = c
        if not (root / c.file).is_file():
            out.append(f"claim {c.id}: no file {c.file}")
            continue
        if not (root / c.file).resolve().is_relative_to(results):
            out.append(f"claim {c.id}: {c.file} is not a raw result under benchmarks/results/")
        elif not STEM.match((root / c.file).stem):
            out.append(f"claim {c.id}: {c.file} is not named <YYYYMMDD-HHMMSS>[-machine]")
        elif (newest := latest_run(root / c.file)) != (root / c.file):
            out.append(f"claim {c.id}: {c.file} is not the latest run ({newest.relative_to(root)})")
    used: set[str] = set()
    quoting = [root / p for p in QUOTING] if pages is None else pages
    every = quoting + sorted((root / "docs").glob("*.md")) if pages is None else pages
    for page in dict.fromkeys(every):
        text = page.read_text()
        name = page.relative_to(root) if page.is_relative_to(root) else page
        for m in MARKER.finditer(text):
            cid = m.group(1)
            used.add(cid)
            if cid not in by_id:
                out.append(f"{name}: marker {cid} names no claim")
                continue
            try:
                want = by_id[cid].text(root)
            except (KeyError, IndexError, ValueError, TypeError) as e:
                out.append(f"claim {cid}: {e}")
                continue
            written = text[:m.start()].rstrip("*")
            if not written.endswith(want):
                line = text.count("\n", 0, m.start()) + 1
                out.append(f"{name}:{line}: claim {cid} is {want!r}, the text says "
                           f"{written[-len(want) - 10:]!r}")
        if page in quoting:
            out += [f"{name}: unclaimed figure, {f}" for f in unclaimed(text)]
    out += [f"claim {c} is quoted nowhere" for c in by_id if c not in used]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", action="store_true", help="print every claim's value")
    parser.add_argument("--claims", type=Path, help="a draft's claims (default: the project's)")
    parser.add_argument("pages", nargs="*", type=Path,
                        help="a draft's pages to check (default: the project's docs)")
    args = parser.parse_args(argv)
    listed = load(args.claims or CLAIMS)
    if args.show:
        for c in listed:
            try:
                shown = c.text()
            except Exception as e:  # noqa: BLE001 - shown, and the check below reports it
                shown = f"ERROR {e}"
            print(f"{c.id:40s} {shown:>14s}  {c.file}:{c.value}")
    found = problems(ROOT, args.claims, [p.resolve() for p in args.pages] or None)
    for p in found:
        print(p, file=sys.stderr)
    print(f"{len(listed)} claims, {len(found)} problems", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
