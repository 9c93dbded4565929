"""`graftrl demo`: the embedded default — GRPO vs GRAFT on two tiny heterogeneous models, offline.

The demo is compare's ``demo`` preset: warm-start a char-level Llama and a BPE GPT-2 on
complementary skills (cached), then for each seed train GRPO (n = 8) and GRAFT on the same
prompts, steps and per-model rollout budget and evaluate held-out pass@1 with the paper's sampling
protocol (``compare.run_compare``). Unlike compare it trains every cell afresh and writes its own
report: ``results.json`` (rows, sizes, the regime statistics, paired Δ vs GRPO), the figures and
rich tables.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.embedded.task import DEFAULT_TASK
from graftrl.evaluation.intervals import Difference
from graftrl.evaluation.stats import family_rows, paired_deltas
from graftrl.experiments.compare.command import CompareReport, CompareRun, run_compare
from graftrl.experiments.compare.exchange import compatibility_scores
from graftrl.reporting.diagnostics import summarize_exchange
from graftrl.reporting.plots import (
    plot_compatibility_histogram,
    plot_complementarity,
    plot_family_curves,
    plot_pass_at_1,
    plot_training_curves,
)
from graftrl.reporting.provenance import signature
from graftrl.reporting.render import diagnostics_table, results_table
from graftrl.reporting.run_logs import read_run_metrics
from graftrl.storage.rundir import ExperimentDir

PRESET = "demo"
"""compare's preset the demo runs (its variants are named after their methods)."""
BASELINE = "grpo"


def paired_vs_grpo(rows: list[dict[str, Any]]) -> dict[str, dict[str, Difference]]:
    """method -> model -> held-out pass@1 minus GRPO's, paired by seed, with its 95% interval over
    seeds (uncorrected; ``stats.paired_deltas``)."""
    return paired_deltas(rows, BASELINE, key="method")


class DemoReport(CompareReport):
    """The demo's outputs: results.json, five figures and the console tables (no report.md)."""

    def progress(self, run: CompareRun) -> None:
        return None

    def finish(self, run: CompareRun) -> dict[str, Any]:
        out_dir, console = run.out_dir, run.console
        # the demo's rows name the method only (its variants are the methods)
        rows = [{k: v for k, v in row.items() if k != "variant"} for row in run.rows]
        curves: dict[str, list[dict[str, Any]]] = {}
        for seed in range(run.seeds):
            for variant in run.matrix.variants:
                run_dir = ExperimentDir(out_dir).run(variant.name, seed).root
                curves[f"{variant.method} seed {seed}"] = read_run_metrics(run_dir)
        diagnostics = summarize_exchange(curves)
        results = {
            "rows": rows,
            "settings": asdict(run.task.settings),
            "diagnostics": diagnostics,
            "paired_vs_grpo": {
                method: {model: diff.as_dict() for model, diff in models.items()}
                for method, models in paired_vs_grpo(rows + family_rows(rows)).items()
            },
            "total_wall_s": run.wall_s,
            "provenance": run.task.provenance,
        }
        ExperimentDir(out_dir).results.write_text(json.dumps(results, indent=2))
        made_by = signature(run.task.provenance)
        plot_training_curves(curves, out_dir / "training_curves.png", footer=made_by)
        plot_complementarity(curves, out_dir / "complementarity.png", footer=made_by)
        scores = compatibility_scores(out_dir, "graft", run.seeds)
        plot_compatibility_histogram(scores, out_dir / "compatibility_hist.png", footer=made_by)
        plot_pass_at_1(rows, out_dir / "pass_at_1.png", footer=made_by)
        plot_family_curves(curves, out_dir / "family_curves.png", footer=made_by)
        console.print(results_table(rows))
        if by_family := family_rows(rows):
            console.print(results_table(by_family, title="held-out pass@1 per problem family"))
        console.print(diagnostics_table(diagnostics))
        console.print(f"wrote {out_dir}/results.json and plots in {time.perf_counter() - run.started:.0f}s")
        return results


def run_demo(
    out_dir: Path,
    quick: bool = False,
    seeds: int = 1,
    cache_dir: Path | None = None,
    console: Console | None = None,
    task: str = DEFAULT_TASK,
    jobs: int = 1,
) -> dict[str, Any]:
    """`graftrl demo`: compare's demo preset on the embedded task ``task``, every cell afresh
    (``jobs`` side by side)."""
    return run_compare(
        out_dir,
        PRESET,
        seeds=seeds,
        quick=quick,
        cache_dir=cache_dir,
        console=console,
        embedded=task,
        resume=False,
        report=DemoReport(),
        jobs=jobs,
    )
