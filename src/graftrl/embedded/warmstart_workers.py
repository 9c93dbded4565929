"""The embedded models' warm-starts side by side: each in a worker process of its own.

``warmstart.prepare_embedded_models`` hands its jobs here; each worker runs ``warm_start`` with
one thread and sends its progress reports back through a queue, drained as they come.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from graftrl.console import quiet_transformers
from graftrl.workers import exit_with_parent, start_manager


class _QueueReport:
    """A worker's ``warm_start`` reports, sent to the parent (picklable, unlike a closure)."""

    def __init__(self, queue: Any, name: str) -> None:
        self.queue, self.name = queue, name

    def __call__(self, info: dict[str, Any]) -> None:
        self.queue.put((self.name, info))


def _quiet(warm_start: Callable[..., dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """``warm_start`` in a worker process of graftrl's: without transformers' per-file bars."""
    quiet_transformers()
    return warm_start(**kw)


def warm_start_in_workers(
    warm_start: Callable[..., dict[str, Any]],
    jobs: Mapping[str, dict[str, Any]],
    on_progress: Callable[[str, dict[str, Any]], None] | None,
) -> None:
    """``warm_start(**job)`` for each model in its own process (one thread each); their reports
    drained here as they come."""
    context = mp.get_context("spawn")
    reporting = start_manager(context) if on_progress is not None else contextlib.nullcontext()
    with (
        ProcessPoolExecutor(len(jobs), mp_context=context, initializer=exit_with_parent) as pool,
        reporting as manager,
    ):
        queue = manager.Queue() if manager is not None else None
        pending = {
            pool.submit(
                _quiet, warm_start, threads=1, report=_QueueReport(queue, name) if queue else None, **kw
            )
            for name, kw in jobs.items()
        }

        def drain() -> None:
            while queue is not None and not queue.empty():
                assert on_progress is not None
                on_progress(*queue.get())

        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            drain()
            for future in done:
                future.result()
        drain()
