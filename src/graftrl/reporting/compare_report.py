"""What `graftrl compare` writes: results.json (after every cell), results.csv, report.md (one
render function per section) and the plots.

Outputs in OUT: ``results.json`` (rows ``{"variant","method","model","seed","n","pass_at_1",
"steps","wall_s"}``; ``wall_s`` is the training wall-clock of the cell, evaluation excluded),
``results.csv`` (the same rows), ``report.md`` (Table 1: pass@1 mean ± std over seeds per model,
Δ vs the GRPO n = 8 baseline; Table 2: Δ vs full GRAFT; wall-clock and rollouts per variant;
per-family pass@1 and training reward; the regime, gate and advantage-mass diagnostics) and
plots ``training_curves.png`` (reward per step, mean over seeds) and ``pass_at_1.png``.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.evaluation.stats import WARM_START, family_rows, summarize
from graftrl.reporting.cells import cell_config, write_json_atomic
from graftrl.reporting.compare_task import CompareTask
from graftrl.reporting.diagnostics import (
    AdvantageMass,
    GateOutcome,
    advantage_mass,
    family_progress,
    gate_by_outcome,
    summarize_exchange,
)
from graftrl.reporting.matrix import Matrix, yaml_value
from graftrl.reporting.provenance import signature, written_by
from graftrl.reporting.render import (
    advantage_markdown,
    diagnostics_markdown,
    gate_markdown,
    paired_markdown,
    progress_markdown,
    table_markdown,
)
from graftrl.storage.rundir import ExperimentDir, RunDir, read_jsonl, read_metrics

ROW_KEYS = ("variant", "method", "model", "seed", "n", "pass_at_1", "per_family", "steps", "wall_s")
"""Columns of results.csv (results.json rows hold the same keys)."""


PAIRED_NOTE = (
    "mean [95% paired t interval over seeds] in points; `*` marks an interval that excludes 0, "
    "the only differences the seeds run resolve"
)


PROGRESS_WINDOW = 10
"""Steps at each end of training over which the report averages the per-family training reward."""


def _curves(out_dir: Path, names: Sequence[str], seeds: int) -> dict[str, list[dict[str, Any]]]:
    """variant -> per (step, model) reward on the shared prompt batch, mean over the seeds run."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        points: dict[tuple[int, str], list[float]] = defaultdict(list)
        for seed in range(seeds):
            run = ExperimentDir(out_dir).run(name, seed)
            if run.holds_run():
                for row in read_metrics(run.root):
                    # the reward on the step's shared batch (dynamic sampling trains on other prompts)
                    value = row.get("shared_reward_mean", row.get("reward_mean"))
                    if value is not None:
                        points[(row["step"], row["model"])].append(value)
        if points:
            curves[name] = [
                {"step": step, "model": model, "reward_mean": statistics.fmean(v)}
                for (step, model), v in sorted(points.items())
            ]
    return curves


def _family_runs(out_dir: Path, names: Sequence[str], seeds: int) -> dict[str, list[dict[str, Any]]]:
    """Metrics rows per "<variant> seed <s>" (the per-family curves and the exchange diagnostics)."""
    out = ExperimentDir(out_dir)
    return {
        f"{name} seed {seed}": read_metrics(out.run(name, seed).root)
        for name in names
        for seed in range(seeds)
        if out.run(name, seed).holds_run()
    }


def _compatibility_records(out_dir: Path, variant: str, seeds: int) -> list[dict[str, Any]]:
    """Every ``compatibility.jsonl`` row of ``variant``'s runs over seeds 0..seeds-1."""
    out = ExperimentDir(out_dir)
    logs = [RunDir(out.run(variant, seed).root).compatibility for seed in range(seeds)]
    return [record for log in logs if log.is_file() for record in read_jsonl(log)]


def _exchange_tables(
    out_dir: Path, matrix: Matrix, task: CompareTask, seeds: int, steps: int | None
) -> tuple[dict[str, dict[str, dict[str, GateOutcome]]], dict[str, dict[str, AdvantageMass]]]:
    """One pass over each variant's compatibility logs (seeds run) for the two transfer tables.

    Gates: variant -> ``gate_by_outcome``, for every variant that transferred responses.
    Masses: variant -> ``advantage_mass``, for the GRAFT variants whose logged peer responses are
    whole source groups weighted by eq. 8 (replaced groups, every response, the gate or no gate);
    pooled groups, success-only transfer and random admission train other weights or advantages
    than the log can rebuild."""
    gates, masses = {}, {}
    for variant in matrix.variants:
        if not (records := _compatibility_records(out_dir, variant.name, seeds)):
            continue
        config = cell_config(task, variant, 0, steps)
        graft, train = config.graft, config.train
        gates[variant.name] = gate_by_outcome(records, graft.delta)
        whole_groups = graft.groups == "replace" and graft.transfer == "all" and graft.admission == "gate"
        if variant.method != "graft" or not whole_groups:
            continue
        delta = graft.delta if graft.gate else None
        if mass := advantage_mass(records, config.rollout.n, delta, train.adv_eps, train.adv_std_unbiased):
            masses[variant.name] = mass
    return gates, masses


def compatibility_scores(out_dir: Path, variant: str, seeds: int) -> dict[str, list[float]]:
    """Receiver -> every compatibility score s logged by ``variant``'s runs over seeds 0..seeds-1."""
    from graftrl.reporting.plots import read_compatibility

    scores: dict[str, list[float]] = defaultdict(list)
    for seed in range(seeds):
        for receiver, values in read_compatibility(ExperimentDir(out_dir).run(variant, seed).root).items():
            scores[receiver] += values
    return dict(scores)


def _exchange_plots(
    out_dir: Path,
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: str | None,
    reference: str | None,
    seeds: int,
    footer: str,
) -> dict[str, str]:
    """The demo's exchange figures for the baseline and the reference variant (GRPO and GRAFT in
    the demo preset): complementarity per step and the reference's compatibility scores."""
    from graftrl.reporting.plots import plot_compatibility_histogram, plot_complementarity

    made = {}
    pair = {name for name in (baseline, reference) if name}
    runs = {label: rows for label, rows in metrics.items() if label.split(" seed ")[0] in pair}
    if any(key.startswith("complementarity/") for rows in runs.values() for row in rows for key in row):
        plot_complementarity(runs, out_dir / "complementarity.png", footer=footer)
        made["complementarity.png"] = (
            f"share of all-fail prompts the peer solves, {' and '.join(sorted(pair))}"
        )
    scores = compatibility_scores(out_dir, reference, seeds) if reference else {}
    if scores:
        plot_compatibility_histogram(scores, out_dir / "compatibility_hist.png", footer=footer)
        made["compatibility_hist.png"] = f"compatibility scores s of {reference}'s transferred responses"
    return made


def _write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(ROW_KEYS), extrasaction="ignore")
        writer.writeheader()
        # per_family ({family: pass@1}) as a JSON object in its cell
        writer.writerows({**row, "per_family": json.dumps(row.get("per_family") or {})} for row in rows)


def _mean_of(done: Sequence[Mapping[str, Any]], key: str) -> str:
    """A compute column: the mean over seeds, blank for cells finished before it was recorded."""
    values = [d[key] for d in done if key in d]
    return f"{statistics.fmean(values):,.0f}" if values else ""


@dataclass(frozen=True)
class ReportContext:
    """What the sections of report.md read: the matrix, its result rows and the cells' runs."""

    out_dir: Path
    matrix: Matrix
    rows: Sequence[Mapping[str, Any]]
    task: CompareTask
    seeds: int
    steps: int | None
    summary: Mapping[str, Any]
    """Variant -> model -> pass@1 mean ± std over seeds (``stats.summarize``)."""
    extra: Mapping[str, Mapping[str, str]]
    """Variant -> the columns beside pass@1 (method, overrides, compute, seeds, wall-clock)."""
    metrics: Mapping[str, Sequence[Mapping[str, Any]]]
    """"<variant> seed <s>" -> its metrics.jsonl rows."""

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.matrix.variants]

    @property
    def baseline(self) -> str | None:
        return self.matrix.baseline_name

    @property
    def reference(self) -> str | None:
        return self.matrix.reference_name


def write_report(
    out_dir: Path,
    matrix: Matrix,
    rows: Sequence[Mapping[str, Any]],
    cells: Mapping[str, Sequence[Mapping[str, Any]]],
    task: CompareTask,
    seeds: int,
    steps: int | None,
    total_wall_s: float,
) -> Path:
    """report.md with Table 1 (Δ vs baseline) and Table 2 (Δ vs reference), and the plots."""
    names = [v.name for v in matrix.variants]
    context = ReportContext(
        out_dir,
        matrix,
        rows,
        task,
        seeds,
        steps,
        summarize(rows),
        _extra_columns(matrix, cells),
        _family_runs(out_dir, names, seeds),
    )
    lines = [
        *header_section(context),
        *table1_section(context),
        *table2_section(context),
        *results_section(context),
        *family_section(context),
        *progress_section(context),
        *regime_section(context),
        *transfer_sections(context),
        *missing_section(context),
        *plots_section(context, total_wall_s),
    ]
    report = ExperimentDir(out_dir).report
    report.write_text("\n".join(lines))
    return report


def _extra_columns(
    matrix: Matrix, cells: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, dict[str, str]]:
    """Variant -> its columns beside pass@1, from the done markers of its cells."""
    extra: dict[str, dict[str, str]] = {}
    for variant in matrix.variants:
        done = cells.get(variant.name, [])
        walls = [float(r["wall_s"]) for d in done for r in d["rows"][:1]]
        extra[variant.name] = {
            "method": variant.method,
            "overrides": ", ".join(f"`{k}={yaml_value(v)}`" for k, v in variant.set.items()) or "",
            "n": str(done[0]["rows"][0]["n"]) if done else "",
            "rollouts/model": _mean_of(done, "rollouts_per_model"),
            "rows trained/model": _mean_of(done, "rows_trained_per_model"),
            "optimizer steps/model": _mean_of(done, "optimizer_steps_per_model"),
            "seeds": str(len(done)),
            "train wall-clock (s/seed)": f"{statistics.fmean(walls):.1f}" if walls else "",
            "total (s)": f"{sum(walls):.1f}" if walls else "",
        }
    extra[WARM_START] = {"method": "—", "seeds": "1"}
    return extra


def header_section(c: ReportContext) -> list[str]:
    s, base = c.task.settings, c.task.base_config
    return [
        f"# graftrl compare: {c.matrix.source or 'matrix'} on the {c.task.name} task",
        "",
        f"{written_by(c.task.provenance)}; the cells' digests, starting weights and warm-start fingerprints "
        "are in results.json.",
        "",
        f"Seeds: {c.seeds} per variant (the `seeds` column counts those finished). Steps: {c.steps or base['train']['steps']}; per step, every model gets "
        f"{base['train']['batch_prompts']} prompts x n rollouts ({base['rollout']['n']} unless a row "
        f"sets `rollout.n`), minibatch {base['train']['minibatch_prompts']} prompts. Held-out pass@1: "
        f"{len(c.task.heldout)} problems x {s.eval_samples} samples at T = 0.6, top-p 0.95, "
        f"{s.max_new_tokens} new tokens; mean ± std over seeds (sample std), in percent. "
        "Wall-clock is training only (evaluation excluded), per seed.",
        "",
    ]


def table1_section(c: ReportContext) -> list[str]:
    if c.baseline is None:
        return []
    return [
        f"## Table 1: pass@1 per model, Δ vs {c.baseline}",
        "",
        table_markdown(c.summary, c.baseline, [WARM_START, *c.names], c.extra, f"Δ vs {c.baseline}"),
        "",
        f"Paired by seed (same warm-start, prompts and evaluation problems), Δ vs {c.baseline}: {PAIRED_NOTE}.",
        "",
        paired_markdown(c.rows, c.baseline, c.names),
        "",
    ]


def table2_section(c: ReportContext) -> list[str]:
    # with only the baseline beside it, Table 2 would mirror Table 1 (the demo preset)
    if c.reference is None or not set(c.names) - {c.baseline, c.reference}:
        return []
    return [
        f"## Table 2: ablations, Δ vs full GRAFT ({c.reference})",
        "",
        table_markdown(c.summary, c.reference, c.names, c.extra, f"Δ vs {c.reference}"),
        "",
        f"Paired by seed, Δ vs {c.reference}: {PAIRED_NOTE}.",
        "",
        paired_markdown(c.rows, c.reference, c.names),
        "",
    ]


def results_section(c: ReportContext) -> list[str]:
    """The table without deltas, for a matrix with neither a baseline nor a reference."""
    if c.baseline is not None or c.reference is not None:
        return []
    return ["## Results", "", table_markdown(c.summary, None, [WARM_START, *c.names], c.extra), ""]


def family_section(c: ReportContext) -> list[str]:
    if not (by_family := family_rows(c.rows)):
        return []
    versus = c.baseline or c.reference
    lines = ["## Held-out pass@1 per problem family", ""]
    lines += [table_markdown(summarize(by_family), versus, [WARM_START, *c.names]), ""]
    if versus:
        lines += [paired_markdown(by_family, versus, c.names), ""]
    return lines


def progress_section(c: ReportContext) -> list[str]:
    if not (progress := family_progress(c.metrics, PROGRESS_WINDOW)):
        return []
    return [
        f"Training reward per problem family (percent, pooled over the seeds run): mean over the first "
        f"{PROGRESS_WINDOW} steps → over the last {PROGRESS_WINDOW}; the curves are in `family_curves.png`.",
        "",
        progress_markdown(progress, PROGRESS_WINDOW),
        "",
    ]


def regime_section(c: ReportContext) -> list[str]:
    if not (diagnostics := summarize_exchange(c.metrics)):
        return []
    return [
        "## Regime and exchange diagnostics (training prompts; mean per step over the seeds run)",
        "",
        "All-fail share: the receiver's prompts on which all n of its rollouts failed. Complementarity: "
        "of those, the share on which a peer's group is mixed. Groups moved: prompt groups replaced by a "
        "peer's per step; peer responses: their total; admitted: the share with compatibility weight "
        "w > 0 (the gate). Clipped own / peer: trained tokens whose ratio was clipped, on own and on "
        "peer rows (percent).",
        "",
        diagnostics_markdown(diagnostics, c.names),
        "",
    ]


def transfer_sections(c: ReportContext) -> list[str]:
    """How the gate met the transferred responses, and the advantage mass of the moved groups."""
    gates, masses = _exchange_tables(c.out_dir, c.matrix, c.task, c.seeds, c.steps)
    lines = []
    if gates:
        lines += [
            "Transferred responses by outcome: the share that passes the gate (s > δ, the variant's "
            "delta; for a method without the gate, such as HACPO, the share it would pass) and the median "
            "compatibility score s, for correct and for wrong peer responses. "
            "The gate should filter foreign style; when it passes fewer correct responses than wrong "
            "ones it is filtering out the lesson (docs/task_design.md).",
            "",
            gate_markdown(gates),
            "",
        ]
    if masses:
        lines += [
            "Advantage mass of the moved groups: per moved group, the sum of w·A over the peer's correct "
            "responses, over its wrong ones, and both (source advantages, eq. 1; weights, eq. 8), for the "
            "GRAFT variants that move whole groups. GRPO's advantages sum to 0 over a group, so without "
            "the gate the net is 0: tokens that all the peer's responses share, a step the receiver lacks "
            "included, get no net push; only what separates the peer's correct responses from its wrong "
            "ones does.",
            "",
            advantage_markdown(masses),
            "",
        ]
    return lines


def missing_section(c: ReportContext) -> list[str]:
    missing = [n for n in c.names if n not in c.summary]
    return [f"Not run yet: {', '.join(missing)}.", ""] if missing else []


def plots_section(c: ReportContext, total_wall_s: float) -> list[str]:
    """Draws the plots and lists them, then the invocation's wall-clock."""
    from graftrl.reporting.plots import plot_family_curves, plot_pass_at_1, plot_training_curves

    made_by = signature(c.task.provenance)
    plots = {"training_curves.png": "reward per step, mean over seeds", "pass_at_1.png": "per seed"}
    curves = _curves(c.out_dir, c.names, c.seeds)
    if curves:
        plot_training_curves(curves, c.out_dir / "training_curves.png", footer=made_by)
    if c.rows:
        plot_pass_at_1(
            [{**r, "method": r["variant"]} for r in c.rows], c.out_dir / "pass_at_1.png", footer=made_by
        )
    if plot_family_curves(c.metrics, c.out_dir / "family_curves.png", footer=made_by):
        plots["family_curves.png"] = "training reward per problem family"
    plots.update(_exchange_plots(c.out_dir, c.metrics, c.baseline, c.reference, c.seeds, made_by))
    return [
        "Plots: " + ", ".join(f"`{name}` ({what})" for name, what in plots.items()) + ".",
        f"Total wall-clock of this invocation: {total_wall_s:.0f} s.",
        "",
    ]


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

    @property
    def wall_s(self) -> float:
        return round(time.perf_counter() - self.started, 1)

    def results(self) -> dict[str, Any]:
        """compare's results.json."""
        return {
            "rows": self.rows,
            "variants": [asdict(v) for v in self.matrix.variants],
            "baseline": self.matrix.baseline_name,
            "reference": self.matrix.reference_name,
            "task": self.task.name,
            "settings": asdict(self.task.settings),
            "seeds": self.seeds,
            "steps": self.steps,
            "ran": self.ran,
            "total_wall_s": self.wall_s,
            "provenance": self.task.provenance,
        }


class CompareReport:
    """How a comparison is written: results.json (after every cell, so progress survives a crash),
    then results.csv, report.md and the plots. ``graftrl demo`` writes its own (``demo.DemoReport``).

    ``echo``: print report.md when done (``graftrl sweep`` prints its own summary instead).
    """

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo

    def progress(self, run: CompareRun) -> None:
        write_json_atomic(ExperimentDir(run.out_dir).results, run.results())

    def finish(self, run: CompareRun) -> dict[str, Any]:
        out_dir = run.out_dir
        order = {WARM_START: -1, **{v.name: i for i, v in enumerate(run.matrix.variants)}}
        run.rows.sort(key=lambda r: (order[r["variant"]], r["seed"], r["model"]))
        final = run.results()
        write_json_atomic(ExperimentDir(out_dir).results, final)
        _write_csv(run.rows, ExperimentDir(out_dir).results_csv)
        report = write_report(
            out_dir, run.matrix, run.rows, run.cells, run.task, run.seeds, run.steps, final["total_wall_s"]
        )
        if self.echo:
            run.console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
        run.console.print(f"wrote {out_dir}/report.md, results.json, results.csv and plots")
        return final
