"""Where a benchmark run writes its files: ``benchmarks/results/<name>/<STAMP>.json``.

``<name>`` is the benchmark's module name (``ttft``, ``memory_growth``, ...) and ``STAMP`` the UTC
time of the run, ``YYYYMMDD-HHMMSS``: one stamp for all files of a run (the time this module was
first imported). A run on another machine than the usual one names it in ``BENCH_MACHINE``
(``BENCH_MACHINE=cuda-h100``), which is appended to the stem: ``20261127-101500-cuda-h100.json``.
The plots and tables of a run lie beside its JSON with the same stem (``run_file(name, ".png")``).

A run never writes over an earlier run's file. A file given on the command line instead
(``--json FILE``, ``--out DIR``) is written as given unless it exists, in which case the run
writes ``<stem>_<STAMP><suffix>`` beside it and says so. A run that writes the same file again (a
long run saving as it goes) rewrites its own file only.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"
STAMP = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
OVERRIDE_HELP = "write here instead of benchmarks/results/<benchmark>/<run's UTC time>"
_chosen: dict[Path, Path] = {}


def stem() -> str:
    """This run's file stem: ``STAMP``, with ``-<BENCH_MACHINE>`` when that is set."""
    machine = os.environ.get("BENCH_MACHINE", "").strip()
    return f"{STAMP}-{machine}" if machine else STAMP


def run_file(name: str, suffix: str = ".json", override: str | Path | None = None) -> Path:
    """The file this run writes for benchmark ``name``: ``RESULTS/<name>/<stem><suffix>``, or
    ``override`` when one is given (see the module's docstring). The folder is created."""
    default = override is None
    path = RESULTS / name / f"{stem()}{suffix}" if default else Path(override)
    key = path.resolve()
    if key not in _chosen:
        if path.exists():
            if default:
                raise SystemExit(f"{path} exists (a run started the same second): not overwriting")
            stamped = path.with_name(f"{path.stem}_{STAMP}{path.suffix}")
            if stamped.exists():
                raise SystemExit(f"{path} and {stamped} exist; not overwriting either")
            print(f"{path} exists (an earlier run's): writing {stamped}", file=sys.stderr)
            path = stamped
        _chosen[key] = path
    _chosen[key].parent.mkdir(parents=True, exist_ok=True)
    return _chosen[key]


def write(name: str, text: str, suffix: str = ".json",
          override: str | Path | None = None) -> Path:
    """Write ``text`` to this run's file for ``name`` (see ``run_file``); returns the file."""
    out = run_file(name, suffix, override)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return out


def write_study(name: str, text: str, draw: Callable[[Path], None], quick: bool,
                plot: Path | None = None, doc: Path | None = None) -> None:
    """The files of a study that prints Markdown tables (``text``) and draws a plot: the tables
    (``.md``) and the plot (``draw(path)``, ``.png``) under this run's stem, neither for a
    ``quick`` run unless ``plot`` names a file; with ``doc``, the tables also replace the section
    of that Markdown file between ``<!-- results:begin -->`` and ``<!-- results:end -->``."""
    if not quick:
        write(name, text, ".md")
    if plot is not None or not quick:
        out = run_file(name, ".png", plot)
        draw(out)
        print(f"plot: {out}")
    if doc is not None:
        begin, end = "<!-- results:begin -->", "<!-- results:end -->"
        old = doc.read_text() if doc.exists() else f"{begin}\n{end}\n"
        if begin not in old or end not in old:
            old = old.rstrip() + f"\n\n{begin}\n{end}\n"
        head, rest = old.split(begin, 1)
        doc.write_text(f"{head}{begin}\n{text}{end}{rest.split(end, 1)[1]}")
        print(f"doc: {doc}")
