"""The BLAS libraries :mod:`mlx_kvserver.platform.blas` may preload: where each is found and how it is
reached (see that module's docstring for the order and the reasons)."""

from __future__ import annotations

import ctypes.util
import glob
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import blas_probe, elf

log = logging.getLogger("mlx_kvserver.platform.blas")

LIBRARY_VAR = "MLX_KVSERVER_BLAS_LIBRARY"
FORWARDER = "libmlx-kvserver-blas-forward"
SCIPY_PREFIX = "scipy_"
# Names MLX's CPU backend needs at the least, when libmlx.so cannot be read.
MLX_BLAS_NAMES = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")


@dataclass(frozen=True)
class Candidate:
    """A BLAS to try: its library, what to preload, and its thread-count variable."""

    name: str
    library: Path
    preload: Path  # the library itself, or a forwarder to it
    threads_var: str = "OPENBLAS_NUM_THREADS"
    library_path: Path | None = None  # a directory to put on LD_LIBRARY_PATH

    def files(self) -> list[Path]:
        """The files its verdict depends on (the library last)."""
        return [self.preload, self.library] if self.preload != self.library else [self.library]


Finder = Callable[[Mapping[str, str]], "Candidate | str"]


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


def _dist_file(dist: str, match: Callable[[str], bool]) -> Path | None:
    """The first file of an installed distribution whose name matches (not a symlink)."""
    try:
        files = importlib.metadata.distribution(dist).files or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(os.path.normpath(f.locate())) for f in files if match(f.name)]
    found = [p for p in found if p.is_file()]
    return min(found, key=lambda p: (p.is_symlink(), len(str(p)))) if found else None


def _package_dir(module: str) -> Path | None:
    """Where a package is installed, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


# -- candidates ------------------------------------------------------------------------------


def user_library(environ: Mapping[str, str]) -> Candidate | str:
    path = environ.get(LIBRARY_VAR, "").strip()
    if not path:
        return "not set"
    lib = Path(path)
    if not lib.is_file():
        return f"{path} is not a file"
    if "cblas_sgemm" not in elf.dynamic_symbols(lib)[1]:
        return f"{path} exports no cblas_sgemm"
    return Candidate(LIBRARY_VAR, lib, lib)


def mlx_imports() -> set[str]:
    """The names ``libmlx.so`` takes from other libraries (BLAS and LAPACK among them)."""
    pkg = _package_dir("mlx")
    lib = pkg / "lib" / "libmlx.so" if pkg else None
    try:
        return elf.dynamic_symbols(lib)[2] if lib else set(MLX_BLAS_NAMES)
    except (OSError, elf.ElfError):
        return set(MLX_BLAS_NAMES)


def scipy_openblas(environ: Mapping[str, str]) -> Candidate | str:
    pkg = _package_dir("scipy_openblas32")
    libs = sorted(glob.glob(str(pkg / "lib" / "libscipy_openblas*.so"))) if pkg else []
    if not libs:
        return "not installed"
    lib = Path(libs[0])
    machine, defined, _ = elf.dynamic_symbols(lib)
    if machine != elf.EM_X86_64:
        return "the forwarder is written for x86-64 only"
    forwards = {n: SCIPY_PREFIX + n for n in sorted(mlx_imports()) if SCIPY_PREFIX + n in defined}
    if "cblas_sgemm" not in forwards:
        return f"{lib} exports no {SCIPY_PREFIX}cblas_sgemm"
    cache = blas_probe.cache_dir(environ)
    if cache is None:
        return "no private cache directory to write the forwarder in"
    data = elf.forwarder(lib, forwards, f"{FORWARDER}.so")
    name = f"{FORWARDER}-{hashlib.sha256(data).hexdigest()[:16]}.so"
    return Candidate("scipy-openblas32", lib, blas_probe.write_private(cache, name, data))


def find_openblas() -> Path | None:
    """Path of ``libopenblas.so.0`` from the ``cmeel-openblas`` package, or None."""
    found = _dist_file("cmeel-openblas", lambda n: n == "libopenblas.so.0")
    if found is not None:
        return found
    for d in _search_dirs():
        p = d / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if p.is_file():
            return p
    return None


def cmeel_openblas(environ: Mapping[str, str]) -> Candidate | str:
    lib = find_openblas()
    if lib is None:
        return "not installed"
    shim = None
    if not ctypes.util.find_library("gfortran"):
        shim = _gfortran_shim(environ)
        if shim is None:
            return "no libgfortran.so.5 on this system or in numpy's wheel"
    return Candidate("cmeel-openblas", lib, lib, library_path=shim)


def intel_mkl(environ: Mapping[str, str]) -> Candidate | str:
    lib = _dist_file("mkl", lambda n: n.startswith("libmkl_rt.so"))
    if lib is None:
        return "not installed"
    return Candidate("mkl", lib, lib, threads_var="MKL_NUM_THREADS")


def _numpy_libs() -> Path | None:
    pkg = _package_dir("numpy")
    if pkg is not None and (pkg.parent / "numpy.libs").is_dir():
        return pkg.parent / "numpy.libs"
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


def _gfortran_shim(environ: Mapping[str, str]) -> Path | None:
    """A directory in which ``libgfortran.so.5`` (from numpy's wheel) and its libquadmath load."""
    libs = _numpy_libs()
    cache = blas_probe.cache_dir(environ)
    if libs is None or cache is None:
        return None
    gfortran = sorted(glob.glob(str(libs / "libgfortran-*.so.5*")))
    quadmath = sorted(glob.glob(str(libs / "libquadmath-*.so*")))
    if not gfortran:
        return None
    shim = cache / f"gfortran-{hashlib.sha256(str(libs).encode()).hexdigest()[:12]}"
    try:
        shim.mkdir(exist_ok=True)
        _link(Path(gfortran[0]), shim / "libgfortran.so.5")
        for q in quadmath:  # NEEDED under its own hashed name
            _link(Path(q), shim / Path(q).name)
    except OSError as e:
        log.debug("cannot build the libgfortran directory %s: %s", shim, e)
        return None
    return shim
