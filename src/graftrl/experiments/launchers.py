"""Who runs compare's cells: this process, spawned processes side by side, or a Ray cluster.

Every launcher runs the same ``cells.run_cell`` (train, evaluate, write the done marker), so the
cells, and every report made of them, are the same whichever ran them. A launcher gets the cells
not finished yet and calls ``record(seed, variant, done, ran)`` as each ends and
``record_warm_start(done)`` when the warm-start evaluation does.

- ``local`` with ``jobs`` 1: one cell after the other in this process, with live progress bars.
- ``local`` with ``jobs`` N: N spawned processes, each with an equal share of this process's torch
  threads; a bar per cell shows its training steps.
- ``ray``: each cell is a Ray task with the resources its config asks for (the sum of its
  policies' ``resources``; a ``backend: ray`` cell reserves nothing itself, its policies' actors
  do), on the cluster at the base config's ``ray.address`` or a Ray started here; the cluster
  runs as many at once as fit. A cell whose process or node dies is retried, ``tries`` times in
  all, and continues from its last checkpoint (``run_cell`` resumes a cell's own checkpoint);
  after that it is named in one line and the other cells go on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from graftrl.console import TaskBars
from graftrl.experiments.cells import (
    Verifiers,
    cell_config,
    cell_name,
    finished_cell,
    finished_warm_start,
    run_cell,
    warm_start_cell,
)
from graftrl.experiments.compare.task import CompareTask
from graftrl.experiments.matrix import CompareError, Variant

LAUNCHERS = ("local", "ray")
DEFAULT_TRIES = 2
"""Attempts a cell gets on a Ray cluster before it is reported as failed (a dead process or node)."""

Cell = tuple[int, Variant]
"""(seed, variant)."""


@dataclass(frozen=True)
class Launcher:
    """How compare runs its cells (``--launcher``, ``--jobs``, ``--tries``)."""

    kind: Literal["local", "ray"] = "local"
    jobs: int = 1
    """``local``: cells side by side."""
    tries: int = DEFAULT_TRIES
    """``ray``: attempts per cell (retries continue from the cell's last checkpoint)."""

    def __post_init__(self) -> None:
        if self.kind not in LAUNCHERS:
            raise CompareError(f"--launcher: one of {', '.join(LAUNCHERS)}, got {self.kind!r}")
        if self.jobs < 1:
            raise CompareError(f"--jobs must be >= 1, got {self.jobs}")
        if self.tries < 1:
            raise CompareError(f"--tries must be >= 1, got {self.tries}")

    @property
    def in_process(self) -> bool:
        return self.kind == "local" and self.jobs == 1


@dataclass(frozen=True)
class CellBatch:
    """The cells of one compare invocation and where their results go."""

    task: CompareTask
    steps: int | None
    out_dir: Path
    console: Console
    resume: bool
    donors: Mapping[str, Path]
    record: Callable[[int, Variant, dict[str, Any], bool], None]
    record_warm_start: Callable[[dict[str, Any]], None]


def launch(launcher: Launcher, batch: CellBatch, cells: Sequence[Cell], verifiers: Verifiers) -> list[str]:
    """Run ``cells`` (and the warm-start evaluation) with ``launcher``; returns the cells that
    died on every try (``ray``), by name."""
    if launcher.in_process:
        batch.record_warm_start(
            warm_start_cell(batch.task, batch.out_dir, verifiers, batch.console, batch.resume)
        )
        for seed, variant in cells:
            done, ran = run_cell(
                batch.task, variant, seed, batch.steps, batch.out_dir, verifiers, batch.console,
                batch.resume, donors=batch.donors,
            )  # fmt: skip
            batch.record(seed, variant, done, ran)
        return []
    pending, warm_start_due = _unfinished(batch, cells)
    if not pending and not warm_start_due:
        return []
    if launcher.kind == "ray":
        return _on_ray(batch, pending, warm_start_due, launcher.tries)
    _in_processes(batch, pending, warm_start_due, launcher.jobs)
    return []


def _unfinished(batch: CellBatch, cells: Sequence[Cell]) -> tuple[list[Cell], bool]:
    """Records the cells finished earlier (here or in a donor folder) without a process; returns
    the others and whether the warm-start evaluation is still to run."""
    pending = []
    for seed, variant in cells:
        done = None
        if batch.resume:
            done = finished_cell(
                batch.task, variant, seed, batch.steps, batch.out_dir, batch.console, batch.donors
            )
        if done is not None:
            batch.record(seed, variant, done, False)
        else:
            pending.append((seed, variant))
    warm_start = finished_warm_start(batch.task, batch.out_dir) if batch.resume else None
    if warm_start is not None:
        batch.record_warm_start(warm_start)
    return pending, warm_start is None


class _StepReport:
    """A cell's training steps, sent to the parent's display (picklable, unlike a closure)."""

    def __init__(self, queue: Any, label: str) -> None:
        self.queue, self.label = queue, label

    def __call__(self, done: int, total: int) -> None:
        self.queue.put((self.label, done, total))


def _cell_job(
    task: CompareTask,
    variant: Variant | None,
    seed: int,
    steps: int | None,
    out_dir: Path,
    resume: bool,
    threads: int,
    queue: Any = None,
) -> tuple[dict[str, Any], bool]:
    """One cell (``variant`` None: the warm-start evaluation) in a worker process or Ray task: its
    own torch threads and verifiers, no live bar of its own (its steps go to the parent's through
    ``queue``) and no per-file bars of transformers."""
    import torch

    from graftrl.console import quiet_transformers

    quiet_transformers()
    torch.set_num_threads(threads)
    with Verifiers() as verifiers:
        if variant is None:
            return warm_start_cell(task, out_dir, verifiers, Console(), resume), True
        report = None if queue is None else _StepReport(queue, f"{variant.name} seed {seed}")
        return run_cell(
            task, variant, seed, steps, out_dir, verifiers, Console(), resume, progress=False, on_step=report
        )


def _in_processes(batch: CellBatch, pending: Sequence[Cell], warm_start_due: bool, jobs: int) -> None:
    """``pending`` in ``jobs`` spawned processes sharing this process's torch threads, a live bar
    per cell and one for the cells done. The warm-start evaluation is queued after the cells: it
    fills a process that a shorter cell leaves idle instead of holding every cell back (the same
    scores: evaluation does not depend on the thread count, ``tests/test_compare.py``)."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    import torch

    from graftrl.workers import exit_with_parent, start_manager

    threads = max(1, torch.get_num_threads() // jobs)
    also = " and the warm-start evaluation" if warm_start_due else ""
    batch.console.print(
        f"training {len(pending)} cells{also}, {jobs} at a time ({threads} torch thread(s) each)"
    )
    context = mp.get_context("spawn")
    bars = TaskBars(batch.console)
    common = (batch.steps, batch.out_dir, batch.resume, threads)
    with (
        ProcessPoolExecutor(jobs, mp_context=context, initializer=exit_with_parent) as pool,
        start_manager(context) as manager,
    ):
        queue = manager.Queue()

        def drain() -> None:
            while not queue.empty():
                bars.update(*queue.get())

        futures: dict[Any, Cell | None] = {
            pool.submit(_cell_job, batch.task, variant, seed, *common, queue): (seed, variant)
            for seed, variant in pending
        }
        if warm_start_due:  # None: the warm-start evaluation
            futures[pool.submit(_cell_job, batch.task, None, 0, *common)] = None
        bars.update("cells done", 0, len(pending))
        running = set(futures)
        try:
            while running:
                finished, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                drain()
                for future in finished:
                    done, did_run = future.result()
                    if (cell := futures[future]) is None:
                        batch.record_warm_start(done)
                        continue
                    seed, variant = cell
                    batch.console.print(f"{variant.name} seed {seed}: done")
                    batch.record(seed, variant, done, did_run)
                    cells_running = sum(futures[f] is not None for f in running)
                    bars.update("cells done", len(pending) - cells_running, len(pending))
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
        finally:
            bars.close()


def cell_resources(config: Any) -> dict[str, float]:
    """What a cell's Ray task reserves: its policies' ``resources``, summed (they train in its
    process); nothing for a ``backend: ray`` cell, whose policies' actors reserve their own."""
    if config.backend == "ray":
        return {"num_cpus": 0, "num_gpus": 0}
    return {
        "num_cpus": sum(p.resources.num_cpus for p in config.policies),
        "num_gpus": sum(p.resources.num_gpus for p in config.policies),
    }


def _start_ray(config: Any) -> bool:
    """Join the cluster at the base config's ``ray.address``, or start a local Ray with its
    ``ray.num_cpus`` / ``ray.num_gpus``; True when this call started it (so it shuts it down)."""
    try:
        import ray
    except ImportError:
        raise CompareError(
            "--launcher ray needs Ray; install it with `pip install -e '.[ray]'`, or use --launcher local"
        ) from None
    if ray.is_initialized():
        return False
    settings = config.ray
    local = settings.address is None
    if local:  # Ray >= 2.5x turns on token auth for clusters it starts; a private local one needs none
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address=settings.address,
        num_cpus=settings.num_cpus if local else None,
        num_gpus=settings.num_gpus if local else None,
        include_dashboard=False,
    )
    return True


def _died(error: BaseException) -> bool:
    """A Ray error that says the cell's process or node died (retried), not that the cell failed."""
    import ray.exceptions as failures

    died = (
        failures.WorkerCrashedError,
        failures.NodeDiedError,
        failures.LocalRayletDiedError,
        failures.OwnerDiedError,
        failures.ObjectLostError,
        failures.OutOfMemoryError,
    )
    return isinstance(error, died) and not isinstance(error, failures.RayTaskError)


def _on_ray(batch: CellBatch, pending: Sequence[Cell], warm_start_due: bool, tries: int) -> list[str]:
    """``pending`` (and the warm-start evaluation) as Ray tasks; returns the cells that died on
    every try."""
    import ray

    base = batch.task.config
    started = _start_ray(base)
    remote = ray.remote(_cell_job)
    refs: dict[Any, Cell | None] = {}

    def submit(cell: Cell | None) -> None:
        seed, variant = cell if cell is not None else (0, None)
        config = cell_config(batch.task, variant, seed, batch.steps) if variant is not None else base
        resources = cell_resources(config)
        threads = max(1, int(resources["num_cpus"]))
        options = {**resources, "max_retries": tries - 1, "retry_exceptions": False}
        out_dir = batch.out_dir.resolve()  # the workers' working folder is not this one
        ref = remote.options(**options).remote(
            batch.task, variant, seed, batch.steps, out_dir, batch.resume, threads
        )
        refs[ref] = cell

    failed: list[str] = []
    bars = TaskBars(batch.console)
    try:
        for cell in pending:
            submit(cell)
        if warm_start_due:
            submit(None)
        batch.console.print(
            f"{len(refs)} cells on Ray ({ray.cluster_resources().get('CPU', 0):g} CPUs, "
            f"{ray.cluster_resources().get('GPU', 0):g} GPUs), as many at once as fit; {tries} tries each"
        )
        bars.update("cells done", 0, len(refs))
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in ready:
                cell = refs[ref]
                name = cell_name(cell[1].name, cell[0]) if cell is not None else "warm-start"
                try:
                    done, ran = ray.get(ref)
                except Exception as error:
                    if not _died(error):
                        raise
                    failed.append(name)
                    batch.console.print(
                        f"[red]{name}: its process or node died on each of {tries} tries "
                        f"({type(error).__name__}); rerun to continue it from its last checkpoint[/red]"
                    )
                    continue
                if cell is None:
                    batch.record_warm_start(done)
                else:
                    batch.console.print(f"{cell[1].name} seed {cell[0]}: done")
                    batch.record(cell[0], cell[1], done, ran)
                bars.update("cells done", len(refs) - len(waiting), len(refs))
    except BaseException:
        for ref in refs:
            with contextlib.suppress(Exception):  # a finished task cannot be cancelled
                ray.cancel(ref, force=True)
        raise
    finally:
        bars.close()
        if started:
            ray.shutdown()
    return failed
