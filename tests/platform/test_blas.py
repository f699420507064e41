"""Choosing, proving and preloading a BLAS for MLX (mlx_kvserver/platform/blas.py, blas_probe.py).

Misbehaving libraries are stand-ins written with the same ELF writer the product uses for its
forwarder: one whose ``cblas_sgemm`` is ``ud2`` (the CPU raises SIGILL, as it does for an
AVX-512 instruction on a CPU without AVX-512) and one whose ``cblas_sgemm`` writes zeros.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_kvserver.platform import blas, blas_candidates, blas_probe, elf

ROOT = Path(__file__).resolve().parents[2]
x86_64_linux = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="the forwarder and the stand-ins are x86-64 Linux code")
SIGILL_SGEMM = elf.ENDBR64 + b"\x0f\x0b"  # ud2
ZEROS_SGEMM = elf.ENDBR64 + bytes.fromhex(
    "4863c9"        # movsxd rcx, ecx            ; M
    "4863442430"    # movsxd rax, [rsp+48]       ; ldc
    "480fafc8"      # imul rcx, rax              ; M * ldc floats (row-major C)
    "488b7c2428"    # mov rdi, [rsp+40]          ; C
    "31c0"          # xor eax, eax
    "f3ab"          # rep stosd
    "c3")           # ret

CHILD = """
import numpy as np, mlx.core as mx
from mlx_kvserver.platform.blas import blas_status
rng = np.random.default_rng(0)
a = rng.standard_normal((512, 512), dtype=np.float32)
b = rng.standard_normal((512, 512), dtype=np.float32)
c = np.array(mx.array(a) @ mx.array(b))
want = a.astype(np.float64) @ b.astype(np.float64)
assert np.allclose(c, want, rtol=1e-4, atol=1e-3), float(np.abs(c - want).max())
print(open("/proc/self/maps").read())
print("STATUS:", blas_status())
"""


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache directory (verdicts, forwarders)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for k in (blas.MARKER_VAR, blas.DISABLE_VAR, blas.LIBRARY_VAR, "LD_PRELOAD",
              "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", blas.THREADS_VAR):
        monkeypatch.delenv(k, raising=False)
    return cache / "mlx-kvserver"


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def stand_in(tmp_path: Path, name: str, sgemm: bytes) -> Path:
    path = tmp_path / f"lib{name}.so"
    path.write_bytes(elf.shared_object(path.name, code={"cblas_sgemm": sgemm}))
    return path


def finder(name: str, lib: Path):
    return name, lambda environ: blas.Candidate(name, lib, lib)


def use_finders(monkeypatch: pytest.MonkeyPatch, *finders) -> None:
    monkeypatch.setattr(blas, "FINDERS", list(finders))


def count_children(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    real = blas_probe.run_child

    def counted(env, libraries, timeout=blas_probe.TIMEOUT_S):
        calls.append(libraries)
        return real(env, libraries, timeout)

    monkeypatch.setattr(blas_probe, "run_child", counted)
    return calls


# -- the probe -------------------------------------------------------------------------------


@x86_64_linux
def test_probe_rejects_a_library_that_dies_with_sigill(tmp_path: Path) -> None:
    lib = stand_in(tmp_path, "sigill", SIGILL_SGEMM)
    v = blas_probe.run_child({**clean_env(), "LD_PRELOAD": str(lib)}, [lib])
    assert not v.ok and v.keep and "SIGILL" in v.why, v


@x86_64_linux
def test_probe_rejects_a_library_that_computes_wrong_results(tmp_path: Path) -> None:
    lib = stand_in(tmp_path, "zeros", ZEROS_SGEMM)
    v = blas_probe.run_child({**clean_env(), "LD_PRELOAD": str(lib)}, [lib])
    assert not v.ok and v.keep and v.why.startswith("wrong results: max relative error 1 "), v


@x86_64_linux
def test_probe_rejects_a_library_that_is_not_loaded(tmp_path: Path) -> None:
    lib = stand_in(tmp_path, "zeros", ZEROS_SGEMM)
    v = blas_probe.run_child(clean_env(), [lib])  # not preloaded: not in the memory map
    assert not v.ok and not v.keep and "did not load" in v.why


@x86_64_linux
def test_probe_accepts_scipy_openblas_through_its_forwarder() -> None:
    c = blas.scipy_openblas(os.environ)
    assert isinstance(c, blas.Candidate), c
    v = blas_probe.run_child({**clean_env(), **blas.candidate_env(c, os.environ)}, c.files())
    assert v.ok and v.why.startswith("sgemm and an inverse through MLX match numpy"), v


# -- choosing and launching ------------------------------------------------------------------


@x86_64_linux
def test_launcher_skips_failing_libraries_and_takes_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    sigill, zeros = stand_in(tmp_path, "sigill", SIGILL_SGEMM), stand_in(tmp_path, "zeros",
                                                                         ZEROS_SGEMM)
    use_finders(monkeypatch, finder("sigill", sigill), finder("zeros", zeros),
                ("scipy-openblas32", blas.scipy_openblas))
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    with caplog.at_level(logging.WARNING, logger="mlx_kvserver.platform.blas"):
        blas.maybe_reexec(["serve.py"])
    (_, argv, env), = calls
    assert argv == [sys.executable, "serve.py"]
    assert env[blas.MARKER_VAR] == "scipy-openblas32"
    assert blas.FORWARDER in env["LD_PRELOAD"] and str(sigill) not in env["LD_PRELOAD"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one line per library left out
    assert warnings[0].startswith(f"BLAS: not using sigill ({sigill}): the check process died "
                                  "with SIGILL")
    assert warnings[1].startswith(f"BLAS: not using zeros ({zeros}): wrong results")


@x86_64_linux
def test_when_no_library_passes_the_launcher_runs_on_mlx_own_blas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    use_finders(monkeypatch, finder("sigill", stand_in(tmp_path, "sigill", SIGILL_SGEMM)))
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not exec"))
    with caplog.at_level(logging.WARNING, logger="mlx_kvserver.platform.blas"):
        blas.maybe_reexec(["serve.py"])
        assert blas.blas_env(os.environ) is None
        assert blas.export_lines() == ""
    assert "MLX uses its own reference BLAS" in caplog.records[-1].getMessage()


@x86_64_linux
def test_a_real_launch_leaves_out_a_sigill_library_and_computes_right(tmp_path: Path) -> None:
    lib = stand_in(tmp_path, "sigill", SIGILL_SGEMM)
    code = "from mlx_kvserver.platform import blas; blas.maybe_reexec()\n" + CHILD
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**clean_env(), blas.LIBRARY_VAR: str(lib)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"BLAS: not using {blas.LIBRARY_VAR} ({lib}): the check process died with SIGILL" \
        in r.stderr
    assert str(lib) not in r.stdout and "libscipy_openblas" in r.stdout  # mapped: the next one
    assert "STATUS: scipy-openblas32 via LD_PRELOAD" in r.stdout


@x86_64_linux
def test_blas_env_child_runs_the_chosen_library_and_matmul_is_right() -> None:
    env = clean_env()
    add = blas.blas_env(env)
    assert add is not None and add[blas.MARKER_VAR] == "scipy-openblas32"
    r = subprocess.run([sys.executable, "-c", CHILD], env={**env, **add}, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert add["LD_PRELOAD"].split(os.pathsep)[0] in r.stdout  # the forwarder is mapped
    assert "libscipy_openblas.so" in r.stdout
    assert f"STATUS: scipy-openblas32 via LD_PRELOAD, {add['OPENBLAS_NUM_THREADS']} threads" \
        in r.stdout


@x86_64_linux
def test_cli_reports_the_choice_and_prints_env(tmp_path: Path) -> None:
    env = {**clean_env(), blas.LIBRARY_VAR: str(stand_in(tmp_path, "zeros", ZEROS_SGEMM))}
    r = subprocess.run([sys.executable, "-m", "mlx_kvserver.platform.blas"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("BLAS for MLX: scipy-openblas32, ")
    assert any(ln.split()[:2] == [blas.LIBRARY_VAR, "rejected:"] and "wrong results" in ln
               for ln in lines), lines
    assert any(ln.split()[:3] == ["scipy-openblas32", "in", "use:"] for ln in lines), lines
    r = subprocess.run([sys.executable, "-m", "mlx_kvserver.platform.blas", "--print-env"], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("export LD_PRELOAD=") and blas.FORWARDER in ln for ln in lines)
    assert f"export {blas.MARKER_VAR}=scipy-openblas32" in lines
    # Once applied, there is nothing more to print.
    r = subprocess.run([sys.executable, "-m", "mlx_kvserver.platform.blas", "--print-env"],
                       env={**env, blas.MARKER_VAR: "scipy-openblas32"}, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == ""


def test_disabled_or_already_applied_gives_none() -> None:
    assert blas.blas_env({**clean_env(), blas.DISABLE_VAR: "1"}) is None
    assert blas.blas_env({**clean_env(), blas.MARKER_VAR: "scipy-openblas32"}) is None
    assert blas.blas_env({**clean_env(), "LD_PRELOAD": "/x/libopenblas.so.0"}) is None
    assert blas.blas_env({**clean_env(), "LD_PRELOAD": "/x/libmkl_rt.so.2"}) is None


@pytest.mark.parametrize("platform_name", ["darwin", "win32"])
def test_non_linux_gives_none_and_reexec_is_noop(monkeypatch: pytest.MonkeyPatch,
                                                 platform_name: str) -> None:
    monkeypatch.setattr(sys, "platform", platform_name)
    monkeypatch.setattr(blas, "FINDERS", [("boom", lambda env: pytest.fail("must not look"))])
    assert blas.blas_env(clean_env()) is None
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not exec"))
    blas.maybe_reexec(["x.py"])
    assert "openblas" not in blas.blas_status()


def test_a_finder_that_raises_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(environ):
        raise OSError("boom")

    use_finders(monkeypatch, ("broken", boom), ("absent", lambda env: "not installed"))
    choice = blas.choose(clean_env())
    assert choice.candidate is None and choice.env == {}
    assert choice.report == [("broken", "could not be set up: boom"),
                             ("absent", "not installed")]


def test_a_preload_path_with_a_space_is_refused(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "a b" / "libx.so"
    use_finders(monkeypatch, finder("spaced", lib))
    monkeypatch.setattr(blas_probe, "run_child", lambda *a: pytest.fail("must not run"))
    assert "cannot carry a space" in blas.choose(clean_env()).report[0][1]


# -- the verdict cache -----------------------------------------------------------------------


@x86_64_linux
def test_verdict_is_cached_per_library_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            private_cache: Path) -> None:
    lib = stand_in(tmp_path, "zeros", ZEROS_SGEMM)
    use_finders(monkeypatch, finder("zeros", lib))
    calls = count_children(monkeypatch)
    first = blas.choose(clean_env())
    assert len(calls) == 1 and first.report == [("zeros", first.report[0][1])]
    assert first.report[0][1].startswith("rejected: wrong results")
    second = blas.choose(clean_env())
    assert len(calls) == 1  # no child the second time
    assert second.report[0][1] == first.report[0][1] + " (verdict cached)"
    stored = json.loads((private_cache / blas_probe.VERDICTS_FILE).read_text())["verdicts"]
    assert [v["library"] for v in stored.values()] == [str(lib)]
    # Another library file at the same path (size or mtime differ) is checked again.
    lib.write_bytes(elf.shared_object(lib.name, code={"cblas_sgemm": SIGILL_SGEMM}))
    os.utime(lib, ns=(1, 1))
    third = blas.choose(clean_env())
    assert len(calls) == 2 and "SIGILL" in third.report[0][1]


def test_verdict_is_keyed_by_cpu_and_kernel_variables(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x")
    key = blas_probe.verdict_key("x", [lib], {})
    assert key == blas_probe.verdict_key("x", [lib], {"UNRELATED": "1"})
    assert key != blas_probe.verdict_key("x", [lib], {"OPENBLAS_CORETYPE": "Haswell"})
    assert key != blas_probe.verdict_key("y", [lib], {})
    monkeypatch.setattr(blas_probe, "cpu_identity", lambda: "another CPU")
    assert key != blas_probe.verdict_key("x", [lib], {})


def test_a_verdict_that_may_change_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               private_cache: Path) -> None:
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x")
    use_finders(monkeypatch, finder("slow", lib))
    calls = []
    monkeypatch.setattr(blas_probe, "run_child", lambda env, libs: calls.append(libs) or
                        blas_probe.Verdict(False, "the check did not finish in 180 s",
                                           keep=False))
    blas.choose(clean_env())
    blas.choose(clean_env())
    assert len(calls) == 2
    assert not (private_cache / blas_probe.VERDICTS_FILE).exists()


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"verdicts": 3}', b"\xff\xfe",
                                     b'{"verdicts": {"k": {"ok": "yes", "why": 1}}}'])
def test_a_corrupt_verdict_file_is_ignored_and_rewritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: Path,
        content: bytes) -> None:
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x")
    private_cache.mkdir(parents=True, mode=0o700)
    (private_cache / blas_probe.VERDICTS_FILE).write_bytes(content)
    use_finders(monkeypatch, finder("x", lib))
    monkeypatch.setattr(blas_probe, "run_child",
                        lambda env, libs: blas_probe.Verdict(False, "wrong results: test"))
    assert blas.choose(clean_env()).report == [("x", "rejected: wrong results: test")]
    assert blas.choose(clean_env()).report == [("x", "rejected: wrong results: test "
                                                     "(verdict cached)")]


def test_cache_dir_must_be_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "mlx-kvserver").mkdir(parents=True)
    (shared / "mlx-kvserver").chmod(0o777)
    got = blas_probe.cache_dir({"XDG_CACHE_HOME": str(shared)})
    assert got is not None and not got.is_relative_to(shared)  # the private fallback
    assert blas_probe.cache_dir({"XDG_CACHE_HOME": str(tmp_path / "ok")}) == \
        tmp_path / "ok" / "mlx-kvserver"


@x86_64_linux
def test_forwarder_is_written_once_and_reused(private_cache: Path) -> None:
    first = blas.scipy_openblas(os.environ)
    assert isinstance(first, blas.Candidate) and first.preload.parent == private_cache
    mtime = first.preload.stat().st_mtime_ns
    second = blas.scipy_openblas(os.environ)
    assert second == first and first.preload.stat().st_mtime_ns == mtime
    _, defined, undefined = elf.dynamic_symbols(first.preload)
    assert "cblas_sgemm" in defined and "sgetrf_" in defined  # what libmlx.so imports
    assert defined <= blas_candidates.mlx_imports()
    assert undefined == {blas_candidates.SCIPY_PREFIX + n for n in defined}


# -- other candidates and threads ------------------------------------------------------------


def test_mkl_candidate_uses_its_own_thread_variable(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas_candidates, "_dist_file", lambda dist, match: None)
    assert blas.intel_mkl({}) == "not installed"
    lib = tmp_path / "libmkl_rt.so.2"
    monkeypatch.setattr(blas_candidates, "_dist_file",
                        lambda dist, match: lib if match(lib.name) else None)
    c = blas.intel_mkl({})
    assert c == blas.Candidate("mkl", lib, lib, threads_var="MKL_NUM_THREADS")
    add = blas.candidate_env(c, {blas.THREADS_VAR: "3"})
    assert add["MKL_NUM_THREADS"] == "3" and "OPENBLAS_NUM_THREADS" not in add


def test_cmeel_candidate_gets_a_libgfortran_directory(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     private_cache: Path) -> None:
    monkeypatch.setattr(blas_candidates, "find_openblas", lambda: None)
    assert blas.cmeel_openblas(os.environ) == "not installed"
    lib = tmp_path / "libopenblas.so.0"
    monkeypatch.setattr(blas_candidates, "find_openblas", lambda: lib)
    monkeypatch.setattr(blas_candidates.ctypes.util, "find_library", lambda name: None)
    numpy_libs = tmp_path / "numpy.libs"
    numpy_libs.mkdir()
    (numpy_libs / "libgfortran-abc.so.5.0.0").write_bytes(b"")
    (numpy_libs / "libquadmath-def.so.0.0.0").write_bytes(b"")
    monkeypatch.setattr(blas_candidates, "_numpy_libs", lambda: numpy_libs)
    c = blas.cmeel_openblas(os.environ)
    assert isinstance(c, blas.Candidate) and c.library_path is not None
    assert c.library_path.parent == private_cache
    assert (c.library_path / "libgfortran.so.5").resolve() == numpy_libs / \
        "libgfortran-abc.so.5.0.0"
    assert (c.library_path / "libquadmath-def.so.0.0.0").is_symlink()
    assert blas.cmeel_openblas(os.environ) == c  # idempotent
    add = blas.candidate_env(c, {"LD_LIBRARY_PATH": "/x"})
    assert add["LD_LIBRARY_PATH"] == f"{c.library_path}{os.pathsep}/x"
    monkeypatch.setattr(blas_candidates, "_numpy_libs", lambda: None)
    assert blas.cmeel_openblas(os.environ) == \
        "no libgfortran.so.5 on this system or in numpy's wheel"


def test_physical_cores_count_smt_siblings_once(tmp_path: Path) -> None:
    for cpu, (pkg, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{pkg}\n")
        (topo / "core_id").write_text(f"{core}\n")
    assert blas.physical_cores(range(6), tmp_path) == 3
    assert blas.physical_cores([0, 2], tmp_path) == 1  # two siblings of one core
    assert blas.physical_cores(range(8), tmp_path) == 8  # no topology for cpu6: count CPUs


def test_default_threads() -> None:
    got = {n: blas.default_threads(n) for n in (1, 2, 3, 4, 6, 8, 16, 17, 64, 128)}
    assert got == {1: 1, 2: 1, 3: 2, 4: 3, 6: 5, 8: 7, 16: 15, 17: 16, 64: 16, 128: 16}


def test_thread_count_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "usable_cpus", lambda: list(range(12)))
    monkeypatch.setattr(blas, "physical_cores", lambda cpus: len(list(cpus)) // 2)
    assert blas._threads({}, "OPENBLAS_NUM_THREADS") == "5"
    assert blas._threads({blas.THREADS_VAR: "3"}, "OPENBLAS_NUM_THREADS") == "3"
    assert blas._threads({blas.THREADS_VAR: "x"}, "OPENBLAS_NUM_THREADS") == "5"
    assert blas._threads({"OPENBLAS_NUM_THREADS": "4"}, "OPENBLAS_NUM_THREADS") is None
    c = blas.Candidate("x", Path("/l.so"), Path("/l.so"))
    assert "OPENBLAS_NUM_THREADS" not in blas.candidate_env(c, {"OPENBLAS_NUM_THREADS": "4"})
    assert blas.candidate_env(c, {})["OPENBLAS_NUM_THREADS"] == "5"


def test_the_launch_asks_glibc_for_huge_pages_and_a_fixed_mmap_threshold_unless_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = blas.Candidate("x", Path("/lib/libx.so"), Path("/lib/libx.so"))
    monkeypatch.setattr(blas.platform, "libc_ver", lambda: ("glibc", "2.36"))
    both = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=65536"
    assert blas.candidate_env(c, {})["GLIBC_TUNABLES"] == both
    assert blas.candidate_env(c, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})[
        "GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + both
    assert blas.candidate_env(c, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})[
        "GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0:glibc.malloc.mmap_threshold=65536"
    assert "GLIBC_TUNABLES" not in blas.candidate_env(
        c, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1:glibc.malloc.hugetlb=0"})
    monkeypatch.setattr(blas.platform, "libc_ver", lambda: ("", ""))  # musl, or not Linux
    assert "GLIBC_TUNABLES" not in blas.candidate_env(c, {})
