"""Helpers shared by the benchmark scripts (timing, statistics, tables, memory, threads).

Import this module before torch in a script's ``main()`` only through :func:`set_threads`, which
must run before torch creates its thread pools.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def set_threads(threads: int) -> None:
    """Pin intra-op threads (call before importing torch where possible, and after, to be sure)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set (interop pool started): harmless
        torch.set_num_interop_threads(1)


def quiet_hf() -> None:
    """Silence transformers' progress bars and info logs (they would land in the timings' output)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - older/newer transformers
        pass


def median(values: Iterable[float | None]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return statistics.median(kept) if kept else None


def mean(values: Iterable[float | None]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain Markdown table (pastes into benchmarks/README.md as is)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(f"\n{title}\n")
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


class PeakRSS:
    """Peak resident set size of this process between ``reset()`` and ``read_mb()``.

    Linux: writing 5 to /proc/self/clear_refs resets VmHWM, read back from /proc/self/status.
    Elsewhere (or when clear_refs is not writable) it falls back to ``getrusage``'s lifetime
    high-water mark, which cannot be reset (``resettable`` is then False).
    """

    def __init__(self) -> None:
        self.resettable = self._try_reset()

    @staticmethod
    def _try_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.resettable:
            self._try_reset()

    def read_mb(self) -> float:
        if self.resettable:
            with open("/proc/self/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def contention_note(threads: int) -> str | None:
    """A warning line when the 1-minute load average says other work shares the CPU."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    if load > 0.5:
        return (
            f"NOTE: 1-minute load average {load:.2f} before the run (this benchmark uses {threads} "
            "thread(s)): other processes share the CPU, timings are contended."
        )
    return None


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


class Stopwatch:
    """Accumulates wall time under a label; ``sync`` (e.g. torch.cuda.synchronize) runs at both ends."""

    def __init__(self, sync=None) -> None:
        self.sync = sync
        self.totals: dict[str, float] = {}

    def __call__(self, label: str):
        watch = self

        class _Span:
            def __enter__(self_inner):
                if watch.sync:
                    watch.sync()
                self_inner.start = time.perf_counter()
                return self_inner

            def __exit__(self_inner, *exc):
                if watch.sync:
                    watch.sync()
                watch.totals[label] = watch.totals.get(label, 0.0) + time.perf_counter() - self_inner.start
                return False

        return _Span()


def embedded_paths(cache_dir: str | None, task: str | None = None) -> dict[str, Path]:
    """The warm-started embedded models of ``task`` (default: the original, arith; trained once,
    then cached)."""
    from graftrl.embedded.warmstart import prepare_embedded_models

    cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "graftrl" / "embedded"
    return prepare_embedded_models(cache, **({"task": task} if task else {}))


def embedded_train_file(out_dir: Path, n_train: int = 1200, seed: int = 0) -> Path:
    """The demo's procedural training problems as JSONL (same split as `graftrl demo`)."""
    from graftrl.embedded.task import make_split

    train, _ = make_split(seed=seed, n_train=n_train, n_eval=256)
    path = out_dir / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n" for p in train)
    )
    return path


class CoinVerifier:
    """0/1 rewards at random (p = 0.5), seeded; MathVerifier's interface (score / close / context)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def score(self, texts, answers, *args, **kwargs) -> list[float]:
        return [float(self.rng.random() < 0.5) for _ in texts]

    def close(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
