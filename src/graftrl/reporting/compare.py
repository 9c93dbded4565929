"""`graftrl compare`: a matrix of methods (and switches) x seeds on one task, with paper-style tables.

The overrides of each variant (``matrix``) are applied (``graftrl.config.apply_overrides``) on
the task's base config (``compare_task``), which gives every variant the same prompts, steps and
per-model rollout budget unless the row changes it (e.g. GRPO ``rollout.n: 16``). Built-in
presets: ``table1`` (paper Table 1: GRPO n = 8/16/32, SGT, HACPO, GRAFT), ``table2`` (GRAFT and
each ablation switch of algorithm.md §2.4) and ``demo`` (GRPO and GRAFT: what ``graftrl demo``
runs, with its own report, ``demo.DemoReport``).

The default task is the embedded one of ``graftrl demo`` (warm-started heterogeneous tiny models,
procedural problems, held-out pass@1 with the paper's sampling protocol). The cells (``cells``)
train, evaluate and keep done markers, so a partly finished matrix continues where it stopped;
``compare_report`` writes results.json, results.csv, report.md and the plots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.embedded.task import DEFAULT_TASK
from graftrl.reporting.cells import (
    cell_config,
    donor_cells,
    finished_cell,
    run_cell,
    run_cells_in_parallel,
    warm_start_cell,
)
from graftrl.reporting.compare_report import CompareReport, CompareRun
from graftrl.reporting.compare_task import CompareTask, embedded_task
from graftrl.reporting.matrix import CompareError, Matrix, Variant, check_methods, preset_matrix


def run_compare(
    out_dir: Path,
    matrix: Matrix | str,
    seeds: int = 1,
    steps: int | None = None,
    quick: bool = False,
    cache_dir: Path | None = None,
    console: Console | None = None,
    task: CompareTask | None = None,
    embedded: str = DEFAULT_TASK,
    resume: bool = True,
    report: CompareReport | None = None,
    jobs: int = 1,
    reuse: Sequence[Path] = (),
    report_only: bool = False,
) -> dict[str, Any]:
    """Run (or continue) every (variant, seed) cell, then write results and the report.

    ``report_only``: train nothing; report the cells finished so far (here or in ``reuse``), e.g.
    while the rest still run elsewhere. Each row then says how many seeds it has.

    ``jobs``: cells trained side by side, each in its own process with an equal share of this
    process's torch threads (on 2 cores, two 1-thread cells finish sooner than one after the other
    on 2 threads: the models are too small for 2 threads to pay). ``reuse``: other output folders
    whose finished cells with the same digest (models, data, config and evaluation, under any
    variant name) are copied instead of trained.

    ``matrix``: a Matrix or a preset name (sized on the task's batch). ``task``: default the
    embedded task called ``embedded`` (``quick``: its smoke-test sizes, ``cache_dir``: where
    warm-started models live). ``resume``: reuse cells finished earlier (False: train every
    cell afresh, write no markers). ``report``: how results are written (default compare's).
    Returns what the report wrote as results.json.
    """
    from graftrl.models.rewards import MathVerifier

    console = console or Console()
    report = report or CompareReport()
    if seeds < 1:
        raise CompareError(f"--seeds must be >= 1, got {seeds}")
    if jobs < 1:
        raise CompareError(f"--jobs must be >= 1, got {jobs}")
    if report_only and not resume:
        raise CompareError("--report-only reports finished cells, so it cannot be combined with retraining")
    spec = preset_matrix(matrix) if isinstance(matrix, str) else matrix
    check_methods(spec)  # before the warm-start
    donors = donor_cells(reuse) if resume else {}
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    if task is None:
        # The default task keeps the four-argument call (tests substitute ``embedded_task``).
        task = (
            embedded_task(out_dir, cache_dir, quick, console)
            if embedded == DEFAULT_TASK
            else embedded_task(out_dir, cache_dir, quick, console, embedded)
        )
    if isinstance(matrix, str):
        spec = preset_matrix(matrix, task.base_config["train"]["batch_prompts"])
    for variant in spec.variants:  # every config is checked before the first cell trains
        cell_config(task, variant, 0, steps)
    run = CompareRun(out_dir, spec, task, seeds, steps, console, started)

    cells = [(seed, variant) for seed in range(seeds) for variant in spec.variants]
    finished: dict[tuple[int, str], dict[str, Any]] = {}

    def record(seed: int, variant: Variant, done: dict[str, Any], did_run: bool) -> None:
        finished[(seed, variant.name)] = done
        run.rows += done["rows"]
        if did_run:
            run.ran.append(f"{variant.name}-seed{seed}")
        report.progress(run)

    with MathVerifier() as verifier:
        run.rows += warm_start_cell(task, out_dir, verifier, console, resume)["rows"]
        if report_only:
            for seed, variant in cells:
                if (done := finished_cell(task, variant, seed, steps, out_dir, console, donors)) is not None:
                    record(seed, variant, done, False)
        elif jobs <= 1:
            for seed, variant in cells:
                ran = run_cell(task, variant, seed, steps, out_dir, verifier, console, resume, donors=donors)
                record(seed, variant, *ran)
        else:
            run_cells_in_parallel(cells, jobs, task, steps, out_dir, console, resume, record, donors)
    # each variant's cells in seed order, whatever order they finished in
    for seed, variant in cells:
        if (seed, variant.name) in finished:
            run.cells[variant.name].append(finished[(seed, variant.name)])
    return report.finish(run)
