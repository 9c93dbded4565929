"""`graftrl sweep`: where does exchange help? GRAFT − GRPO (n = 8) over the skill overlap of the pair.

The knob is the *skill overlap* o of the warm-start (``embedded.mixes.overlap_mixes``): the
GPT-2's warm-start family mix is ``(1 - o) x its own + o x the Llama's``. At o = 0 the pair has the
task's complementary deficits (the demo's pair); at o = 1 both were taught the same families, so
they lack the same step and a peer rarely solves the receiver's all-fail prompts. Moving o moves
both regime statistics of the paper's argument: the GPT-2's all-fail share and the
complementarity in both directions.

Each point is a compare of the ``demo`` preset (GRPO and GRAFT on the same seeds, prompts and
evaluation problems) in ``OUT/overlap-<o>/``, resumable cell by cell. Cells run seed-major (seed
0 at every point, then seed 1, ...), so a partial sweep already has a curve. Per point the sweep
reports the paired GRAFT − GRPO difference of held-out pass@1 with its 95% t interval over seeds
(uncorrected; ``PAIRED_NOTE`` says what it is), beside
the regime measured on the training prompts: all-fail share and complementarity from the GRPO
runs (no exchange disturbs them), groups moved per step and the gate's admitted share from the
GRAFT runs. Outputs: ``results.json``, ``report.md`` and ``sweep.png`` in OUT.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.embedded.mixes import overlap_mixes
from graftrl.embedded.task import DEFAULT_TASK
from graftrl.errors import UserError
from graftrl.evaluation.intervals import SEEDS_ONLY, caption, dict_text
from graftrl.evaluation.stats import WARM_START, mean_std, paired_deltas
from graftrl.experiments.compare.command import CompareReport, run_compare
from graftrl.experiments.compare.task import CompareTask, embedded_task
from graftrl.reporting.diagnostics import summarize_exchange
from graftrl.reporting.provenance import results_provenance, signature, written_by
from graftrl.reporting.run_logs import read_run_metrics
from graftrl.storage.rundir import ExperimentDir

PRESET = "demo"
BASELINE, TREATMENT = "grpo", "graft"
PAIRED_NOTE = (
    "This is the paired t interval over the seeds run: about new seeds on these evaluation problems, "
    "not on new problems. Each point's own report.md decides its comparisons: over seeds × problems "
    "where its cells kept per-problem results, corrected for its family"
)
"""What the sweeps' lines say of their intervals, after the caption (``intervals.caption``)."""


def line_caption(what: str, comparisons: int) -> str:
    """The line above a table of a sweep's line: ``what`` (paired by seed, in points), the interval
    over seeds, uncorrected for the table's ``comparisons``, and ``PAIRED_NOTE``."""
    family = f"the table's {comparisons} comparisons"
    return f"{caption(what, [SEEDS_ONLY], 'none', family)} {PAIRED_NOTE}."


class SweepError(UserError):
    """A sweep argument problem; the message names the flag and what to fix."""


@dataclass(frozen=True)
class SweepSettings:
    """What every knob of `graftrl sweep` shares: its flags besides the points."""

    seeds: int = 5
    """Seeds 0..K-1 per point and method."""
    steps: int | None = None
    quick: bool = False
    cache_dir: Path | None = None
    task: str = DEFAULT_TASK
    jobs: int = 1
    """Cells side by side."""
    reuse: Sequence[Path] = ()
    """Folders whose finished cells with the same digest are copied, not trained."""
    prepare: bool = False
    """Train nothing: warm-start (or load) every point's pair and write its base config, to probe
    the points before any cell is trained (``--prepare``)."""


def point_dir(out_dir: Path, overlap: float) -> Path:
    return out_dir / f"overlap-{overlap:g}"


def check_overlaps(overlaps: Sequence[float]) -> list[float]:
    points = [float(o) for o in overlaps]
    if not points:
        raise SweepError("--overlaps: give at least one point, e.g. --overlaps 0,0.1,0.33,1")
    if bad := [o for o in points if not 0.0 <= o <= 1.0]:
        raise SweepError(f"--overlaps: every point must be in [0, 1], got {bad}")
    if len(set(points)) != len(points):
        raise SweepError(f"--overlaps: each point once, got {points}")
    return sorted(points)


def point_models(points: Sequence[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(point, model, its summary) over a sweep's point summaries, in order: a report table's rows."""
    for point in points:
        for model, summary in point["models"].items():
            yield point, model, summary


def point_summary(
    overlap: float, out_dir: Path, rows: Sequence[dict[str, Any]], seeds: int
) -> dict[str, Any]:
    """One point of the sweep: per model, pass@1 (warm-start, GRPO, GRAFT), the paired difference
    and the regime statistics of its runs (seeds that finished)."""
    runs = ExperimentDir(out_dir)
    curves = {
        f"{variant} seed {seed}": read_run_metrics(runs.run(variant, seed).root)
        for variant in (BASELINE, TREATMENT)
        for seed in range(seeds)
        if runs.run(variant, seed).holds_run()
    }
    regime = summarize_exchange(curves)
    paired = paired_deltas(rows, BASELINE).get(TREATMENT, {})
    models = sorted({r["model"] for r in rows})
    per_model = {}
    for model in models:

        def scores(variant: str, model: str = model) -> list[float]:
            return [r["pass_at_1"] for r in rows if r["variant"] == variant and r["model"] == model]

        own, exchange = regime.get(BASELINE, {}).get(model, {}), regime.get(TREATMENT, {}).get(model, {})
        diff = paired.get(model)
        per_model[model] = {
            "warm_start_pass_at_1": next(iter(scores(WARM_START)), None),
            "grpo_pass_at_1": asdict(mean_std(scores(BASELINE))) if scores(BASELINE) else None,
            "graft_pass_at_1": asdict(mean_std(scores(TREATMENT))) if scores(TREATMENT) else None,
            "graft_minus_grpo": diff.as_dict() if diff is not None else None,
            "all_fail_share": own.get("all_fail_mean"),
            "complementarity": own.get("complementarity_mean"),
            "groups_moved_per_step": exchange.get("selected_prompts_per_step"),
            "admitted_share": exchange.get("admit_rate"),
        }
    return {"overlap": overlap, "models": per_model}


def _fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}"


def report_markdown(
    points: Sequence[dict[str, Any]], seeds: int, task: CompareTask, provenance: dict[str, Any]
) -> str:
    settings = task.settings
    lines = [
        "# graftrl sweep: GRAFT − GRPO over the skill overlap of the pair",
        "",
        f"{written_by(provenance)}; each point's cells, starting weights and warm-start fingerprints "
        "are in its `overlap-<o>/results.json`.",
        "",
        f"Task {task.name}; at skill overlap o the GPT-2's warm-start mix is (1 − o) x its own + o x the "
        f"Llama's. Per point: GRPO (n = {settings.n}) and GRAFT, seeds 0-{seeds - 1}, {settings.steps} steps "
        f"x {settings.batch_prompts} prompts per model; held-out pass@1 on {settings.n_eval} problems x "
        f"{settings.eval_samples} samples, in percent. All-fail share and complementarity are measured on "
        "the GRPO runs' training prompts (mean per step); groups moved and the admitted share on GRAFT's.",
        "",
        line_caption(
            "GRAFT − GRPO, paired by seed (same warm-start, prompts and evaluation problems)",
            sum(m["graft_minus_grpo"] is not None for _, _, m in point_models(points)),
        ),
        "",
        "| overlap | model | warm-start | all-fail share | complementarity | groups moved/step | admitted "
        "| GRPO | GRAFT | GRAFT − GRPO [95% CI] | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point, model, m in point_models(points):
        diff = m["graft_minus_grpo"]
        delta = dict_text(diff)
        grpo, graft = m["grpo_pass_at_1"], m["graft_pass_at_1"]
        lines.append(
            f"| {point['overlap']:g} | {model} | {_fmt(m['warm_start_pass_at_1'])} "
            f"| {_fmt(m['all_fail_share'])} | {_fmt(m['complementarity'])} "
            f"| {_fmt(m['groups_moved_per_step'], 1.0, 2)} | {_fmt(m['admitted_share'])} "
            f"| {_fmt(grpo and grpo['mean'])} ± {_fmt(grpo and grpo['std'])} "
            f"| {_fmt(graft and graft['mean'])} ± {_fmt(graft and graft['std'])} "
            f"| {delta} | {diff['n'] if diff else 0} |"
        )
    lines += ["", "Figure: `sweep.png`; every point's own report in `overlap-<o>/report.md`.", ""]
    return "\n".join(lines)


def write_sweep(done: SweepRound) -> dict[str, Any]:
    """results.json, report.md and sweep.png over the seeds run at every point."""
    from graftrl.reporting.plots import plot_sweep

    out_dir, tasks, results, seeds_done = done.out_dir, done.tasks, done.results, done.seeds_done
    task = done.settings.task
    points = sorted(results)
    summaries = [point_summary(o, point_dir(out_dir, o), results[o]["rows"], seeds_done) for o in points]
    final = {
        "task": task,
        "knob": "skill overlap: the GPT-2's warm-start mix is (1 - o) x its own + o x the Llama's",
        "overlaps": points,
        "seeds": seeds_done,
        "seeds_planned": done.settings.seeds,
        "steps": done.settings.steps,
        "settings": results[points[0]]["settings"],
        "points": summaries,
        "mixes": {f"{o:g}": overlap_mixes(task, o) for o in points},
        "total_wall_s": round(time.perf_counter() - done.started, 1),
        "provenance": {
            **results_provenance({}),
            "models": {f"{o:g}": tasks[o].provenance.get("models", {}) for o in points},
        },
    }
    report = report_markdown(summaries, seeds_done, tasks[points[0]], final["provenance"])
    return done.save(final, report, plot_sweep, summaries, "sweep.png")


@dataclass(frozen=True)
class SweepRound:
    """A sweep after a round of seeds at every point: what its writer reads."""

    out_dir: Path
    settings: SweepSettings
    tasks: Mapping[Any, CompareTask]
    results: Mapping[Any, dict[str, Any]]
    """Point -> its compare's results so far."""
    seeds_done: int
    started: float
    """``time.perf_counter()`` at the start of this invocation."""

    def save(
        self, final: dict[str, Any], report: str, plot: Callable[..., None], summaries: Any, figure: str
    ) -> dict[str, Any]:
        """results.json (``final``), report.md and the figure; returns ``final``."""
        out = ExperimentDir(self.out_dir)
        out.results.write_text(json.dumps(final, indent=2))
        out.report.write_text(report)
        plot(summaries, self.out_dir / figure, footer=signature(final["provenance"]))
        return final


@dataclass(frozen=True)
class Knob:
    """What a sweep's knob fixes: the compare each point runs, its figure, its writer and the
    error its arguments raise."""

    preset: str
    figure: str
    write: Callable[[SweepRound], dict[str, Any]]
    """results.json, report.md and the figure after a round; returns results.json."""
    error: type[UserError]


def run_points(
    out_dir: Path,
    points: Mapping[Any, tuple[Path, str, dict[str, Any]]],
    settings: SweepSettings,
    knob: Knob,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run (or continue) a sweep: each point's compare of ``knob.preset`` (point -> (its folder,
    label, ``embedded_task``'s keywords)), seed-major: seed 0 at every point, then seed 1, ...;
    ``knob.write`` after every round, so an interrupted sweep already has every point's report
    and the figure so far. Returns the last results.json; ``knob.error`` when ``settings.seeds``
    is below 1. ``settings.prepare``: only the points' models and base configs (returns
    ``{"prepared": {label: config path}}``)."""
    if settings.seeds < 1:
        raise knob.error(f"--seeds must be >= 1, got {settings.seeds}")
    console = console or Console()
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    # every point's models first: a warm-start that fails does so before any cell trains
    tasks = {
        p: embedded_task(folder, settings.cache_dir, settings.quick, console, settings.task, **options)
        for p, (folder, _, options) in points.items()
    }
    if settings.prepare:
        configs = {label: ExperimentDir(folder).base.config for folder, label, _ in points.values()}
        for label, config in configs.items():
            console.print(f"{label}: {config}  (graftrl probe {config} --set method=graft)")
        return {"prepared": {label: str(config) for label, config in configs.items()}}
    results: dict[Any, dict[str, Any]] = {}
    final: dict[str, Any] = {}
    for seed in range(settings.seeds):
        for point, (folder, label, _) in points.items():
            console.print(f"[bold]sweep[/bold]: {label}, seed {seed}")
            results[point] = run_compare(
                folder,
                knob.preset,
                seeds=seed + 1,
                steps=settings.steps,
                console=console,
                task=tasks[point],
                report=CompareReport(echo=False),
                jobs=settings.jobs,
                reuse=settings.reuse,
            )
        final = knob.write(SweepRound(out_dir, settings, tasks, results, seed + 1, started))
    console.print(ExperimentDir(out_dir).report.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out_dir}/report.md, results.json and {knob.figure}")
    return final


def overlap_points(
    out_dir: Path, overlaps: Sequence[float], task: str
) -> dict[float, tuple[Path, str, dict]]:
    """The overlap knob's points, checked: each its folder, label and warm-start mixes."""
    return {
        o: (point_dir(out_dir, o), f"overlap {o:g}", {"mixes": overlap_mixes(task, o)})
        for o in check_overlaps(overlaps)
    }


OVERLAP = Knob(PRESET, "sweep.png", write_sweep, SweepError)
"""`graftrl sweep` (``--knob overlap``): GRAFT − GRPO over the skill overlap."""
