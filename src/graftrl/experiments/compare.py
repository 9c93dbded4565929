"""`graftrl compare`: a matrix of methods (and switches) x seeds on one base config, with paper-style tables.

The overrides of each variant (``matrix``) are applied (``graftrl.config.apply_overrides``) on
the task's base config (``compare_task``), which gives every variant the same prompts, steps and
per-model rollout budget unless the row changes it (e.g. GRPO ``rollout.n: 16``). Built-in
presets: ``table1`` (paper Table 1: GRPO n = 8/16/32, SGT, HACPO, GRAFT), ``table2`` (GRAFT and
each ablation switch of algorithm.md §2.4) and ``demo`` (GRPO and GRAFT: what ``graftrl demo``
runs, with its own report, ``demo.DemoReport``).

The base is any run config (``--base``, evaluated on ``--bench`` or its validation benchmarks) or,
by default, the embedded task of ``graftrl demo`` written as one (warm-started heterogeneous tiny
models, procedural problems, held-out pass@1 with the paper's sampling protocol). The cells
(``cells``) train, evaluate and keep done markers, so a partly finished matrix continues where it
stopped; ``launchers`` run them (here, side by side, or on a Ray cluster), and ``--only-cell`` /
``--report-only`` split a matrix over the jobs of a Slurm array. ``CompareReport`` writes
results.json after every cell, then results.csv, report.md and the plots (``compare_report``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.embedded.task import DEFAULT_TASK
from graftrl.evaluation.stats import WARM_START
from graftrl.experiments.cells import (
    Verifiers,
    cell_config,
    cell_name,
    donor_cells,
    finished_cell,
    run_cell,
    warm_start_cell,
    write_json_atomic,
)
from graftrl.experiments.compare_report import write_csv, write_report
from graftrl.experiments.compare_rounds import Rounds, rounds_section, run_rounds
from graftrl.experiments.compare_task import CompareTask, embedded_task
from graftrl.experiments.launchers import CellBatch, Launcher, launch
from graftrl.experiments.matrix import CompareError, Matrix, Variant, check_methods, preset_matrix
from graftrl.experiments.paired_decisions import Decisions
from graftrl.storage.rundir import ExperimentDir


@dataclass
class CompareRun:
    """A comparison in progress: the cells run so far and their result rows, in run order."""

    out_dir: Path
    matrix: Matrix
    task: CompareTask
    seeds: int
    steps: int | None
    console: Console
    started: float = field(default_factory=time.perf_counter)
    rows: list[dict[str, Any]] = field(default_factory=list)
    cells: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    """Variant -> the done record of each seed run, in seed order (set when every cell is done)."""
    ran: list[str] = field(default_factory=list)
    """Cells trained by this invocation ("<variant>-seed<seed>"), not reused."""
    rounds: Rounds | None = None
    """``--seeds auto``: the rounds run and what each look resolved."""

    @property
    def wall_s(self) -> float:
        return round(time.perf_counter() - self.started, 1)

    def results(self) -> dict[str, Any]:
        """compare's results.json (a ``--base`` compare's also records its config and overrides)."""
        task = self.task
        settings = asdict(task.settings) if task.settings else task.evaluation.summary(task.config)
        return {
            "rows": self.rows,
            "variants": [asdict(v) for v in self.matrix.variants],
            "baseline": self.matrix.baseline_name,
            "reference": self.matrix.reference_name,
            "task": task.name,
            **({"base": task.source} if task.source else {}),
            "settings": settings,
            "seeds": self.seeds,
            "steps": self.steps,
            "ran": self.ran,
            **({"rounds": self.rounds.as_dict()} if self.rounds else {}),
            "total_wall_s": self.wall_s,
            "provenance": task.provenance,
        }


class CompareReport:
    """How a comparison is written: results.json (after every cell, so progress survives a crash),
    then results.csv, report.md and the plots. ``graftrl demo`` writes its own (``demo.DemoReport``).

    ``echo``: print report.md when done (``graftrl sweep`` prints its own summary instead).
    ``decisions``: the correction, the planned difference and the interval kind (default Holm).
    """

    def __init__(self, echo: bool = True, decisions: Decisions | None = None) -> None:
        self.echo = echo
        self.decisions = decisions or Decisions()

    def progress(self, run: CompareRun) -> None:
        write_json_atomic(ExperimentDir(run.out_dir).results, run.results())

    def finish(self, run: CompareRun) -> dict[str, Any]:
        out_dir = run.out_dir
        order = {WARM_START: -1, **{v.name: i for i, v in enumerate(run.matrix.variants)}}
        run.rows.sort(key=lambda r: (order[r["variant"]], r["seed"], r["model"]))
        final = run.results()
        write_json_atomic(ExperimentDir(out_dir).results, final)
        write_csv(run.rows, ExperimentDir(out_dir).results_csv)
        report = write_report(
            out_dir, run.matrix, run.rows, run.cells, run.task, run.seeds, run.steps, final["total_wall_s"],
            self.decisions, rounds_section(run.rounds) if run.rounds else [],
        )  # fmt: skip
        if self.echo:
            run.console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
        run.console.print(f"wrote {out_dir}/report.md, results.json, results.csv and plots")
        return final


def cell_names(matrix: Matrix, seeds: int) -> list[str]:
    """Every cell of the matrix by name, in the order compare runs them: the warm-start
    evaluation, then seed 0 of every variant, seed 1, ... (``--list-cells``)."""
    return [WARM_START, *(cell_name(v.name, seed) for seed in range(seeds) for v in matrix.variants)]


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
    launcher: Launcher | None = None,
    only_cell: str | None = None,
    max_seeds: int | None = None,
    list_round: bool = False,
) -> dict[str, Any]:
    """Run (or continue) every (variant, seed) cell, then write results and the report.

    ``max_seeds`` (``--seeds auto --max-seeds K``; ``seeds`` is then ignored): seeds in rounds, each
    variant until its comparisons are resolved or K (``compare_rounds``). ``list_round``: train
    nothing; return ``{"cells": [...]}``, the unfinished cells of the current round (``--list-cells``).

    ``report_only``: train nothing; report the cells finished so far (here or in ``reuse``), e.g.
    while the rest still run elsewhere. Each row then says how many seeds it has. ``only_cell``:
    train (or reuse) that one cell and write no report (a job of a Slurm array; ``cell_names``).

    ``launcher``: who runs the cells (``launchers``; default: here, ``jobs`` side by side, each in
    its own process with an equal share of this process's torch threads: on 2 cores, two 1-thread
    cells finish sooner than one after the other on 2 threads). ``reuse``: other output folders
    whose finished cells with the same digest (models, data, config and evaluation, under any
    variant name) are copied instead of trained.

    ``matrix``: a Matrix or a preset name (sized on the base's batch). ``task``: the base config
    and evaluation (``compare_task.base_task``); default the embedded task called ``embedded``
    (``quick``: its smoke-test sizes, ``cache_dir``: where warm-started models live). ``resume``:
    reuse cells finished earlier and continue interrupted ones (False: train every cell afresh,
    write no markers). ``report``: how results are written (default compare's). Returns what the
    report wrote as results.json (``only_cell``: that cell's done record).
    """
    console = console or Console()
    report = report or CompareReport()
    launcher = launcher or Launcher(jobs=jobs)
    seeds = max_seeds if max_seeds is not None else seeds
    if seeds < 1:
        raise CompareError(f"--seeds must be >= 1, got {seeds}")
    if report_only and not resume:
        raise CompareError("--report-only reports finished cells, so it cannot be combined with retraining")
    if report_only and only_cell is not None:
        raise CompareError("give --only-cell or --report-only, not both")
    spec = preset_matrix(matrix) if isinstance(matrix, str) else matrix
    check_methods(spec)  # before the warm-start
    if only_cell is not None and only_cell not in (names := cell_names(spec, seeds)):
        raise CompareError(
            f"--only-cell {only_cell!r} is not a cell of this matrix with --seeds {seeds}; "
            f"`--list-cells` prints them ({names[0]}, {names[1]}, ...)"
        )
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
    if isinstance(matrix, str):  # the task's batch and policies size HACPO's minibatch
        spec = preset_matrix(matrix, task.config.train.batch_prompts, len(task.config.policies))
    for variant in spec.variants:  # every config is checked before the first cell trains
        cell_config(task, variant, 0, steps)
    run = CompareRun(out_dir, spec, task, seeds, steps, console, started)

    cells = [(seed, variant) for seed in range(seeds) for variant in spec.variants]
    if only_cell is not None:
        return _one_cell(task, cells, only_cell, steps, out_dir, console, donors)
    finished: dict[tuple[int, str], dict[str, Any]] = {}

    def record(seed: int, variant: Variant, done: dict[str, Any], did_run: bool) -> None:
        if (seed, variant.name) in finished:  # an earlier round's cell
            return
        finished[(seed, variant.name)] = done
        run.rows += done["rows"]
        if did_run:
            run.ran.append(cell_name(variant.name, seed))
        if not list_round:  # --list-cells writes nothing
            report.progress(run)

    def record_warm_start(done: dict[str, Any]) -> None:
        if not any(row["variant"] == WARM_START for row in run.rows):  # once, whatever the rounds
            run.rows[:0] = done["rows"]  # first, whenever it is evaluated

    failed: list[str] = []
    missing: list[str] = []
    with Verifiers() as verifiers:

        def execute(todo: Sequence[tuple[int, Variant]]) -> dict[tuple[int, str], dict[str, Any]]:
            todo = [(s, v) for s, v in todo if (s, v.name) not in finished]
            if report_only or list_round:
                found = [
                    (seed, variant, done)
                    for seed, variant in todo
                    if (done := finished_cell(task, variant, seed, steps, out_dir, console, donors))
                    is not None
                ]
                if not list_round:
                    missing.extend(_report_only_check(found, todo, out_dir, bool(reuse), bool(finished)))
                    record_warm_start(warm_start_cell(task, out_dir, verifiers, console, resume))
                for seed, variant, done in found:
                    record(seed, variant, done, False)
            else:
                batch = CellBatch(task, steps, out_dir, console, resume, donors, record, record_warm_start)
                failed.extend(launch(launcher, batch, todo, verifiers))
            return finished

        if max_seeds is None:
            execute(cells)
        else:
            run.rounds, unfinished = run_rounds(
                out_dir, spec, task, max_seeds, report.decisions, execute, report_only or list_round
            )
            cells = [(s, v) for s, v in cells if (s, v.name) in finished]
            if list_round:
                return {"cells": [cell_name(v.name, s) for s, v in unfinished]}
    # each variant's cells in seed order, whatever order they finished in
    for seed, variant in cells:
        if (seed, variant.name) in finished:
            run.cells[variant.name].append(finished[(seed, variant.name)])
    final = report.finish(run)
    if report_only:
        console.print(
            f"--report-only: not finished: {', '.join(missing)} (missing from the report; "
            "run the same command without --report-only, or --only-cell NAME, then --report-only again)"
            if missing
            else f"--report-only: all {len(cells)} cells are finished",
            soft_wrap=True,
        )
    if failed:
        raise CompareError(
            f"cell(s) {', '.join(failed)} died on every try (--tries {launcher.tries}); the report holds "
            "the others: rerun the command to continue them from their last checkpoints"
        )
    return final


def _report_only_check(
    found: Sequence[tuple[int, Variant, dict[str, Any]]],
    cells: Sequence[tuple[int, Variant]],
    out_dir: Path,
    reused: bool,
    earlier: bool = False,
) -> list[str]:
    """``--report-only``: the cells not finished, by name; refused (nothing written) when no cell
    has finished (``earlier``: an earlier round of ``--seeds auto`` had): an empty report would only
    hide that."""
    have = {(seed, variant.name) for seed, variant, _ in found}
    missing = [cell_name(v.name, s) for s, v in cells if (s, v.name) not in have]
    if not found and not earlier:
        where = f"{out_dir}" + (" or the --reuse folders" if reused else "")
        raise CompareError(
            f"--report-only: no cell has finished in {where} yet ({', '.join(missing)}); train them "
            "first: the same command without --report-only, or --only-cell NAME for each"
        )
    return missing


def _one_cell(
    task: CompareTask,
    cells: Sequence[tuple[int, Variant]],
    name: str,
    steps: int | None,
    out_dir: Path,
    console: Console,
    donors: dict[str, Path],
) -> dict[str, Any]:
    """``--only-cell NAME``: that cell (or the warm-start evaluation) here, nothing else written."""
    with Verifiers() as verifiers:
        if name == WARM_START:
            return warm_start_cell(task, out_dir, verifiers, console)
        seed, variant = next((s, v) for s, v in cells if cell_name(v.name, s) == name)
        done, _ = run_cell(task, variant, seed, steps, out_dir, verifiers, console, donors=donors)
    console.print(f"{name}: done ({ExperimentDir(out_dir).run(variant.name, seed).done})")
    return done
