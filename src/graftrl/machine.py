"""This machine as torch sees it: the CPU kernels torch computes with (the same code, seed and data
give bit-identical floats on machines that share them, and other last bits elsewhere: float sums
are ordered differently by other kernels), and the CPUs and torch threads a command may use."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from functools import cache
from pathlib import Path

__all__ = [
    "ALLOCATOR_SETTINGS",
    "available_cpus",
    "contention_note",
    "cpu_capability",
    "cpu_kernels",
    "cpu_vendor",
    "torch_threads",
    "tune_allocator",
]


def cpu_capability() -> str:
    """The instruction-set family torch dispatches its own kernels to (``AVX2``, ``AVX512``, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


@cache
def cpu_vendor() -> str:
    """The CPU's vendor (``GenuineIntel``, ``AuthenticAMD``; the machine type where unknown): the
    BLAS library picks its code paths by vendor too, so one capability gives other bytes on
    Intel and AMD (measured: AVX-512 on an AMD EPYC and on the machine of the committed
    experiments)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in {"vendor_id", "CPU implementer"}:
                return value.strip()
    return platform.machine() or "unknown"


def cpu_kernels() -> str:
    """``"<capability> <vendor>"``, e.g. ``"AVX512 AuthenticAMD"``: the key under which warm-started
    weights are recorded (docs/demo/worked/provenance.json) and shipped (``embedded.shipped``)."""
    return f"{cpu_capability()} {cpu_vendor()}"


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a container's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def torch_threads(cpus: int, processes: int = 1, requested: int | None = None) -> int:
    """torch intra-op threads for each of ``processes`` torch processes sharing ``cpus`` CPUs.

    ``requested`` (``--threads``) wins; otherwise an equal share of the CPUs, at least 1. The choice
    depends only on the machine's CPUs, never on its momentary load: the thread count changes the
    order of float reductions, so a load-dependent choice would make a resumed run differ from an
    uninterrupted one.
    """
    if requested is not None:
        return max(1, requested)
    return max(1, cpus // max(1, processes))


def contention_note(threads: int, cpus: int, load: float) -> str | None:
    """A hint when other work already keeps some of the CPUs busy (1-minute load average ``load``).

    torch's OpenMP threads spin at barriers: with 2 threads per process and another busy process on
    2 cores, a 60-step embedded run took more than 8 minutes instead of ~70 s. None when the run's
    threads fit on the CPUs left free (or it uses 1 thread).
    """
    free = max(1, cpus - round(load))
    if threads <= free:
        return None
    return (
        f"the CPUs are busy (load average {load:.1f} on {cpus} CPUs) and torch uses {threads} threads, "
        f"which spin when cores are shared; if this run is slow, give it --threads {free} "
        f"(or GRAFTRL_THREADS={free}), 1 per process when several graftrl runs share the machine"
    )


#: glibc malloc settings for a torch process: (mallopt parameter, environment variable, value).
#: torch frees and re-allocates tensors of megabytes at every decoding step (the KV cache's
#: concatenation, activations) and every backward pass. By default glibc serves blocks above a
#: moving threshold with fresh mmap pages and gives the heap's top back to the kernel once 128 KiB+
#: of it are free, so the kernel zero-fills the same memory again and again (~500,000 page faults
#: in 8 steps of a demo cell). Blocks up to 32 MiB from the heap, and up to 1 GiB of free heap kept,
#: remove three quarters of them. Setting either value also stops glibc's own threshold moves. The
#: arithmetic, and so every sample and weight, is unchanged: torch aligns each tensor to 64 bytes
#: wherever it lives. Measured in benchmarks/README.md ("A third sitting: the allocator").
ALLOCATOR_SETTINGS: tuple[tuple[int, str, int], ...] = (
    (-3, "MALLOC_MMAP_THRESHOLD_", 32 << 20),  # M_MMAP_THRESHOLD (glibc's maximum)
    (-1, "MALLOC_TRIM_THRESHOLD_", 1 << 30),  # M_TRIM_THRESHOLD
)

ALLOCATOR_OPT_OUT = "GRAFTRL_MALLOC"
"""Environment variable: ``default`` keeps glibc's own malloc settings."""


def tune_allocator() -> bool:
    """Apply ``ALLOCATOR_SETTINGS`` to this process (``mallopt``) and, through the environment, to
    the processes it starts (glibc reads them at start-up). Returns whether it did.

    Nothing changes when the C library is not glibc, when ``GRAFTRL_MALLOC=default``, or when the
    user chose malloc settings of their own (``GLIBC_TUNABLES`` or another ``MALLOC_*`` value).
    """
    if os.environ.get(ALLOCATOR_OPT_OUT, "").lower() == "default":
        return False
    ours = {variable: str(value) for _, variable, value in ALLOCATOR_SETTINGS}
    users = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if "GLIBC_TUNABLES" in os.environ or any(ours.get(k) != v for k, v in users.items()):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    for parameter, variable, value in ALLOCATOR_SETTINGS:
        if libc.mallopt(parameter, value) != 1:
            return False
        os.environ[variable] = str(value)
    return True
