"""Fast BLAS for MLX's CPU backend on Linux.

MLX's Linux CPU wheel links a slow reference BLAS (~6 GFLOP/s on a 1024^2 fp32 matmul). Preloading
the OpenBLAS shipped by the PyPI package ``cmeel-openblas`` makes the same matmul ~30-60x faster.
That library needs ``libgfortran.so.5``; when the system has none, numpy's wheel bundles one under a
hashed name (``numpy.libs/libgfortran-<hash>.so.5*``, which needs ``libquadmath-<hash>.so*``), so we
build a small directory of symlinks with the names the loader looks for and put it on
``LD_LIBRARY_PATH``.

``LD_PRELOAD`` only works when set before the process starts, hence :func:`maybe_reexec` (for the
launchers) and ``python -m mlx_kvserver.blas --print-env`` (for shell scripts). On macOS nothing is
done: MLX uses Metal and Accelerate. Any failure degrades to MLX's own BLAS with a warning.
"""

from __future__ import annotations

import ctypes.util
import glob
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

DISABLE_VAR = "MLX_KVSERVER_NO_BLAS"
MARKER_VAR = "MLX_KVSERVER_BLAS_APPLIED"
THREADS_VAR = "MLX_KVSERVER_BLAS_THREADS"  # OpenBLAS threads; default: half the usable cores
_SHIM_NAME = "mlx-kvserver-blas"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _search_dirs() -> list[Path]:
    import site

    dirs = [Path(p) for p in sys.path if p]
    try:
        dirs += [Path(p) for p in site.getsitepackages()]
    except AttributeError:  # some embedded interpreters lack it
        pass
    seen: list[Path] = []
    for d in dirs:
        if d not in seen and d.is_dir():
            seen.append(d)
    return seen


def find_openblas() -> Path | None:
    """Path of ``libopenblas.so.0`` from the ``cmeel-openblas`` package, or None."""
    try:
        dist = importlib.metadata.distribution("cmeel-openblas")
        for f in dist.files or ():
            if f.name == "libopenblas.so.0":
                p = Path(str(dist.locate_file(f)))
                if p.is_file():
                    return p
    except importlib.metadata.PackageNotFoundError:
        pass
    for d in _search_dirs():
        p = d / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if p.is_file():
            return p
    return None


def _numpy_libs() -> Path | None:
    spec = importlib.util.find_spec("numpy")
    if spec is not None and spec.origin:
        p = Path(spec.origin).resolve().parent.parent / "numpy.libs"
        if p.is_dir():
            return p
    for d in _search_dirs():
        if (d / "numpy.libs").is_dir():
            return d / "numpy.libs"
    return None


def _link(target: Path, link: Path) -> None:
    """Point ``link`` at ``target``; atomic (a concurrent process sees the old or the new link)."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _shim_candidates(libs: Path) -> list[Path]:
    tag = hashlib.sha256(str(libs).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [
        Path(sys.prefix) / "lib" / _SHIM_NAME,
        cache / "mlx-kvserver" / f"blas-{tag}",
        Path(tempfile.gettempdir()) / f"{_SHIM_NAME}-{os.getuid()}-{tag}",
    ]


def _gfortran_shim() -> Path | None:
    """A directory in which ``libgfortran.so.5`` (from numpy's wheel) and its libquadmath load."""
    libs = _numpy_libs()
    if libs is None:
        return None
    gfortran = sorted(glob.glob(str(libs / "libgfortran-*.so.5*")))
    quadmath = sorted(glob.glob(str(libs / "libquadmath-*.so*")))
    if not gfortran:
        return None
    for shim in _shim_candidates(libs):
        try:
            shim.mkdir(parents=True, exist_ok=True)
            _link(Path(gfortran[0]), shim / "libgfortran.so.5")
            for q in quadmath:  # NEEDED under its own hashed name
                _link(Path(q), shim / Path(q).name)
            return shim
        except OSError as e:
            log.debug("cannot build BLAS shim in %s: %s", shim, e)
    return None


def _prepend(path: str, current: str | None) -> str:
    return path if not current else f"{path}{os.pathsep}{current}"


def _threads(environ: Mapping[str, str]) -> str | None:
    """OPENBLAS_NUM_THREADS to set, or None to leave the user's setting alone.

    NOTE: measured on a 2-core machine with one core busy elsewhere: 2 OpenBLAS threads prefilled
    ~60 tok/s, 1 thread ~200 tok/s (OpenBLAS threads spin and stall when a core is taken).
    """
    if "OPENBLAS_NUM_THREADS" in environ:
        return None
    if (want := environ.get(THREADS_VAR, "").strip()).isdecimal() and int(want) > 0:
        return want
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return str(max(1, cores // 2))


def _loads(env: Mapping[str, str]) -> bool:
    """Whether a trivial process starts with these loader settings (a bad preload is fatal)."""
    try:
        r = subprocess.run([sys.executable, "-S", "-c", "pass"], env=dict(env), timeout=30,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("BLAS check failed to run: %s", e)
        return False
    if r.returncode != 0:
        log.warning("OpenBLAS preload does not load, skipping it: %s",
                    r.stderr.decode(errors="replace").strip()[-300:])
    return r.returncode == 0


def blas_env(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """Environment additions that preload OpenBLAS, or None when there is nothing to do.

    The additions: ``LD_PRELOAD``, ``LD_LIBRARY_PATH`` (only for the libgfortran shim), the
    re-exec marker, and ``OPENBLAS_NUM_THREADS`` unless already set (``MLX_KVSERVER_BLAS_THREADS``
    or half the usable cores).

    None when not on Linux, when ``MLX_KVSERVER_NO_BLAS`` is set, when already applied (marker or
    an OpenBLAS already in ``LD_PRELOAD``), when ``cmeel-openblas`` or a ``libgfortran`` is missing,
    or when the resulting settings fail to start a process. Never raises.
    """
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or _truthy(environ.get(DISABLE_VAR)):
        return None
    if _truthy(environ.get(MARKER_VAR)) or "libopenblas" in environ.get("LD_PRELOAD", ""):
        return None
    try:
        lib = find_openblas()
        if lib is None:
            return None
        add = {"LD_PRELOAD": _prepend(str(lib), environ.get("LD_PRELOAD")), MARKER_VAR: "1"}
        if (threads := _threads(environ)) is not None:
            add["OPENBLAS_NUM_THREADS"] = threads
        if not ctypes.util.find_library("gfortran"):
            shim = _gfortran_shim()
            if shim is None:
                log.warning("OpenBLAS found but no libgfortran.so.5; using MLX's own BLAS")
                return None
            add["LD_LIBRARY_PATH"] = _prepend(str(shim), environ.get("LD_LIBRARY_PATH"))
        return add if _loads({**environ, **add}) else None
    except Exception as e:  # noqa: BLE001 - never let BLAS set-up break start-up
        log.warning("OpenBLAS set-up failed, using MLX's own BLAS: %s", e)
        return None


def maybe_reexec(argv: Sequence[str] | None = None) -> None:
    """Re-execute this interpreter with OpenBLAS preloaded, when :func:`blas_env` says so.

    ``argv`` is what follows the interpreter on the new command line: ``sys.argv`` for a script or
    console entry point; the default, ``sys.orig_argv[1:]``, also keeps ``-m package.module``.
    Returns normally (without re-exec) on macOS, when nothing is needed, or on any failure.
    """
    try:
        add = blas_env(os.environ)
        if not add:
            return
        args = list(sys.orig_argv[1:] if argv is None else argv)
        log.info("re-executing with OpenBLAS preloaded")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.execve(sys.executable, [sys.executable, *args], {**os.environ, **add})
    except Exception as e:  # noqa: BLE001
        log.warning("could not re-exec with OpenBLAS, continuing without: %s", e)


def _openblas_mapped() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any("libopenblas" in line for line in f)
    except OSError:
        return False


def blas_status() -> str:
    """One line for logs saying which BLAS this process runs MLX with."""
    if sys.platform == "darwin":
        return "system (Accelerate on macOS)"
    if not sys.platform.startswith("linux"):
        return "system"
    if _openblas_mapped():
        return "openblas via LD_PRELOAD"
    if _truthy(os.environ.get(DISABLE_VAR)):
        return f"disabled ({DISABLE_VAR}=1): MLX reference BLAS, slow"
    if find_openblas() is None:
        return "MLX reference BLAS, slow (install cmeel-openblas)"
    return "MLX reference BLAS, slow (OpenBLAS not preloaded)"


def export_lines(environ: Mapping[str, str] | None = None) -> str:
    """Shell ``export`` lines for :func:`blas_env`'s additions ('' when there are none)."""
    add = blas_env(environ)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted((add or {}).items()))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mlx_kvserver.blas",
                                 description="Show or export the OpenBLAS set-up for MLX.")
    ap.add_argument("--print-env", action="store_true", help="print export lines for a shell")
    args = ap.parse_args(argv)
    if args.print_env:
        sys.stdout.write(export_lines())
    else:
        print(blas_status())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
