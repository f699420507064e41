"""OpenBLAS preloading for MLX's CPU backend (mlx_kvserver/blas.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_kvserver import blas

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
needs_openblas = pytest.mark.skipif(blas.find_openblas() is None, reason="no cmeel-openblas")

CHILD = """
import numpy as np, mlx.core as mx
from mlx_kvserver.blas import blas_status
rng = np.random.default_rng(0)
a = rng.standard_normal((512, 512), dtype=np.float32)
b = rng.standard_normal((512, 512), dtype=np.float32)
c = np.array(mx.array(a) @ mx.array(b))
want = a.astype(np.float64) @ b.astype(np.float64)
assert np.allclose(c, want, rtol=1e-4, atol=1e-3), float(np.abs(c - want).max())
print(open("/proc/self/maps").read())
print("STATUS:", blas_status())
"""


def clean_env() -> dict[str, str]:
    """This environment without any BLAS settings a test runner may have applied."""
    env = {k: v for k, v in os.environ.items()
           if k not in (blas.MARKER_VAR, blas.DISABLE_VAR, "LD_PRELOAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@linux_only
@needs_openblas
def test_child_with_blas_env_runs_openblas_and_matmul_is_right() -> None:
    env = clean_env()
    add = blas.blas_env(env)
    assert add is not None
    assert add["LD_PRELOAD"].split(os.pathsep)[0] == str(blas.find_openblas())
    assert add[blas.MARKER_VAR] == "1"
    r = subprocess.run([sys.executable, "-c", CHILD], env={**env, **add}, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(blas.find_openblas()) in r.stdout  # mapped into the child
    assert "STATUS: openblas via LD_PRELOAD" in r.stdout


@linux_only
@needs_openblas
def test_print_env_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "mlx_kvserver.blas", "--print-env"],
                       env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("export LD_PRELOAD=") and "libopenblas" in line for line in lines)
    assert f"export {blas.MARKER_VAR}=1" in lines
    # Once applied, there is nothing more to print.
    env = {**clean_env(), blas.MARKER_VAR: "1"}
    r = subprocess.run([sys.executable, "-m", "mlx_kvserver.blas", "--print-env"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == ""


def test_disabled_gives_none() -> None:
    assert blas.blas_env({**clean_env(), blas.DISABLE_VAR: "1"}) is None


def test_already_applied_gives_none() -> None:
    assert blas.blas_env({**clean_env(), blas.MARKER_VAR: "1"}) is None
    assert blas.blas_env({**clean_env(), "LD_PRELOAD": "/x/libopenblas.so.0"}) is None


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_non_linux_gives_none_and_reexec_is_noop(monkeypatch: pytest.MonkeyPatch,
                                                 platform: str) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    assert blas.blas_env(clean_env()) is None
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not exec"))
    blas.maybe_reexec(["x.py"])
    assert "openblas" not in blas.blas_status()


@linux_only
@needs_openblas
def test_maybe_reexec_execs_same_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in (blas.MARKER_VAR, blas.DISABLE_VAR, "LD_PRELOAD"):
        monkeypatch.delenv(k, raising=False)
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    blas.maybe_reexec(["serve.py", "--port", "1"])
    (exe, argv, env), = calls
    assert exe == sys.executable and argv == [sys.executable, "serve.py", "--port", "1"]
    assert env[blas.MARKER_VAR] == "1" and "libopenblas" in env["LD_PRELOAD"]


@linux_only
def test_failures_degrade_to_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    assert blas.blas_env(clean_env()) is None
    monkeypatch.setattr(blas, "find_openblas", lambda: (_ for _ in ()).throw(OSError("boom")))
    assert blas.blas_env(clean_env()) is None  # never raises


@linux_only
@needs_openblas
def test_unloadable_preload_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No libgfortran anywhere: an OpenBLAS preload would kill every child at start-up.
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(blas, "_gfortran_shim", lambda: tmp_path)  # an empty shim
    env = {k: v for k, v in clean_env().items() if k != "LD_LIBRARY_PATH"}
    assert blas.blas_env(env) is None
    monkeypatch.setattr(blas, "_gfortran_shim", lambda: None)
    assert blas.blas_env(env) is None
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not exec"))
    blas.maybe_reexec(["x.py"])


@linux_only
def test_shim_falls_back_when_prefix_not_writable(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    if not glob_numpy_gfortran():
        pytest.skip("numpy wheel without a bundled libgfortran")
    monkeypatch.setattr(blas.sys, "prefix", "/proc/not-writable")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shim = blas._gfortran_shim()
    assert shim is not None and shim.is_relative_to(tmp_path)
    assert (shim / "libgfortran.so.5").resolve().is_file()
    assert blas._gfortran_shim() == shim  # idempotent


def glob_numpy_gfortran() -> list[str]:
    libs = blas._numpy_libs()
    return [] if libs is None else [str(p) for p in libs.glob("libgfortran-*.so.5*")]


@linux_only
@needs_openblas
def test_openblas_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in clean_env().items() if k != "OPENBLAS_NUM_THREADS"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert blas.blas_env(env)["OPENBLAS_NUM_THREADS"] == "2"
    assert blas.blas_env({**env, blas.THREADS_VAR: "3"})["OPENBLAS_NUM_THREADS"] == "3"
    assert "OPENBLAS_NUM_THREADS" not in blas.blas_env({**env, "OPENBLAS_NUM_THREADS": "4"})
