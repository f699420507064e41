"""The machine's memory facts (mlx_kvserver/platform/memory_facts.py): this machine's, read for
real, and a Mac's and Linux's read through the same code from the answers their MLX and their
system calls give (so each platform's branch runs on the other)."""

from __future__ import annotations

import ctypes
import platform
from types import SimpleNamespace

import mlx.core as mx
import psutil

from mlx_kvserver.platform import memory_facts
from mlx_kvserver.platform.memory_facts import MemoryFacts, RusageInfoV0, current, read

GB = 1 << 30
# What MLX's device_info() says on a 32 GB Apple Silicon Mac (M1 Max): the recommended working
# set (the system's wired limit) is 2/3 of its memory
MAC_32GB = {"device_name": "Apple M1 Max", "architecture": "applegpu_g13s",
            "memory_size": 32 * GB, "max_recommended_working_set_size": 22906503168,
            "max_buffer_length": 17179869184, "resource_limit": 499000}
# ``phys_footprint``'s offset in ``struct rusage_info_v0`` (<sys/resource.h>: a 16-byte uuid,
# then user_time, system_time, pkg_idle_wkups, interrupt_wkups, pageins, wired_size,
# resident_size, phys_footprint, proc_start_abstime, proc_exit_abstime: uint64 each)
FOOTPRINT_AT, RUSAGE_V0_SIZE = 16 + 7 * 8, 16 + 10 * 8


def an_mlx(info: dict | None) -> SimpleNamespace:
    """MLX as a machine answers: with Metal where ``info`` is its GPU's device_info() (the
    default device, asked without one, is the CPU: its info has no working set)."""
    cpu = {"device_name": "Apple M1 Max", "architecture": "arm64"}
    return SimpleNamespace(gpu="gpu", metal=SimpleNamespace(is_available=lambda: info is not None),
                           device_info=lambda d=None: dict(info or {}) if d == "gpu" else cpu)


def a_libproc(footprint: int, status: int = 0) -> SimpleNamespace:
    """macOS's ``proc_pid_rusage`` as the kernel answers it: ``footprint`` written where the
    header puts ``phys_footprint``; ``status``: its return value (0: success)."""
    calls = []

    def proc_pid_rusage(pid, flavor, info):
        calls.append((pid, flavor))
        raw = (ctypes.c_uint8 * RUSAGE_V0_SIZE).from_address(ctypes.addressof(info.contents))
        raw[FOOTPRINT_AT:FOOTPRINT_AT + 8] = footprint.to_bytes(8, "little")
        return status
    return SimpleNamespace(proc_pid_rusage=proc_pid_rusage, calls=calls)


def test_this_machines_facts():
    facts = current()
    assert facts.system == platform.system()
    total = psutil.virtual_memory().total
    assert abs(facts.total - total) < 0.02 * total
    assert (facts.working_set is not None) == mx.metal.is_available()
    assert facts.budget_base == (facts.working_set or facts.total)
    resident = facts.resident()
    assert resident and resident >= mx.get_active_memory()  # MLX's buffers are in it
    if platform.system() == "Darwin":
        assert facts.resident_source == "phys_footprint"
    else:
        assert facts.resident_source == "rss"
        assert abs(resident - psutil.Process().memory_info().rss) < 64 << 20


def test_a_macs_facts_read_on_any_machine():
    """Metal: the machine's memory and the working set from MLX's device_info, the process's
    memory from its footprint (where its Metal buffers are counted)."""
    libproc = a_libproc(3 * GB + 12345)
    facts = read("Darwin", an_mlx(MAC_32GB), libproc)
    assert facts.total == 32 * GB and facts.working_set == 22906503168
    assert facts.budget_base == 22906503168  # not the machine's 32 GB
    assert facts.resident_source == "phys_footprint" and facts.resident() == 3 * GB + 12345
    assert libproc.calls[-1][1] == memory_facts.RUSAGE_INFO_V0
    assert facts.wired_limit(16 * GB) == 16 * GB
    assert facts.wired_limit(28 * GB) == 22906503168  # never above the system's: MLX refuses
    older = SimpleNamespace(metal=SimpleNamespace(is_available=lambda: True,
                                                  device_info=lambda: dict(MAC_32GB)))
    assert read("Darwin", older, libproc).working_set == 22906503168  # mx.metal.device_info
    assert ctypes.sizeof(RusageInfoV0) == RUSAGE_V0_SIZE
    assert RusageInfoV0.phys_footprint.offset == FOOTPRINT_AT


def test_a_mac_whose_footprint_cannot_be_read_falls_back_to_rss():
    for libproc in (SimpleNamespace(), a_libproc(0), a_libproc(GB, status=-1)):
        facts = read("Darwin", an_mlx(MAC_32GB), libproc)
        assert facts.resident_source == "rss"
        assert abs(facts.resident() - psutil.Process().memory_info().rss) < 64 << 20


def test_linuxs_facts_read_on_any_machine():
    """No Metal: the machine's memory from ``sysconf``, no working set, nothing to wire, the
    resident set (psutil); no footprint is asked for."""
    libproc = a_libproc(5 * GB)
    facts = read("Linux", an_mlx(None), libproc)
    assert facts.working_set is None and facts.wired_limit(16 * GB) is None
    assert abs(facts.total - psutil.virtual_memory().total) < 0.02 * psutil.virtual_memory().total
    assert facts.budget_base == facts.total
    assert facts.resident_source == "rss" and not libproc.calls


def test_an_mlx_that_says_nothing_of_its_device_is_no_metal():
    for info in ({}, {"max_recommended_working_set_size": "?"}):
        mlx = an_mlx(info)
        assert memory_facts.metal_info(mlx) is None
        assert read("Darwin", mlx, a_libproc(GB)).working_set is None


def test_facts_are_values():
    a = MemoryFacts("Darwin", 32 * GB, 22906503168, lambda: 1, "phys_footprint")
    b = MemoryFacts("Darwin", 32 * GB, 22906503168, lambda: 2, "phys_footprint")
    assert a == b  # the reader is how, not what
    assert a != MemoryFacts("Linux", 32 * GB, None, lambda: 1)
