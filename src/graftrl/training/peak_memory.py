"""A step's peak memory (``memory_peak_mb``): the CUDA allocator's, or the process's peak RSS.

The estimate before a run is ``graftrl.models.memory``; this is the measurement during one.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or the process's peak RSS (Linux clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # 5 resets VmHWM to the current RSS; elsewhere the peak stays the process's lifetime peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since ``reset_peak_memory``: CUDA allocator peak, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 2**10)
