"""A fast BLAS for MLX's CPU backend on Linux, chosen per machine and proven before use.

MLX's Linux CPU wheel links a reference BLAS (about 6 GFLOP/s on a 1024x576 @ 576x1536 float32
matmul). A launcher preloads a faster one with ``LD_PRELOAD``, which only works when set before
the process starts: :func:`maybe_reexec` re-executes the launcher, and
``python -m mlx_kvserver.platform.blas --print-env`` prints the settings for shell scripts. On macOS
nothing is done (MLX uses Metal and Accelerate); elsewhere any failure means MLX's own BLAS.

Candidates, tried in this order; the first one that passes its check is used:

1. ``$MLX_KVSERVER_BLAS_LIBRARY``: a library the user names (it must export ``cblas_sgemm``).
2. ``scipy-openblas32`` (a dependency on Linux x86-64): the OpenBLAS build that numpy and scipy
   ship, kept by OpenBLAS's maintainers. It is ``DYNAMIC_ARCH``: it picks its kernels for the CPU
   it runs on, whatever CPU built the wheel, and takes up to 64 threads. Its names carry a prefix
   (``scipy_cblas_sgemm``), so it is reached through a forwarder: a shared object of a few KB that
   exports each BLAS and LAPACK name ``libmlx.so`` imports as a jump to the prefixed one. The
   forwarder is written in Python by :mod:`mlx_kvserver.platform.elf` at first use and cached. Why not a
   C shim compiled at first use: a C compiler is not on every user's machine, and the compiler
   on PyPI (``ziglang``) is a 100 MB wheel whose first run builds libc stubs; the forwarder is
   ten bytes of code per name, the same bytes on every machine, and it is proven like any other
   candidate. Measured on AMD EPYC: 72 GFLOP/s on 1 thread (docs/BENCHMARKS.md has the table).
3. ``cmeel-openblas``, when installed: fast, but built for the CPU of the machine that built the
   wheel (0.3.31 needs AVX-512 and dies with SIGILL on AMD Zen 3; 0.3.29 is TARGET=ZEN with at
   most 4 threads). It is no longer a dependency. It needs ``libgfortran.so.5``: when the system
   has none, numpy's wheel has one under a hashed name, linked under its real name in a private
   directory put on ``LD_LIBRARY_PATH``.
4. Intel's ``mkl``, when installed: plain names and its own CPU dispatch, but about 280 MB with
   ``intel-openmp``, and slower than OpenBLAS on AMD.
5. MLX's own reference BLAS.

Every candidate is proven in a child process before it is preloaded (:mod:`blas_probe`: real
matmuls through MLX compared with numpy; a child killed by SIGILL or answering wrong rules the
library out), and the verdict is cached per library file, CPU and MLX version. A rejected
candidate is named in one warning line. ``python -m mlx_kvserver.platform.blas`` tells which BLAS is used
and why.

Threads: one per physical core the process may run on, less one left for the rest of the
process and the machine, at most 16 (``MLX_KVSERVER_BLAS_THREADS`` or the library's own variable,
``OPENBLAS_NUM_THREADS`` / ``MKL_NUM_THREADS``, overrides it).
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import blas_probe
from .blas_candidates import (FORWARDER, LIBRARY_VAR, Candidate, Finder, cmeel_openblas, intel_mkl,
                              scipy_openblas, user_library)

log = logging.getLogger(__name__)

DISABLE_VAR = "MLX_KVSERVER_NO_BLAS"
MARKER_VAR = "MLX_KVSERVER_BLAS_APPLIED"  # set to the name of the candidate preloaded
THREADS_VAR = "MLX_KVSERVER_BLAS_THREADS"
MAX_THREADS = 16
KNOWN_LIBS = ("libopenblas", "libscipy_openblas", "libmkl_rt", FORWARDER)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


# The candidates in the order they are tried (see the module docstring).
FINDERS: list[tuple[str, Finder]] = [
    (LIBRARY_VAR, user_library), ("scipy-openblas32", scipy_openblas),
    ("cmeel-openblas", cmeel_openblas), ("mkl", intel_mkl)]


# -- threads -----------------------------------------------------------------------------------


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 2))


def physical_cores(cpus: Iterable[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many physical cores the logical ``cpus`` belong to (SMT siblings count once)."""
    cpus = list(cpus)
    cores = set()
    for c in cpus:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def default_threads(physical: int) -> int:
    """BLAS threads for a process that may use ``physical`` cores.

    NOTE: measured on a 2-core machine with one core busy elsewhere: 2 OpenBLAS threads prefilled
    ~60 tok/s, 1 thread ~200 tok/s (OpenBLAS threads spin and stall when a core is taken). One
    core is left to the rest of the process (tokenizer, HTTP, MLX's non-BLAS work) and machine;
    past 16 threads the matmuls of a chat prefill gain little and synchronization costs more.
    """
    return max(1, min(MAX_THREADS, physical - 1))


def _threads(environ: Mapping[str, str], var: str) -> str | None:
    """The thread count to set in ``var``, or None to leave the user's setting alone."""
    if var in environ:
        return None
    if (want := environ.get(THREADS_VAR, "").strip()).isdecimal() and int(want) > 0:
        return want
    return str(default_threads(physical_cores(usable_cpus())))


# -- choosing --------------------------------------------------------------------------------


def _prepend(path: str, current: str | None) -> str:
    if current and path in current.replace(" ", os.pathsep).split(os.pathsep):
        return current
    return path if not current else f"{path}{os.pathsep}{current}"


def candidate_env(c: Candidate, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment additions that preload ``c`` (and, riding on the same re-exec, the
    malloc setting of :func:`malloc_tunables`)."""
    add = {"LD_PRELOAD": _prepend(str(c.preload), environ.get("LD_PRELOAD")), MARKER_VAR: c.name}
    if c.library_path is not None:
        add["LD_LIBRARY_PATH"] = _prepend(str(c.library_path), environ.get("LD_LIBRARY_PATH"))
    if (threads := _threads(environ, c.threads_var)) is not None:
        add[c.threads_var] = threads
    if (tunables := malloc_tunables(environ)) is not None:
        add["GLIBC_TUNABLES"] = tunables
    return add


MMAP_THRESHOLD = 65536  # bytes: larger blocks are mapped, and unmapped when freed


def malloc_tunables(environ: Mapping[str, str]) -> str | None:
    """``GLIBC_TUNABLES`` with, unless the user set them or this is not glibc:

    - ``glibc.malloc.hugetlb=1``: glibc asks for transparent huge pages on the memory it maps
      for large blocks. MLX's CPU arrays come from malloc: a restored run of pages (~100 MB for
      the default model at 2,400 tokens) is first touched in ~700 faults of 2 MiB instead of
      ~25,000 of 4 KiB (restores of benchmarks/restore.py; its earlier runs in
      docs/BENCHMARKS.md's git history);
    - ``glibc.malloc.mmap_threshold=65536``: a fixed threshold, so every block of 64 KiB or more
      is mapped and given back to the system when freed. glibc's own threshold moves up to the
      size of the last mapped block freed (up to 32 MiB), after which MLX's arrays come from
      the heap, whose freed holes stay resident: the server's memory then rose ~3.4 MiB every
      100 requests while MLX's own bytes stayed level (1.16x over 1,000 requests; fixed: 1.06x,
      +0.45 MiB / 100; earlier runs of benchmarks/memory_growth.py, in
      docs/BENCHMARKS.md's git history).

    None when there is nothing to add."""
    current = environ.get("GLIBC_TUNABLES", "")
    if platform.libc_ver()[0] != "glibc":
        return None
    add = [t for t in ("glibc.malloc.hugetlb=1", f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}")
           if t.split("=")[0] not in current]
    if not add:
        return None
    return ":".join(x for x in (current, *add) if x)


@dataclass
class Choice:
    """The candidate chosen (None: MLX's own BLAS), its environment additions, and a line on
    each candidate looked at."""

    candidate: Candidate | None
    env: dict[str, str]
    report: list[tuple[str, str]]


def choose(environ: Mapping[str, str]) -> Choice:
    """Try the candidates in order (see the module docstring); never raises."""
    report: list[tuple[str, str]] = []
    for name, find in FINDERS:
        try:
            found = find(environ)
            if isinstance(found, str):
                report.append((name, found))
                continue
            if any(ch in str(found.preload) for ch in " :"):
                report.append((name, f"{found.preload}: LD_PRELOAD cannot carry a space or ':'"))
                continue
            add = candidate_env(found, environ)
            verdict = blas_probe.check(name, found.files(), {**environ, **add}, environ)
        except Exception as e:  # noqa: BLE001 - a broken candidate must not stop start-up
            log.warning("BLAS: %s could not be set up, not using it: %s", name, e)
            report.append((name, f"could not be set up: {e}"))
            continue
        cached = " (verdict cached)" if verdict.cached else ""
        if verdict.ok:
            report.append((name, f"in use: {verdict.why}{cached}"))
            return Choice(found, add, report)
        log.warning("BLAS: not using %s (%s): %s%s", name, found.library, verdict.why, cached)
        report.append((name, f"rejected: {verdict.why}{cached}"))
    log.warning("BLAS: no fast BLAS passed its check; MLX uses its own reference BLAS (slow). "
                "`python -m mlx_kvserver.platform.blas` tells why.")
    return Choice(None, {}, report)


def _applied(environ: Mapping[str, str]) -> bool:
    preload = environ.get("LD_PRELOAD", "")
    return _truthy(environ.get(MARKER_VAR)) or any(k in preload for k in KNOWN_LIBS)


def blas_env(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """Environment additions that preload the chosen BLAS, or None when there is nothing to do.

    The additions: ``LD_PRELOAD``, ``LD_LIBRARY_PATH`` (only for cmeel-openblas's libgfortran),
    the marker (the candidate's name) and the thread count unless already set. None when not on
    Linux, when ``MLX_KVSERVER_NO_BLAS`` is set, when already applied (the marker, or a known
    BLAS in ``LD_PRELOAD``), or when no candidate passes its check. Never raises.
    """
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or _truthy(environ.get(DISABLE_VAR)):
        return None
    if _applied(environ):
        return None
    return choose(environ).env or None


def maybe_reexec(argv: Sequence[str] | None = None) -> None:
    """Re-execute this interpreter with the chosen BLAS preloaded, when :func:`blas_env` says so.

    ``argv`` is what follows the interpreter on the new command line: ``sys.argv`` for a script or
    console entry point; the default, ``sys.orig_argv[1:]``, also keeps ``-m package.module``.
    Returns normally (without re-exec) on macOS, when nothing is needed, or on any failure.
    """
    try:
        add = blas_env(os.environ)
        if not add:
            return
        args = list(sys.orig_argv[1:] if argv is None else argv)
        log.info("re-executing with %s preloaded", add[MARKER_VAR])
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.execve(sys.executable, [sys.executable, *args], {**os.environ, **add})
    except Exception as e:  # noqa: BLE001
        log.warning("could not re-exec with a fast BLAS, continuing without: %s", e)


def _mapped(names: Iterable[str]) -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return False
    return any(n in maps for n in names)


def blas_status() -> str:
    """One line for logs saying which BLAS this process runs MLX with."""
    if sys.platform == "darwin":
        return "system (Accelerate on macOS)"
    if not sys.platform.startswith("linux"):
        return "system"
    name = os.environ.get(MARKER_VAR, "")
    user = os.environ.get(LIBRARY_VAR, "").strip()
    if _truthy(name) and _mapped([*KNOWN_LIBS, *([str(Path(user).resolve())] if user else [])]):
        var = "MKL_NUM_THREADS" if name == "mkl" else "OPENBLAS_NUM_THREADS"
        return f"{name} via LD_PRELOAD, {os.environ.get(var, '?')} threads ({var})"
    if _mapped(KNOWN_LIBS):
        return "a BLAS preloaded by the user (LD_PRELOAD)"
    if _truthy(os.environ.get(DISABLE_VAR)):
        return f"disabled ({DISABLE_VAR}=1): MLX reference BLAS, slow"
    return "MLX reference BLAS, slow (`python -m mlx_kvserver.platform.blas` tells why)"


def export_lines(environ: Mapping[str, str] | None = None) -> str:
    """Shell ``export`` lines for :func:`blas_env`'s additions ('' when there are none)."""
    add = blas_env(environ)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted((add or {}).items()))


def report(environ: Mapping[str, str]) -> str:
    """What ``python -m mlx_kvserver.platform.blas`` prints: the choice, why, and every candidate."""
    if not sys.platform.startswith("linux"):
        return f"BLAS for MLX: {blas_status()}\n"
    if _truthy(environ.get(DISABLE_VAR)):
        return f"BLAS for MLX: MLX's own reference BLAS ({DISABLE_VAR} is set)\n"
    choice = choose({k: v for k, v in environ.items() if k != MARKER_VAR})
    c = choice.candidate
    if c is None:
        lines = ["BLAS for MLX: MLX's own reference BLAS, slow (no candidate passed its check)"]
    else:
        n = choice.env.get(c.threads_var) or environ.get(c.threads_var, "?")
        lines = [f"BLAS for MLX: {c.name}, {n} thread{'' if n == '1' else 's'} "
                 f"({c.threads_var})", f"  library: {c.library}"]
        if c.preload != c.library:
            lines.append(f"  through: {c.preload}")
    width = max(len(n) for n, _ in FINDERS)
    lines.append("candidates, in order:")
    for name, _ in FINDERS:
        what = dict(choice.report).get(name, "not tried (an earlier one is used)")
        lines.append(f"  {name:<{width}}  {what}")
    now = blas_status() if _truthy(environ.get(MARKER_VAR)) else \
        "nothing preloaded (the launchers preload the chosen BLAS: mlx-kvserver, mlx-kvchat, " \
        "scripts/serve.sh, scripts/test.sh)"
    lines.append(f"this process: {now}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mlx_kvserver.platform.blas",
                                 description="Tell which BLAS MLX uses here and why, or print "
                                             "the settings that preload it.")
    ap.add_argument("--print-env", action="store_true", help="print export lines for a shell")
    args = ap.parse_args(argv)
    if not args.print_env:
        log.setLevel(logging.ERROR)  # the report says the same, once
    sys.stdout.write(export_lines() if args.print_env else report(os.environ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
