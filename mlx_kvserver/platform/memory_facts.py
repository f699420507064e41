"""The machine's memory as the server's budget needs it: :class:`MemoryFacts`.

One small interface over what differs between a Mac and Linux, read once from the real machine
by :func:`current` (or :func:`read`, which the tests give a Mac's or Linux's answers), so the
budget (``engine/memory.py``) runs the same code on every platform and its tests run the Mac's
figures on Linux and Linux's on a Mac:

- ``total``: physical memory. Metal: MLX's ``device_info()["memory_size"]`` (``sysctl
  hw.memsize``); else ``sysconf`` (Linux, macOS), else psutil.
- ``working_set``: on Metal, the device's ``recommendedMaxWorkingSetSize`` (MLX's
  ``device_info()["max_recommended_working_set_size"]``, reported as about 2/3 of the memory of
  Macs of 32 GB or less and 3/4 above; ``sudo sysctl iogpu.wired_limit_mb`` raises it). MLX's
  docs name the same figure the system's wired limit: ``mx.set_wired_limit`` above it is an
  error. None without Metal.
- ``resident()``: what the process holds now, in bytes, MLX's own buffers included (None where
  it cannot be read); the budget takes MLX's bytes off it for what the process holds outside MLX.

  On Linux (the CPU backend) MLX's buffers come from the process's own allocator: its resident
  set (psutil's ``rss``, the kernel's count of the process's resident pages) counts them.

  On macOS psutil's ``rss`` is the task's ``resident_size`` (``proc_pidinfo``): the resident
  pages of its address space. MLX's arrays there are Metal buffers (``MTLResourceStorageMode
  Shared``, unified memory, mapped into the process), which that figure counts only in part:
  clean mapped pages of the frameworks are in it, and a buffer's pages are only where the CPU
  mapped them (pages the GPU alone wrote need not be), and memory already freed stays in it until
  the kernel wants it back. What macOS charges the process for, and what Activity Monitor, the
  ``footprint`` tool and the memory-pressure killer use, is ``phys_footprint`` (``proc_pid_rusage``
  here): dirty and compressed memory and IOKit memory, where MLX's Metal buffers are, as
  "IOAccelerator (graphics)" (seen with ``footprint`` on MLX processes: ml-explore/mlx issue
  3896). So on macOS ``resident()`` reads ``phys_footprint``, which includes MLX's buffers, and
  falls back to psutil's ``rss`` where it cannot (``resident_source`` says which). Caveat from
  the same issue: the footprint trails ``mx.clear_cache()`` by a few seconds, so a reading just
  after one counts the cache's freed buffers as still held (the budget errs safe).

  On CUDA MLX's arrays are mostly device memory, which the resident set does not count, so the
  contract does not hold there: not examined here, read as on Linux (the budget as before).

  None of the macOS figures was measured on a Mac in this work (no Mac here): they are read from
  MLX's sources and docs (``mlx/backend/metal/device_info.cpp``, ``allocator.cpp``), psutil's,
  and the issues cited; the tests run this code with a Mac's answers.

Only the standard library, psutil and (lazily) MLX: the platform knows nothing of the server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform as _platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

UNKNOWN_TOTAL = 16 << 30  # the machine's memory where nothing says it: a modest machine


@dataclass(frozen=True)
class MemoryFacts:
    """What the budget needs of the machine (module docstring)."""

    system: str  # platform.system(): "Darwin", "Linux", ...
    total: int  # physical memory, bytes
    working_set: int | None  # Metal's recommended working set (= the system wired limit)
    resident: Callable[[], int | None] = field(compare=False, repr=False)  # the process now
    resident_source: str = "rss"  # "rss" (psutil), "phys_footprint" (macOS), "none"

    @property
    def budget_base(self) -> int:
        """What a default limit is a fraction of: on Metal the working set (what the GPU may
        keep wired), else the machine's memory."""
        return self.working_set if self.working_set is not None else self.total

    def wired_limit(self, limit: int) -> int | None:
        """The wired limit for a budget of ``limit`` bytes: the budget, never above the system's
        (MLX refuses more); None without Metal (nothing to wire)."""
        return None if self.working_set is None else min(int(limit), self.working_set)


def current() -> MemoryFacts:
    """This machine's facts, read now."""
    import mlx.core as mx

    return read(_platform.system(), mx)


def read(system: str, mlx: Any, libproc: Any = None) -> MemoryFacts:
    """The facts of a machine whose ``platform.system()`` is ``system`` and whose MLX is ``mlx``
    (``mlx.core``, or a stand-in answering ``metal.is_available()`` and ``device_info()``);
    ``libproc``: where ``proc_pid_rusage`` is found on macOS (None: libSystem)."""
    info = metal_info(mlx)
    total = int(info.get("memory_size") or 0) if info else 0
    working_set = int(info["max_recommended_working_set_size"]) if info else None
    source, resident = "rss", rss_reader()
    if system == "Darwin":
        footprint = footprint_reader(libproc)
        if footprint is not None:
            source, resident = "phys_footprint", footprint
        else:
            log.info("the process's footprint is not readable here: psutil's rss instead, "
                     "which counts MLX's Metal buffers only in part")
    if resident is None:
        source, resident = "none", lambda: None
    return MemoryFacts(system, total or machine_total(), working_set, resident, source)


def metal_info(mlx: Any) -> dict | None:
    """MLX's description of its Metal device (``memory_size``,
    ``max_recommended_working_set_size``); None without Metal."""
    try:
        if not mlx.metal.is_available():
            return None
        # the GPU's, whatever the default device (``mx.device_info()`` is the default device's)
        info = dict(mlx.device_info(mlx.gpu) if hasattr(mlx, "device_info")
                    else mlx.metal.device_info())
        int(info["max_recommended_working_set_size"])
        return info
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        return None


def machine_total() -> int:
    """The machine's physical memory in bytes: ``sysconf`` (Linux, macOS), else psutil."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except (ImportError, OSError, AttributeError):
        return UNKNOWN_TOTAL


def rss_reader() -> Callable[[], int | None] | None:
    """A reader of this process's resident set (psutil); None without psutil. It reads the
    process it runs in (a forked child reads its own)."""
    try:
        import psutil
    except ImportError:
        return None
    procs: dict[int, Any] = {}

    def rss() -> int | None:
        pid = os.getpid()
        try:
            proc = procs.get(pid) or procs.setdefault(pid, psutil.Process(pid))
            return int(proc.memory_info().rss)
        except (OSError, psutil.Error):
            return None
    return rss


class RusageInfoV0(ctypes.Structure):
    """``struct rusage_info_v0`` of macOS's ``<sys/resource.h>`` (``RUSAGE_INFO_V0``)."""

    _fields_ = [("uuid", ctypes.c_uint8 * 16)] + [
        (name, ctypes.c_uint64) for name in (
            "user_time", "system_time", "pkg_idle_wkups", "interrupt_wkups", "pageins",
            "wired_size", "resident_size", "phys_footprint", "proc_start_abstime",
            "proc_exit_abstime")]


RUSAGE_INFO_V0 = 0


def footprint_reader(libproc: Any = None) -> Callable[[], int | None] | None:
    """A reader of this process's ``phys_footprint`` (macOS: ``proc_pid_rusage``); None where
    the call is not there or does not answer."""
    try:
        lib = libproc if libproc is not None else ctypes.CDLL(
            ctypes.util.find_library("System") or "/usr/lib/libSystem.B.dylib")
        call = lib.proc_pid_rusage
        call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(RusageInfoV0)]
        call.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None

    def footprint() -> int | None:
        info = RusageInfoV0()
        if call(os.getpid(), RUSAGE_INFO_V0, ctypes.pointer(info)) != 0:
            return None
        return int(info.phys_footprint) or None
    return footprint if footprint() else None
