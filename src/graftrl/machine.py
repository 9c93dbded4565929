"""This machine as torch sees it: the CPU kernels torch computes with (the same code, seed and data
give bit-identical floats on machines that share them, and other last bits elsewhere: float sums
are ordered differently by other kernels), and the CPUs and torch threads a command may use."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

__all__ = [
    "available_cpus",
    "contention_note",
    "cpu_capability",
    "cpu_kernels",
    "cpu_vendor",
    "torch_threads",
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
