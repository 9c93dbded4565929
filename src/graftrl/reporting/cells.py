"""The cells of `graftrl compare`: one (variant, seed) run each, trained and evaluated, or reused.

Every cell trains in ``OUT/runs/<variant>-seed<seed>/`` and, when done, writes ``done.json`` there
with its result rows and a digest of everything that determines it (its config with the files by
content, and the evaluation). A rerun skips cells whose marker matches, and restarts any other
cell from scratch (an interrupted run directory is deleted, not resumed); a finished cell with the
same digest in another folder (``--reuse``) is copied instead of trained. Cells may train side by
side in spawned processes (``run_cells_in_parallel``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.config import ConfigError, apply_overrides, config_from_dict
from graftrl.console import TaskBars
from graftrl.evaluation.stats import WARM_START
from graftrl.reporting.compare_task import CompareTask, evaluate_policies
from graftrl.reporting.matrix import CompareError, Variant
from graftrl.reporting.run_logs import read_run_metrics
from graftrl.storage.rundir import ExperimentDir, RunDir


def cell_config(task: CompareTask, variant: Variant, seed: int, steps: int | None) -> Any:
    """The validated Config of one cell; errors name the variant."""
    raw = copy.deepcopy(task.base_config)
    raw.update(method=variant.method, seed=seed)
    try:
        if steps is not None:
            apply_overrides(raw, [f"train.steps={steps}"])
        apply_overrides(raw, variant.overrides())
        config = config_from_dict(raw, "(base config + the row's overrides)")
    except (ConfigError, KeyError, IndexError, TypeError, ValueError) as error:
        raise CompareError(f"variant {variant.name!r}: {error}") from None
    from graftrl.methods import build_method

    try:
        build_method(config.method, config)
    except ValueError as error:
        raise CompareError(f"variant {variant.name!r}: {error}") from None
    return config


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


CELL_VERSION = 1
"""Part of every cell's digest. Bump it with any change that alters what a cell computes — a
changed default, a fix in training or evaluation — so that finished cells are retrained rather
than reused. (The key leaves out fields at their defaults, so a new config field, whose default
keeps today's behaviour, does not invalidate the cells already run.)"""


def _cell_key(task: CompareTask, config: Any) -> dict[str, Any]:
    """The cell's config without the fields at their defaults, its files named by content, not
    location: each policy's path by its starting weights' hash, the training file by its hash. A
    finished cell committed from one checkout (or cache folder) is then recognised in another."""
    from graftrl.files import sha256_file

    raw = config.model_dump(mode="json", exclude_defaults=True)
    models = task.provenance.get("models", {})
    for policy in raw["policies"]:
        if policy["name"] in models:
            policy["path"] = models[policy["name"]]["weights_sha256"]
    train = Path(raw["data"]["train"])
    if train.is_file():
        raw["data"]["train"] = sha256_file(train)[0]
    return raw


def _cell_digest(task: CompareTask, config: Any) -> str:
    """What a cell's done marker must match: its config (files by content) and the evaluation."""
    return _digest(CELL_VERSION, _cell_key(task, config), _eval_key(task))


def _eval_key(task: CompareTask) -> list[Any]:
    s = task.settings
    return [s.eval_samples, s.max_new_tokens, [p.id for p in task.heldout]]


def _read_done(path: Path, digest: str) -> dict[str, Any] | None:
    try:
        done = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):  # missing, or damaged (not UTF-8, not JSON): the cell runs again
        return None
    return done if isinstance(done, dict) and done.get("digest") == digest else None


def write_json_atomic(path: Path, data: Any) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=2))
    staging.replace(path)


def _compute_per_model(run_dir: Path, batch_prompts: int, n: int) -> dict[str, float]:
    """Mean over the models of each one's run totals: responses sampled (dynamic sampling logs its
    prompts per step), rows trained and optimizer steps (what HACPO's pooled batch doubles)."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in read_run_metrics(run_dir):
        model = totals[row["model"]]
        model["rollouts_per_model"] += int(row.get("prompts_sampled") or batch_prompts) * n
        model["rows_trained_per_model"] += int(row.get("train_rows") or 0)
        model["optimizer_steps_per_model"] += int(row.get("optimizer_steps") or 0)
    keys = ("rollouts_per_model", "rows_trained_per_model", "optimizer_steps_per_model")
    return {k: statistics.fmean(m[k] for m in totals.values()) if totals else 0.0 for k in keys}


def run_cell(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    verifier: Any,
    console: Console,
    resume: bool = True,
    progress: bool = True,
    donors: Mapping[str, Path] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Train and evaluate one (variant, seed) cell, or reuse its done marker. Returns (done, ran).

    ``resume`` False: the cell trains afresh and writes no marker (the demo's way). ``progress``
    False: no live progress bar (cells running side by side would draw over each other).
    ``donors``: finished cells elsewhere by digest (``donor_cells``), copied instead of trained.
    ``on_step(steps done, steps)``: after every training step (a display in another process).
    """
    from graftrl.training.trainer import Trainer

    config = cell_config(task, variant, seed, steps)
    run_dir = ExperimentDir(out_dir).run(variant.name, seed).root
    digest = _cell_digest(task, config)
    done = _finished(run_dir, digest, variant, seed, console, donors or {}) if resume else None
    if not progress:  # after the digest: how a run is displayed does not change its result
        config = config.model_copy(update={"logging": config.logging.model_copy(update={"progress": False})})
    if done is not None:
        return done, False
    if run_dir.exists():  # unfinished, or finished under another config: start it over
        if resume:
            console.print(f"{variant.name} seed {seed}: discarding the unfinished run in {run_dir}")
        shutil.rmtree(run_dir)
    method = "" if variant.method == variant.name else f" ({variant.method})"
    console.print(f"[bold]{variant.name}[/bold]{method} seed {seed}: {config.train.steps} steps")
    start = time.perf_counter()
    callback = None if on_step is None else (lambda step, _: on_step(step + 1, config.train.steps))
    trainer = Trainer(config, run_dir, verifier=verifier, step_callback=callback)
    trainer.train()
    wall = time.perf_counter() - start
    scores = evaluate_policies(trainer.policies, task.heldout, verifier, task.settings, seed)
    rows = [
        {
            "variant": variant.name,
            "method": variant.method,
            "model": model,
            "seed": seed,
            "n": config.rollout.n,
            **score,
            "steps": config.train.steps,
            "wall_s": round(wall, 2),
        }
        for model, score in scores.items()
    ]
    done = {
        "digest": digest,
        "rows": rows,
        "set": variant.set,
        **_compute_per_model(run_dir, config.train.batch_prompts, config.rollout.n),
    }
    if resume:
        write_json_atomic(RunDir(run_dir).done, done)
    return done, True


def _warm_start_config(task: CompareTask) -> Any:
    return config_from_dict({**copy.deepcopy(task.base_config), "method": "grpo"})


def _warm_start_digest(task: CompareTask, config: Any) -> str:
    return _digest(CELL_VERSION, _cell_key(task, config)["policies"], _eval_key(task))


def finished_warm_start(task: CompareTask, out_dir: Path) -> dict[str, Any] | None:
    """The warm-start evaluation's done marker when it holds this task's digest, else None."""
    run_dir = ExperimentDir(out_dir).run(WARM_START).root
    return _read_done(RunDir(run_dir).done, _warm_start_digest(task, _warm_start_config(task)))


def warm_start_cell(
    task: CompareTask, out_dir: Path, verifier: Any, console: Console, resume: bool = True
) -> dict[str, Any]:
    """pass@1 of the untrained policies (evaluated once; its marker is reused like any cell's).

    ``resume`` False: evaluated afresh, nothing written.
    """
    from graftrl.evaluation.targets import ModelTarget

    config = _warm_start_config(task)
    run_dir = ExperimentDir(out_dir).run(WARM_START).root
    digest = _warm_start_digest(task, config)
    done = _read_done(RunDir(run_dir).done, digest) if resume else None
    if done is not None:
        return done
    if resume:
        console.print("[bold]warm-start[/bold]: evaluating the initial policies")
        run_dir.mkdir(parents=True, exist_ok=True)
    policies = [ModelTarget.of_policy(p).load() for p in config.policies]
    scores = evaluate_policies(policies, task.heldout, verifier, task.settings, seed=0)
    rows = [
        {
            "variant": WARM_START,
            "method": WARM_START,
            "model": model,
            "seed": 0,
            "n": config.rollout.n,
            **score,
            "steps": 0,
            "wall_s": 0.0,
        }
        for model, score in scores.items()
    ]
    done = {"digest": digest, "rows": rows, "set": {}, "rollouts_per_model": 0.0}
    if resume:
        write_json_atomic(RunDir(run_dir).done, done)
    return done


def finished_cell(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    console: Console,
    donors: Mapping[str, Path] | None = None,
) -> dict[str, Any] | None:
    """The cell's done marker when it finished under the same config and evaluation (here, or in
    a donor folder: then copied here), else None."""
    config = cell_config(task, variant, seed, steps)
    run_dir = ExperimentDir(out_dir).run(variant.name, seed).root
    return _finished(run_dir, _cell_digest(task, config), variant, seed, console, donors or {})


def donor_cells(folders: Sequence[Path]) -> dict[str, Path]:
    """Finished cells under ``folders`` (compare, demo-preset or sweep outputs), by digest."""
    cells: dict[str, Path] = {}
    for folder in folders:
        if not Path(folder).is_dir():
            raise CompareError(f"--reuse: {folder} is not a folder (give compare or sweep output folders)")
        for marker in sorted(Path(folder).rglob(RunDir(Path()).done.name)):
            try:
                digest = json.loads(marker.read_bytes().decode("utf-8")).get("digest")
            except (OSError, ValueError, AttributeError):  # a damaged marker donates nothing
                continue
            if isinstance(digest, str) and marker.parent.parent.name == ExperimentDir(Path()).runs.name:
                cells.setdefault(digest, marker.parent)
    return cells


def _finished(
    run_dir: Path, digest: str, variant: Variant, seed: int, console: Console, donors: Mapping[str, Path]
) -> dict[str, Any] | None:
    done = _read_done(RunDir(run_dir).done, digest)
    if done is not None:
        console.print(f"[dim]{variant.name} seed {seed}: finished earlier, skipped[/dim]")
        return done
    source = donors.get(digest)
    if source is None or source.resolve() == run_dir.resolve():
        return None
    # The same models, data, config and evaluation: the cell is the donor's, under this row's name.
    if run_dir.exists():
        shutil.rmtree(run_dir)
    bulky = [path.name for path in RunDir(source).bulky()]
    shutil.copytree(source, run_dir, ignore=lambda folder, names: bulky if Path(folder) == source else [])
    done = json.loads(RunDir(run_dir).done.read_text())
    done["rows"] = [{**row, "variant": variant.name} for row in done["rows"]]
    write_json_atomic(RunDir(run_dir).done, done)
    console.print(f"[dim]{variant.name} seed {seed}: the same cell finished in {source}, reused[/dim]")
    return done


class _StepReport:
    """A cell's training steps, sent to the parent's display (picklable, unlike a closure)."""

    def __init__(self, queue: Any, label: str) -> None:
        self.queue, self.label = queue, label

    def __call__(self, done: int, total: int) -> None:
        self.queue.put((self.label, done, total))


def _cell_job(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    resume: bool,
    threads: int,
    queue: Any = None,
) -> tuple[dict[str, Any], bool]:
    """One cell in a worker process of ``run_compare(jobs > 1)``: its own torch threads and
    verifier, no live bar of its own (its steps go to the parent's through ``queue``) and no
    per-file bars of transformers."""
    import torch

    from graftrl.console import quiet_transformers
    from graftrl.models.rewards import MathVerifier

    quiet_transformers()
    torch.set_num_threads(threads)
    report = None if queue is None else _StepReport(queue, f"{variant.name} seed {seed}")
    with MathVerifier() as verifier:
        return run_cell(
            task, variant, seed, steps, out_dir, verifier, Console(), resume, progress=False, on_step=report
        )


def _warm_start_job(task: CompareTask, out_dir: Path, resume: bool, threads: int) -> dict[str, Any]:
    """The warm-start evaluation in a worker process of ``run_compare(jobs > 1)``."""
    import torch

    from graftrl.console import quiet_transformers
    from graftrl.models.rewards import MathVerifier

    quiet_transformers()
    torch.set_num_threads(threads)
    with MathVerifier() as verifier:
        return warm_start_cell(task, out_dir, verifier, Console(), resume)


def run_cells_in_parallel(
    cells: Sequence[tuple[int, Variant]],
    jobs: int,
    task: CompareTask,
    steps: int | None,
    out_dir: Path,
    console: Console,
    resume: bool,
    record: Any,
    donors: Mapping[str, Path],
    record_warm_start: Any,
) -> None:
    """Train ``cells`` in ``jobs`` spawned processes sharing this process's torch threads; cells
    finished earlier are reused here without a process. ``record(seed, variant, done, ran)`` is
    called as each cell ends, ``record_warm_start(done)`` when the warm-start evaluation does. A
    live bar per cell shows its training steps, and one the cells done.

    The warm-start evaluation is queued after the cells: it fills a process that a shorter cell
    leaves idle instead of holding every cell back (the same scores: evaluation does not depend on
    the thread count, ``tests/test_compare.py``)."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    import torch

    from graftrl.workers import exit_with_parent, start_manager

    pending = []
    for seed, variant in cells:
        done = finished_cell(task, variant, seed, steps, out_dir, console, donors) if resume else None
        if done is not None:
            record(seed, variant, done, False)
        else:
            pending.append((seed, variant))
    warm_start = finished_warm_start(task, out_dir) if resume else None
    if warm_start is not None:
        record_warm_start(warm_start)
    if not pending and warm_start is not None:
        return
    threads = max(1, torch.get_num_threads() // jobs)
    also = " and the warm-start evaluation" if warm_start is None else ""
    console.print(f"training {len(pending)} cells{also}, {jobs} at a time ({threads} torch thread(s) each)")
    context = mp.get_context("spawn")
    bars = TaskBars(console)
    with (
        ProcessPoolExecutor(jobs, mp_context=context, initializer=exit_with_parent) as pool,
        start_manager(context) as manager,
    ):
        queue = manager.Queue()

        def drain() -> None:
            while not queue.empty():
                bars.update(*queue.get())

        futures: dict[Any, tuple[int, Variant] | None] = {
            pool.submit(_cell_job, task, variant, seed, steps, out_dir, resume, threads, queue): (
                seed,
                variant,
            )
            for seed, variant in pending
        }
        if warm_start is None:  # None: the warm-start evaluation
            futures[pool.submit(_warm_start_job, task, out_dir, resume, threads)] = None
        bars.update("cells done", 0, len(pending))
        running = set(futures)
        try:
            while running:
                finished, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                drain()
                for future in finished:
                    if (cell := futures[future]) is None:
                        record_warm_start(future.result())
                        continue
                    seed, variant = cell
                    done, did_run = future.result()
                    console.print(f"{variant.name} seed {seed}: done")
                    record(seed, variant, done, did_run)
                    cells_running = sum(futures[f] is not None for f in running)
                    bars.update("cells done", len(pending) - cells_running, len(pending))
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
        finally:
            bars.close()
