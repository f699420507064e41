"""Where a benchmark run writes its result files: never over an earlier run's file.

The rule, for every ``scripts/bench_*.py`` that writes a result (JSON, and the plots and tables
written with it): the run writes the file it is told to; if that file already exists, it writes
``NAME_<UTC time of the run's first result write, YYYYMMDD-HHMMSS>.EXT`` beside it instead (one
stamp for all files of a run: the time this module was first imported, which the scripts do when
they first write), and says which file it wrote. A run that writes the same file again (a long run saving as it
goes) rewrites its own file only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

STAMP = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
_chosen: dict[Path, Path] = {}


def result_path(path: str | Path) -> Path:
    """The file this run writes for ``path``: ``path`` itself if no earlier run wrote it."""
    path = Path(path)
    key = path.resolve()
    if key not in _chosen:
        if path.exists():
            stamped = path.with_name(f"{path.stem}_{STAMP}{path.suffix}")
            if stamped.exists():
                raise SystemExit(f"{path} and {stamped} exist; not overwriting either")
            print(f"{path} exists (an earlier run's): writing {stamped}", file=sys.stderr)
            path = stamped
        _chosen[key] = path
    return _chosen[key]


def write_result(path: str | Path, text: str) -> Path:
    """Write ``text`` to this run's file for ``path`` (see ``result_path``); returns it."""
    out = result_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return out
