"""The commands that train and compare many cells on the embedded task: ``demo``, ``compare`` and
``sweep`` (resumable, cell by cell)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graftrl.cli.common import (
    JOBS_HELP,
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
from graftrl.embedded.task import DEFAULT_TASK, MASTERY_POINTS, SKILL_OVERLAPS
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
    from graftrl.reporting.demo import run_demo

    check_task(task)
    thread_note()
    jobs = jobs or min(2, available_cpus())
    run_demo(out_dir=out, quick=quick, seeds=seeds, cache_dir=cache, console=console, task=task, jobs=jobs)


@app.command()
def compare(
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
    seeds: Annotated[int, typer.Option(min=1, help="Seeds 0..K-1 per variant (mean ± std over them).")] = 1,
    steps: StepsOption = None,
    quick: QuickOption = False,
    out: Annotated[
        Path | None,
        typer.Option(
            callback=out_folder, help="Output folder (default runs/compare/<preset or matrix name>)."
        ),
    ] = None,
    cache: CacheOption = None,
    task: TaskOption = DEFAULT_TASK,
    jobs: JobsOption = 1,
    reuse: ReuseOption = None,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report-only",
            help="Train nothing: write the report from the cells finished so far (here or in --reuse folders).",
        ),
    ] = False,
) -> None:
    """Run a methods x seeds matrix on the embedded task; resumes a partly finished matrix."""
    from graftrl.reporting.compare import run_compare
    from graftrl.reporting.matrix import CompareError, load_matrix

    check_task(task)
    if preset is not None and matrix is not None:
        raise CompareError("give --preset or --matrix, not both")
    spec = load_matrix(matrix) if matrix is not None else (preset or "table1")
    name = matrix.stem if matrix is not None else (preset or "table1")
    thread_note()
    run_compare(
        out or Path("runs/compare") / name,
        spec,
        seeds=seeds,
        steps=steps,
        quick=quick,
        cache_dir=cache,
        console=console,
        embedded=task,
        jobs=jobs,
        reuse=reuse or [],
        report_only=report_only,
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
        str,
        typer.Option(
            help="--knob mastery's points, comma-separated: `default` (the task's pair) or a drilled "
            "pair's own regrouping share in (0, 1]."
        ),
    ] = ",".join(MASTERY_POINTS),
    seeds: Annotated[int, typer.Option(min=1, help="Seeds 0..K-1 per point and method.")] = 5,
    steps: StepsOption = None,
    quick: QuickOption = False,
    out: Annotated[
        Path, typer.Option(callback=out_folder, help="Output folder (a compare per point inside).")
    ] = Path("runs/sweep"),
    cache: CacheOption = None,
    task: TaskOption = DEFAULT_TASK,
    jobs: JobsOption = 1,
    reuse: ReuseOption = None,
) -> None:
    """Where does exchange help? GRAFT - GRPO (n = 8) over the skill overlap of the pair, or which
    transfer rule wins where along the peer's mastery of the receiver's missing step; resumable."""
    from graftrl.reporting.sweep import SweepError, run_sweep

    check_task(task)
    line = {
        "seeds": seeds,
        "steps": steps,
        "quick": quick,
        "cache_dir": cache,
        "console": console,
        "task": task,
        "jobs": jobs,
        "reuse": reuse or [],
    }
    if knob == "mastery":
        from graftrl.reporting.mastery import run_mastery

        thread_note()
        run_mastery(out, [part.strip() for part in points.split(",") if part.strip()], **line)
        return
    if knob != "overlap":
        raise SweepError(f"--knob: `overlap` or `mastery`, got {knob!r}")
    try:
        points = [float(part) for part in overlaps.split(",") if part.strip()]
    except ValueError:
        raise SweepError(
            f"--overlaps: numbers separated by commas, e.g. 0,0.1,0.33,1; got {overlaps!r}"
        ) from None
    thread_note()
    run_sweep(out, points, **line)
