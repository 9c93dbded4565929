"""The CPU kernels torch computes with here: the same code, seed and data give bit-identical
floats on machines that share them, and other last bits elsewhere (float sums are ordered
differently by other kernels)."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

__all__ = ["cpu_capability", "cpu_kernels", "cpu_vendor"]


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
