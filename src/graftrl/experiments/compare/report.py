"""What `graftrl compare` writes at the end (``command.CompareReport`` calls it): report.md, one
render function per section (the exchange diagnostics: ``exchange``), results.csv and
the plots.

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
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.evaluation.intervals import SEEDS_ONLY, caption
from graftrl.evaluation.stats import WARM_START, family_rows, paired_deltas, summarize
from graftrl.experiments.benchmark_tables import AVERAGE, base_header, benchmark_section
from graftrl.experiments.compare.exchange import exchange_plots, exchange_tables, regime_lines, transfer_lines
from graftrl.experiments.compare.task import CompareTask
from graftrl.experiments.matrix import Matrix, yaml_value
from graftrl.experiments.paired_decisions import (
    Comparison,
    Costs,
    Decisions,
    benchmarks_markdown,
    decided_caption,
    decisions_section,
    models_markdown,
    report_family,
    shows_table2,
)
from graftrl.reporting.diagnostics import family_progress
from graftrl.reporting.provenance import signature, written_by
from graftrl.reporting.render import paired_markdown, progress_markdown, table_markdown
from graftrl.reporting.run_logs import read_run_metrics
from graftrl.storage.rundir import ExperimentDir

ROW_KEYS = ("variant", "method", "model", "seed", "n", "pass_at_1", "per_family", "steps", "wall_s")
"""Columns of results.csv (results.json rows hold the same keys)."""
OPTIONAL_ROW_KEYS = ("per_benchmark", "checkpoint_steps")
"""Columns of results.csv when a row has them: a ``--base`` compare's pass@1 per benchmark (with
several) and the steps behind each policy's best checkpoint (with validation)."""


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
                for row in read_run_metrics(run.root):
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
        f"{name} seed {seed}": read_run_metrics(out.run(name, seed).root)
        for name in names
        for seed in range(seeds)
        if out.run(name, seed).holds_run()
    }


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    optional = [key for key in OPTIONAL_ROW_KEYS if any(key in row for row in rows)]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*ROW_KEYS, *optional], extrasaction="ignore")
        writer.writeheader()
        # per_family ({family: pass@1}) and per_benchmark as JSON objects in their cells
        writer.writerows(
            {
                **row,
                "per_family": json.dumps(row.get("per_family") or {}),
                **{key: json.dumps(row[key]) for key in ("per_benchmark",) if key in row},
            }
            for row in rows
        )


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
    decisions: Decisions
    family: list[Comparison]
    """The paired comparisons of Tables 1 and 2, corrected together (``paired_decisions``)."""
    costs: Costs

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
    decisions: Decisions | None = None,
    rounds: Sequence[str] = (),
) -> Path:
    """report.md with Table 1 (Δ vs baseline) and Table 2 (Δ vs reference), the decisions on them
    (``decisions``: the correction, planned difference and interval kind), and the plots."""
    names = [v.name for v in matrix.variants]
    decisions = decisions or Decisions()
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
        decisions,
        report_family(out_dir, matrix, rows, task, decisions),
        Costs.of(rows, cells),
    )
    lines = [
        *header_section(context),
        *table1_section(context),
        *table2_section(context),
        *decisions_section(context.family, decisions, costs=context.costs, tables=_tables(context)),
        *rounds,
        *results_section(context),
        *family_section(context),
        *progress_section(context),
        *regime_lines(context.metrics, context.names),
        *transfer_lines(exchange_tables(out_dir, matrix, task, seeds, steps)),
        *missing_section(context),
        *plots_section(context, total_wall_s),
    ]
    report = ExperimentDir(out_dir).report
    report.write_text("\n".join(lines))
    return report


def _tables(c: ReportContext) -> list[str]:
    return list(dict.fromkeys(comparison.table for comparison in c.family))


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
        if any("train_cpu_s" in d for v in cells.values() for d in v):  # cells since CPU-seconds are kept
            cpu = [d["train_cpu_s"] for d in done if "train_cpu_s" in d]
            extra[variant.name]["train CPU (s/seed)"] = f"{statistics.fmean(cpu):.1f}" if cpu else ""
        if any("reward_s_per_model" in d for v in cells.values() for d in v):  # cells since it is kept
            extra[variant.name].update(_verify_columns(done))
    extra[WARM_START] = {"method": "—", "seeds": "1"}
    return extra


def _verify_columns(done: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """What verifying took of a model's training steps (``time_reward`` over ``time_step``): the
    code verifier's sandbox shows here."""
    kept = [d for d in done if d.get("step_s_per_model")]
    if not kept:
        return {"verify (s/model/seed)": "", "verify share of a step (%)": ""}
    verify = statistics.fmean(d["reward_s_per_model"] for d in kept)
    share = sum(d["reward_s_per_model"] for d in kept) / sum(d["step_s_per_model"] for d in kept)
    return {"verify (s/model/seed)": f"{verify:.1f}", "verify share of a step (%)": f"{100 * share:.1f}"}


def header_section(c: ReportContext) -> list[str]:
    if c.task.settings is None:
        return base_header(c.task, c.matrix.source, c.seeds, c.steps)
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
        f"{len(c.task.evaluation.problems)} problems x {s.eval_samples} samples at T = 0.6, top-p 0.95, "
        f"{s.max_new_tokens} new tokens; mean ± std over seeds (sample std), in percent. "
        "Wall-clock is training only (evaluation excluded), per seed.",
        "",
    ]


def _benchmark_table(
    c: ReportContext, versus: str | None, title: str, names: Sequence[str], table: str = ""
) -> list[str]:
    benchmarks = c.task.evaluation.names
    columns = [*benchmarks, AVERAGE] if len(benchmarks) > 1 else benchmarks
    paired = benchmarks_markdown(c.family, table, names, columns)
    what = f"Paired Δ vs {versus} (same starting models, prompts and evaluation problems)"
    return benchmark_section(
        c.rows, benchmarks, versus, title, names, c.extra, _caption(c, table, what), paired
    )


def _caption(c: ReportContext, table: str, what: str) -> str:
    """The line above Table 1's or Table 2's paired differences: their interval and correction."""
    return decided_caption(what, [x for x in c.family if x.table == table], c.family, c.decisions)


def _delta_table(
    c: ReportContext, versus: str, title: str, names: Sequence[str], table: str, paired: str
) -> list[str]:
    """Table 1 or 2 per model: pass@1 with Δ vs ``versus``, then the paired differences (``paired``
    says what is paired)."""
    return [
        title,
        "",
        table_markdown(c.summary, versus, names, c.extra, f"Δ vs {versus}"),
        "",
        _caption(c, table, f"Paired Δ vs {versus}{paired}"),
        "",
        models_markdown(c.family, table, c.names),
        "",
    ]


def table1_section(c: ReportContext) -> list[str]:
    if c.baseline is None:
        return []
    if c.task.benchmark_columns:
        average = f" and {AVERAGE}" if len(c.task.evaluation.benchmarks) > 1 else ""
        title = f"## Table 1: pass@1 per benchmark{average}, Δ vs {c.baseline}"
        return _benchmark_table(c, c.baseline, title, [WARM_START, *c.names], "Table 1")
    title = f"## Table 1: pass@1 per model, Δ vs {c.baseline}"
    paired = " (same warm-start, prompts and evaluation problems)"
    return _delta_table(c, c.baseline, title, [WARM_START, *c.names], "Table 1", paired)


def table2_section(c: ReportContext) -> list[str]:
    # with only the baseline beside it, Table 2 would mirror Table 1 (the demo preset)
    if c.reference is None or not shows_table2(c.matrix):
        return []
    title = f"## Table 2: ablations, Δ vs full GRAFT ({c.reference})"
    if c.task.benchmark_columns:
        return _benchmark_table(c, c.reference, title, c.names, "Table 2")
    return _delta_table(c, c.reference, title, c.names, "Table 2", "")


def results_section(c: ReportContext) -> list[str]:
    """The table without deltas, for a matrix with neither a baseline nor a reference."""
    if c.baseline is not None or c.reference is not None:
        return []
    if c.task.benchmark_columns:
        return _benchmark_table(c, None, "## Results", [WARM_START, *c.names])
    return ["## Results", "", table_markdown(c.summary, None, [WARM_START, *c.names], c.extra), ""]


def family_section(c: ReportContext) -> list[str]:
    if not (by_family := family_rows(c.rows)):
        return []
    versus = c.baseline or c.reference
    lines = ["## Held-out pass@1 per problem family", ""]
    lines += [table_markdown(summarize(by_family), versus, [WARM_START, *c.names]), ""]
    if versus:
        diffs = paired_deltas(by_family, versus)
        shown = [d for v in c.names for d in diffs.get(v, {}).values()]
        tables = _tables(c)
        corrects = (
            f"{' and '.join(tables)} correct{'' if len(tables) > 1 else 's'}"
            if tables
            else "the report corrects"
        )
        what = (
            f"Exploratory, not in the family that {corrects} (a `*` here is a lead to test, not a finding): "
            f"paired Δ per problem family vs {versus}"
        )
        family = f"the table's {len(shown)} comparisons"  # over seeds: the rows hold one pass@1 per family
        lines += [
            caption(what, [SEEDS_ONLY], "none", family),
            "",
            paired_markdown(by_family, versus, c.names),
            "",
        ]
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
    plots.update(exchange_plots(c.out_dir, c.metrics, c.baseline, c.reference, c.seeds, made_by))
    return [
        "Plots: " + ", ".join(f"`{name}` ({what})" for name, what in plots.items()) + ".",
        f"Total wall-clock of this invocation: {total_wall_s:.0f} s.",
        "",
    ]
