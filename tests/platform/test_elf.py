"""Shared objects written in Python (mlx_kvserver/platform/elf.py), loaded by the real dynamic loader."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_kvserver.platform import elf

x86_64_linux = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="x86-64 Linux only")
RETURN_42 = b"\xb8\x2a\x00\x00\x00\xc3"  # mov eax, 42; ret


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_symbols_of_a_written_object_read_back(tmp_path: Path) -> None:
    so = elf.shared_object("libt.so", ["libc.so.6"], {"my_strlen": "strlen", "my_abs": "abs"},
                           {"forty_two": RETURN_42})
    machine, defined, undefined = elf.dynamic_symbols(write(tmp_path, "libt.so", so))
    assert machine == elf.EM_X86_64
    assert defined == {"my_strlen", "my_abs", "forty_two"}
    assert undefined == {"strlen", "abs"}
    # Deterministic: the same arguments give the same bytes (the cache relies on it).
    assert so == elf.shared_object("libt.so", ["libc.so.6"], {"my_strlen": "strlen",
                                                              "my_abs": "abs"},
                                   {"forty_two": RETURN_42})


def test_not_elf_is_refused(tmp_path: Path) -> None:
    with pytest.raises(elf.ElfError):
        elf.dynamic_symbols(write(tmp_path, "x.so", b"#!/bin/sh\n" * 20))
    with pytest.raises(ValueError):
        elf.shared_object("x.so", forwards={"f": "g"}, code={"f": RETURN_42})


@x86_64_linux
def test_forwards_and_code_run_in_this_process(tmp_path: Path) -> None:
    path = write(tmp_path, "libt.so", elf.shared_object(
        "libt.so", ["libc.so.6"], {"my_strlen": "strlen", "my_abs": "abs"},
        {"forty_two": RETURN_42}))
    lib = ctypes.CDLL(str(path))
    assert lib.my_strlen(b"hello") == 5
    assert lib.my_abs(-7) == 7
    assert lib.forty_two() == 42


@x86_64_linux
def test_forwarder_loads_its_target_by_path(tmp_path: Path) -> None:
    target = write(tmp_path, "libtarget.so", elf.shared_object("libtarget.so",
                                                               code={"t_42": RETURN_42}))
    fwd = write(tmp_path, "libfwd.so", elf.forwarder(target, {"f_42": "t_42"}, "libfwd.so"))
    assert ctypes.CDLL(str(fwd)).f_42() == 42


@x86_64_linux
def test_a_preloaded_forwarder_replaces_a_name_for_the_whole_process(tmp_path: Path) -> None:
    # getpid() answers 42 when a forwarder exporting "getpid" as a jump to t_42 is preloaded.
    target = write(tmp_path, "libtarget.so", elf.shared_object("libtarget.so",
                                                               code={"t_42": RETURN_42}))
    fwd = write(tmp_path, "libfwd.so", elf.forwarder(target, {"getpid": "t_42"}, "libfwd.so"))
    code = "import ctypes; print(ctypes.CDLL(None).getpid())"
    r = subprocess.run([sys.executable, "-c", code], env={"LD_PRELOAD": str(fwd)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "42", r.stderr
