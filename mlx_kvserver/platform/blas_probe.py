"""Proving a BLAS library before it is preloaded, and remembering the verdict.

A preloaded BLAS runs inside every process of the server, so it is tried first in a child: a
Python process started with the candidate's environment (``LD_PRELOAD`` and the rest) checks
that the library is really mapped, then multiplies small float32 matrices through MLX (plain and
transposed, small enough for OpenBLAS's small-matrix kernels and large enough for its threaded
ones) and inverts one (LAPACK), and compares each result with numpy's in float64. A child that
dies by a signal (an instruction this CPU lacks: SIGILL), answers wrong, or never says OK means
the library is not used.

Verdicts are kept in ``blas-verdicts.json`` in the user's cache directory, keyed by the
candidate, its files (path, size, mtime), the CPU (vendor, model, flags, and the variables that
steer OpenBLAS's or MKL's choice of kernels) and MLX's version, so the check runs once per
library and machine, not on every start. A verdict that may not hold next time (the check timed
out, could not start, or failed for another reason) is not kept. An unreadable or corrupt file is
ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PROBE_VERSION = 1
TIMEOUT_S = 180
VERDICTS_FILE = "blas-verdicts.json"
MAX_VERDICTS = 64
WRONG, NOT_LOADED = 2, 3  # the child's exit codes
# Variables that change which kernels a library picks on the same CPU.
KERNEL_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
               "MKL_DEBUG_CPU_TYPE")

CHILD = r"""
import sys
import numpy as np
import mlx.core as mx

maps = open("/proc/self/maps").read()
missing = [p for p in sys.argv[1:] if p not in maps]
if missing:
    print("not loaded:", *missing)
    sys.exit(3)
rng = np.random.default_rng(0)
worst = 0.0
for m, k, n, ta, tb in ((5, 7, 3, 0, 0), (33, 65, 17, 1, 0), (200, 300, 260, 0, 1),
                        (256, 576, 384, 1, 1)):
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    x, y = mx.array(a), mx.array(b)
    got = np.array(mx.matmul(x.T if ta else x, y.T if tb else y, stream=mx.cpu))
    want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
s = rng.standard_normal((40, 40)).astype(np.float32) + 40 * np.eye(40, dtype=np.float32)
got = np.array(mx.linalg.inv(mx.array(s), stream=mx.cpu))
inv = float(np.abs(got - np.linalg.inv(s.astype(np.float64))).max() * 40)
if not (worst < 1e-4 and inv < 1e-3):  # NaN fails too
    print(f"max relative error {worst:.3g} in sgemm, {inv:.3g} in an inverse")
    sys.exit(2)
print(f"OK: sgemm and an inverse through MLX match numpy (max relative error {worst:.1g})")
"""


@dataclass(frozen=True)
class Verdict:
    """Whether a library may be used, why, and whether the answer may be kept."""

    ok: bool
    why: str
    keep: bool = True
    cached: bool = False


def cache_dir(environ: Mapping[str, str]) -> Path | None:
    """A directory for generated libraries and verdicts that only this user can write to
    (``$XDG_CACHE_HOME/mlx-kvserver``, else a private one under the temporary directory)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home())
                                                 / ".cache")
    for d in (Path(base) / "mlx-kvserver",
              Path(tempfile.gettempdir()) / f"mlx-kvserver-{os.getuid()}"):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
            # NOTE: what is written here gets preloaded: never trust a directory others can write.
            if st.st_uid == os.getuid() and not st.st_mode & 0o022:
                return d
        except OSError:
            continue
    return None


def write_private(directory: Path, name: str, data: bytes) -> Path:
    """``directory/name`` holding ``data``, written atomically unless it already does."""
    path = directory / name
    try:
        if path.read_bytes() == data:
            return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def cpu_identity() -> str:
    """Vendor, model and flags of the first CPU in /proc/cpuinfo."""
    want = ("vendor_id", "cpu family", "model", "model name", "flags")
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                if key.strip() in want:
                    found[key.strip()] = value.strip()
    except OSError:
        pass
    return json.dumps(found, sort_keys=True)


def _file_identity(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def verdict_key(name: str, files: Sequence[Path], environ: Mapping[str, str]) -> str:
    try:
        mlx = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        mlx = "?"
    parts = [PROBE_VERSION, name, [_file_identity(p) for p in files], cpu_identity(),
             {k: environ.get(k) for k in KERNEL_VARS}, mlx]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def load_verdicts(path: Path) -> dict[str, dict]:
    """The stored verdicts; {} when the file is missing, unreadable or not what we wrote."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        verdicts = data["verdicts"]
        if not isinstance(verdicts, dict):
            return {}
        return {k: v for k, v in verdicts.items() if isinstance(v, dict)
                and isinstance(v.get("ok"), bool) and isinstance(v.get("why"), str)}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def save_verdict(path: Path, key: str, verdict: Verdict, library: Path) -> None:
    verdicts = load_verdicts(path)
    verdicts[key] = {"ok": verdict.ok, "why": verdict.why, "library": str(library),
                     "at": time.time()}
    newest = sorted(verdicts.items(), key=lambda kv: kv[1].get("at", 0), reverse=True)
    data = {"version": PROBE_VERSION, "verdicts": dict(newest[:MAX_VERDICTS])}
    try:
        write_private(path.parent, path.name, json.dumps(data, indent=1).encode())
    except OSError:
        pass  # a verdict not kept only costs another check next time


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_child(env: Mapping[str, str], libraries: Sequence[Path],
              timeout: float = TIMEOUT_S) -> Verdict:
    """Run the check in a child with ``env``; ``libraries`` must show in its memory map."""
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, *(str(p.resolve()) for p in libraries)],
                           env=dict(env), cwd="/", stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"the check did not finish in {timeout:.0f} s", keep=False)
    except OSError as e:
        return Verdict(False, f"the check could not start: {e}", keep=False)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    if r.returncode < 0:
        sig = signal_name(-r.returncode)
        what = " (an instruction this CPU does not have)" if sig == "SIGILL" else ""
        return Verdict(False, f"the check process died with {sig}{what}")
    if r.returncode == 0 and last.startswith("OK"):
        return Verdict(True, last.removeprefix("OK: "))
    if r.returncode == WRONG:
        return Verdict(False, f"wrong results: {last}")
    detail = (r.stderr.strip() or last).replace("\n", " | ")[-300:]
    if r.returncode == NOT_LOADED:
        return Verdict(False, f"the library did not load: {detail}", keep=False)
    return Verdict(False, f"the check failed (exit status {r.returncode}): {detail}", keep=False)


def check(name: str, files: Sequence[Path], env: Mapping[str, str],
          environ: Mapping[str, str]) -> Verdict:
    """The verdict on a candidate, from the cache when there is one, else from a child run
    with ``env`` (kept in the cache unless it may change)."""
    store = cache_dir(environ)
    key = verdict_key(name, files, environ)
    path = store / VERDICTS_FILE if store is not None else None
    if path is not None:
        known = load_verdicts(path).get(key)
        if known is not None:
            return Verdict(known["ok"], known["why"], cached=True)
    verdict = run_child(env, files)
    if path is not None and verdict.keep:
        save_verdict(path, key, verdict, files[-1])
    return verdict
