"""The commands that train and compare many cells: ``demo``, ``compare`` (on any base config, the
embedded task by default) and ``sweep`` (resumable, cell by cell), and ``embedded``, which writes the
embedded task as a base config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from graftrl.cli.common import (
    JOBS_HELP,
    TASK_HELP,
    CacheOption,
    JobsOption,
    QuickOption,
    ReuseOption,
    StepsOption,
    TaskOption,
    app,
    check_task,
    console,
    out_folder,
    thread_note,
)
from graftrl.embedded.task import DEFAULT_TASK, SKILL_OVERLAPS
from graftrl.machine import available_cpus


@app.command()
def demo(
    out: Annotated[
        Path, typer.Option(callback=out_folder, help="Output folder for runs, plots and results.json.")
    ] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option(help="Smoke-test size (about a minute).")] = False,
    seeds: Annotated[int, typer.Option(min=1, help="Repeat the comparison with this many seeds.")] = 1,
    cache: CacheOption = None,
    task: TaskOption = DEFAULT_TASK,
    jobs: Annotated[
        int | None, typer.Option(min=1, help=JOBS_HELP + " Default: 2 where 2 CPUs are free to use, else 1.")
    ] = None,
) -> None:
    """Warm-start two tiny heterogeneous models, train GRPO and GRAFT, compare held-out pass@1."""
    from graftrl.experiments.demo import run_demo

    check_task(task)
    thread_note()
    jobs = jobs or min(2, available_cpus())
    run_demo(out_dir=out, quick=quick, seeds=seeds, cache_dir=cache, console=console, task=task, jobs=jobs)


@app.command()
def compare(
    base: Annotated[
        Path | None,
        typer.Option(
            help="Base run config every cell trains (its policies, data and sizes), each variant's overrides "
            "and seed on top. Default: the embedded task, written as one into OUT/data (`graftrl embedded`)."
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override a field of the base config, before the variants': --set train.steps=10"
        ),
    ] = None,
    bench: Annotated[
        list[str] | None,
        typer.Option(
            help="Evaluation benchmark NAME=FILE (a JSONL / Parquet with problem and answer; repeatable). "
            "Default: the base config's validation.files. Required with --base unless the config validates."
        ),
    ] = None,
    eval_samples: Annotated[
        int | None,
        typer.Option(min=1, help="Samples per evaluation problem (the paper's 8, at T = 0.6, top-p 0.95)."),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="Built-in matrix: table1 (GRPO n=8/16/32, SGT, HACPO, GRAFT), table2 (GRAFT ablations) or demo "
            "(GRPO and GRAFT, as `graftrl demo`). "
            "Default table1 unless --matrix is given."
        ),
    ] = None,
    matrix: Annotated[
        Path | None,
        typer.Option(
            help="YAML matrix: a list of {variant: NAME, method: METHOD, set: {dotted.key: value}}."
        ),
    ] = None,
    seeds: Annotated[
        str,
        typer.Option(
            help="Seeds 0..K-1 per variant (mean ± std over them), or `auto`: seeds in rounds (3, 4, ...) until "
            "each comparison is resolved by a group-sequential test, at most --max-seeds."
        ),
    ] = "1",
    max_seeds: Annotated[
        int | None, typer.Option(min=2, help="--seeds auto: the most seeds a variant gets (default 10).")
    ] = None,
    steps: StepsOption = None,
    quick: QuickOption = False,
    out: Annotated[
        Path | None,
        typer.Option(
            callback=out_folder, help="Output folder (default runs/compare/<preset or matrix name>)."
        ),
    ] = None,
    correction: Annotated[
        str,
        typer.Option(
            help="Correction over the report's family of paired comparisons: holm (family-wise error, "
            "the default), bh (Benjamini-Hochberg, false discovery rate) or none."
        ),
    ] = "holm",
    mde: Annotated[
        float | None,
        typer.Option(
            help="The difference (points of pass@1) to plan seeds for; default each comparison's observed one."
        ),
    ] = None,
    seed_intervals: Annotated[
        bool,
        typer.Option(
            "--seed-intervals",
            help="Paired t intervals over seeds only, even where cells kept per-problem results.",
        ),
    ] = False,
    plan: Annotated[
        list[Path] | None,
        typer.Option(
            help="Train nothing: read this earlier compare (or pilot) folder (repeatable: one family) and "
            "print the seeds and the cost that resolve each comparison (or --mde)."
        ),
    ] = None,
    cache: CacheOption = None,
    task: Annotated[str | None, typer.Option(help=TASK_HELP + f" Default {DEFAULT_TASK}.")] = None,
    launcher: Annotated[
        str,
        typer.Option(
            help="Who runs the cells: `local` (this machine, --jobs at a time) or `ray` (each cell a Ray task "
            "with its policies' resources, on the cluster at the base config's ray.address, else a local Ray; "
            "as many at once as fit)."
        ),
    ] = "local",
    jobs: JobsOption = 1,
    tries: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="--launcher ray: attempts per cell (default 2); a cell whose process or node died is retried "
            "from its last checkpoint.",
        ),
    ] = None,
    reuse: ReuseOption = None,
    list_cells: Annotated[
        bool,
        typer.Option(
            "--list-cells", help="Print the matrix's cell names, one per line, in run order; train nothing."
        ),
    ] = False,
    only_cell: Annotated[
        str | None,
        typer.Option(help="Train (or reuse) this one cell and write no report: a job of a Slurm array."),
    ] = None,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report-only",
            help="Train nothing: write the report from the cells finished so far (here or in --reuse folders) "
            "and name the others; refused when none has finished.",
        ),
    ] = False,
) -> None:
    """Run a methods x seeds matrix on a base config (default: the embedded task); resumes a partly
    finished matrix, continuing interrupted cells from their last checkpoints."""
    from rich.console import Console

    from graftrl.experiments.compare.command import CompareReport, cell_names, run_compare
    from graftrl.experiments.launchers import Launcher
    from graftrl.experiments.matrix import CompareError, load_matrix, preset_matrix
    from graftrl.experiments.paired_decisions import Decisions

    check_task(task or DEFAULT_TASK)
    try:
        decisions = Decisions(correction, mde, seed_intervals)
    except ValueError as error:
        raise CompareError(str(error)) from None
    if plan:
        from graftrl.experiments.compare.plan import plan as plan_text

        console.print(plan_text(plan, decisions), markup=False, highlight=False, soft_wrap=True)
        return
    auto = seeds == "auto"
    if not auto and not seeds.isdigit():
        raise CompareError(f"--seeds takes a number of seeds or `auto`, got {seeds!r}")
    if max_seeds is not None and not auto:
        raise CompareError("--max-seeds goes with --seeds auto")
    seed_count = (max_seeds or 10) if auto else int(seeds)
    if preset is not None and matrix is not None:
        raise CompareError("give --preset or --matrix, not both")
    _refuse_ignored_flags(
        base=base, quick=quick, cache=cache, task=task, launcher=launcher, jobs=jobs, tries=tries,
        list_cells=list_cells, only_cell=only_cell, report_only=report_only,
    )  # fmt: skip
    spec = load_matrix(matrix) if matrix is not None else (preset or "table1")
    name = matrix.stem if matrix is not None else (preset or "table1")
    if base is None and (set_ or bench or eval_samples):
        raise CompareError(
            "--set, --bench and --eval-samples go with --base CONFIG (the embedded task sets its own)"
        )
    if list_cells and not auto:
        console.print(
            "\n".join(cell_names(preset_matrix(spec) if isinstance(spec, str) else spec, seed_count))
        )
        return
    run_launcher = Launcher(launcher, jobs)  # type: ignore[arg-type]  # checked in Launcher
    if tries is not None:
        run_launcher = replace(run_launcher, tries=tries)
    compare_task = None
    if base is not None:
        from graftrl.experiments.compare.task import base_task

        compare_task = base_task(base, set_ or [], bench or [], eval_samples)
    thread_note()
    listed = run_compare(
        out or Path("runs/compare") / name,
        spec,
        seeds=seed_count,
        steps=steps,
        quick=quick,
        cache_dir=cache,
        console=Console(stderr=True) if list_cells else console,  # stdout: the cell names alone
        task=compare_task,
        embedded=task or DEFAULT_TASK,
        reuse=reuse or [],
        report_only=report_only,
        launcher=run_launcher,
        only_cell=only_cell,
        max_seeds=seed_count if auto else None,
        list_round=list_cells,
        report=CompareReport(decisions=decisions),
    )
    if list_cells:  # --seeds auto: the cells of the round under way
        console.print("\n".join(listed["cells"]))


def _refuse_ignored_flags(
    *,
    base: Path | None,
    quick: bool,
    cache: Path | None,
    task: str | None,
    launcher: str,
    jobs: int,
    tries: int | None,
    list_cells: bool,
    only_cell: str | None,
    report_only: bool,
) -> None:
    """A flag that this compare would not use is refused in one line, not dropped in silence."""
    from graftrl.experiments.matrix import CompareError

    embedded_only = [
        flag
        for flag, given in (("--quick", quick), ("--cache", cache is not None), ("--task", task is not None))
        if given
    ]
    if base is not None and embedded_only:
        raise CompareError(
            f"{', '.join(embedded_only)}: size, cache or pick the embedded task, and --base CONFIG replaces it; "
            "drop them (set the base's sizes with --set KEY=VALUE or --steps)"
        )
    if list_cells and (only_cell is not None or report_only):
        raise CompareError(
            "--list-cells prints the cell names and runs nothing: drop --only-cell / --report-only"
        )
    running = [
        flag
        for flag, given in (
            ("--launcher", launcher != "local"),
            ("--jobs", jobs != 1),
            ("--tries", tries is not None),
        )
        if given
    ]
    action = "--report-only trains no cell" if report_only else "--only-cell trains its one cell here"
    if running and (report_only or only_cell is not None):
        raise CompareError(f"{', '.join(running)}: say how cells are launched, and {action}: drop them")
    if tries is not None and launcher != "ray":
        raise CompareError(
            "--tries: attempts per cell on Ray, it goes with --launcher ray (a local cell that dies "
            "continues from its last checkpoint when the command is rerun)"
        )
    if jobs != 1 and launcher == "ray":
        raise CompareError(
            "--jobs: local cells side by side; --launcher ray runs as many as the cluster fits: drop --jobs"
        )


@app.command()
def embedded(
    out: Annotated[
        Path, typer.Option(callback=out_folder, help="Folder for config.yaml, train.jsonl and heldout.jsonl.")
    ] = Path("runs/embedded"),
    task: TaskOption = DEFAULT_TASK,
    quick: QuickOption = False,
    cache: CacheOption = None,
) -> None:
    """Write the embedded task as a base config: prepare its cached models (warm-started or
    graftrl's shipped pair), write OUT/config.yaml, OUT/train.jsonl and OUT/heldout.jsonl (for
    --task code also OUT/train.parquet and OUT/heldout.parquet, verl's format), and print them with
    the `graftrl compare --base` command that runs on them."""
    from graftrl.embedded.base import HELDOUT, write_embedded_base

    check_task(task)
    base = write_embedded_base(out, task, quick, cache, console)
    console.print(f"config: {base.config}\ntrain: {base.train}\nheldout: {base.heldout}", soft_wrap=True)
    verl = [path.with_suffix(".parquet") for path in (base.train, base.heldout)]
    if all(path.is_file() for path in verl):
        console.print(f"verl format: {verl[0]} {verl[1]} (load_problems reads either)", soft_wrap=True)
    samples = "" if base.settings.eval_samples == 8 else f" --eval-samples {base.settings.eval_samples}"
    console.print(
        f"next: graftrl compare --base {base.config} --bench {HELDOUT}={base.heldout}{samples} --preset demo",
        soft_wrap=True,
        markup=False,
    )


@app.command()
def sweep(
    overlaps: Annotated[
        str,
        typer.Option(
            help="Skill-overlap points in [0, 1], comma-separated: the GPT-2's warm-start mix is "
            "(1 - o) x its own + o x the Llama's (0: complementary deficits, 1: same skills)."
        ),
    ] = ",".join(f"{o:g}" for o in SKILL_OVERLAPS),
    knob: Annotated[
        str,
        typer.Option(
            help="What the points move: `overlap` (the skill overlap of the pair; GRPO vs GRAFT at "
            "--overlaps) or `mastery` (the peer's mastery of the step the receiver lacks; GRPO, GRAFT, "
            "success-only transfer and SGT at --points)."
        ),
    ] = "overlap",
    points: Annotated[
        str | None,
        typer.Option(
            help="--knob mastery's points, comma-separated: `default` (the task's pair) or a drilled "
            "pair's own regrouping share in (0, 1]. Default: the committed line's (docs/mastery/line.json)."
        ),
    ] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Seeds 0..K-1 per point and method.")] = 5,
    preset: Annotated[
        str,
        typer.Option(
            help="--knob mastery's compare at each point: `mastery` (GRPO, GRAFT, success-only, SGT), "
            "`hint` (the same cells and the hint method beside them) or `rule` (its GRPO and GRAFT "
            "cells only: what scores the probe's rule)."
        ),
    ] = "mastery",
    steps: StepsOption = None,
    quick: QuickOption = False,
    out: Annotated[
        Path, typer.Option(callback=out_folder, help="Output folder (a compare per point inside).")
    ] = Path("runs/sweep"),
    cache: CacheOption = None,
    task: TaskOption = DEFAULT_TASK,
    jobs: JobsOption = 1,
    reuse: ReuseOption = None,
    prepare: Annotated[
        bool,
        typer.Option(
            help="Train nothing: warm-start (or load) each point's pair, pin it and write its base "
            "config (OUT/<point>/data/config.yaml), to probe the points before spending on cells."
        ),
    ] = False,
) -> None:
    """Where does exchange help? GRAFT - GRPO (n = 8) over the skill overlap of the pair, or which
    transfer rule wins where along the peer's mastery of the receiver's missing step; resumable."""
    from graftrl.experiments.sweep import OVERLAP, SweepError, SweepSettings, overlap_points, run_points

    check_task(task)
    line = SweepSettings(seeds, steps, quick, cache, task, jobs, reuse or [], prepare)
    if knob == "mastery":
        from graftrl.experiments.mastery import MASTERY, default_points, mastery_points

        thread_note()
        if preset not in ("mastery", "hint", "rule"):
            raise SweepError(f"--preset: `mastery`, `hint` or `rule`, got {preset!r}")
        names = default_points() if points is None else [p.strip() for p in points.split(",") if p.strip()]
        line_knob = replace(MASTERY, preset=preset)  # hint: the mastery cells, hint beside them
        run_points(out, mastery_points(out, names, line), line, line_knob, console)
        return
    if preset != "mastery":
        raise SweepError("--preset goes with --knob mastery")
    if knob != "overlap":
        raise SweepError(f"--knob: `overlap` or `mastery`, got {knob!r}")
    try:
        points = [float(part) for part in overlaps.split(",") if part.strip()]
    except ValueError:
        raise SweepError(
            f"--overlaps: numbers separated by commas, e.g. 0,0.1,0.33,1; got {overlaps!r}"
        ) from None
    thread_note()
    run_points(out, overlap_points(out, points, task), line, OVERLAP, console)
