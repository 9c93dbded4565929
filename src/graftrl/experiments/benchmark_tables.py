"""The paper's Table 1 layout for a ``--base`` compare: rows = variants per model, columns = each
benchmark and their average (mean ± std over seeds, percent), then compute; and the paired
differences against a reference variant per benchmark and on the average (``paired_decisions``).

A row's benchmarks are its ``per_benchmark`` scores (a cell evaluated on several benchmarks), or
for a single benchmark its ``pass_at_1``; its average is always ``pass_at_1`` (the unweighted mean
over benchmarks within the seed, as ``evaluation.evaluate`` aggregates). Nothing here reads a run
folder; the numbers come from ``evaluation.stats`` and ``evaluation.intervals``. ``compare.report`` places these sections
(and ``base_header``) where the embedded task's report has its models-as-columns tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from graftrl.evaluation.stats import mean_std
from graftrl.experiments.compare.task import CompareTask
from graftrl.reporting.provenance import written_by

AVERAGE = "Avg."


def benchmark_scores(row: Mapping[str, Any], benchmarks: Sequence[str]) -> dict[str, float]:
    """benchmark -> pass@1 of one result row, and ``AVERAGE`` -> its pass@1."""
    scores = dict(row.get("per_benchmark") or {benchmarks[0]: row["pass_at_1"]})
    return {**scores, AVERAGE: float(row["pass_at_1"])}


def _columns(benchmarks: Sequence[str]) -> list[str]:
    """The score columns: each benchmark, then their average when there are several."""
    return [*benchmarks, AVERAGE] if len(benchmarks) > 1 else list(benchmarks)


def benchmark_table_markdown(
    rows: Sequence[Mapping[str, Any]],
    benchmarks: Sequence[str],
    reference: str | None,
    variants: Sequence[str],
    extra: Mapping[str, Mapping[str, str]],
) -> str:
    """| model | variant | B1 (%) | ... | Avg. (%) | Δ Avg. | compute ... |: per model, a row per
    variant (``reference`` in bold; Δ of the mean average against it, in points). With one
    benchmark there is no average column: the benchmark is the average."""
    columns = _columns(benchmarks)
    extra_columns = list(dict.fromkeys(c for cols in extra.values() for c in cols))
    delta = [] if reference is None else [f"Δ {columns[-1]} vs {reference}"]
    header = ["model", "variant", *(f"{c} (%)" for c in columns), *delta, *extra_columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_key: dict[tuple[str, str], list[dict[str, float]]] = {}
    for row in rows:
        by_key.setdefault((row["model"], row["variant"]), []).append(benchmark_scores(row, benchmarks))
    for model in sorted({model for model, _ in by_key}):
        reference_scores = by_key.get((model, reference or ""), [])
        for variant in variants:
            scores = by_key.get((model, variant))
            if not scores:
                continue
            cells = [model, f"**{variant}**" if variant == reference else variant]
            for column in columns:
                values = [s[column] for s in scores if column in s]
                cells.append(mean_std(values).format(scale=100, digits=2) if values else "")
            if reference is not None:
                if variant == reference:
                    cells.append("—")
                elif reference_scores:
                    gap = (
                        mean_std([s[AVERAGE] for s in scores]).mean
                        - mean_std([s[AVERAGE] for s in reference_scores]).mean
                    )
                    cells.append(f"{100 * gap:+.2f}")
                else:
                    cells.append("")
            cells += [extra.get(variant, {}).get(c, "") for c in extra_columns]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def benchmark_section(
    rows: Sequence[Mapping[str, Any]],
    benchmarks: Sequence[str],
    versus: str | None,
    title: str,
    variants: Sequence[str],
    extra: Mapping[str, Mapping[str, str]],
    paired_caption: str,
    paired: str = "",
) -> list[str]:
    """A table of report.md in the paper's layout, with its paired differences against ``versus``
    (``paired``: their table, ``paired_decisions.benchmarks_markdown``; ``paired_caption``: the line
    above it, ``paired_decisions.decided_caption``)."""
    lines = [title, "", benchmark_table_markdown(rows, benchmarks, versus, variants, extra), ""]
    if versus is not None:
        lines += [
            paired_caption,
            "",
            paired,
            "",
        ]
    return lines


def base_header(task: CompareTask, source: str, seeds: int, steps: int | None) -> list[str]:
    """A ``--base`` compare's header: the config, the sizes, the evaluation and the compute columns."""
    config, evaluation = task.config, task.evaluation
    protocol = evaluation.protocol(config)
    overrides = (task.source or {}).get("set") or []
    with_set = f" with `--set {' '.join(overrides)}`" if overrides else ""
    which = (
        f"each policy's best checkpoint by validation average (validation every {config.validation.every} "
        f"steps on {', '.join(config.validation.specs())})"
        if config.validation.files
        else "each policy's final weights"
    )
    benchmarks = ", ".join(f"{b.name} ({len(b.problems)} problems)" for b in evaluation.benchmarks)
    return [
        f"# graftrl compare: {source or 'matrix'} on the base config {task.name}",
        "",
        f"{written_by(task.provenance)}; the cells' digests and starting weights are in results.json.",
        "",
        f"Base config `{(task.source or {}).get('config', task.name)}`{with_set}. Seeds: {seeds} per "
        f"variant (the `seeds` column counts those finished). Steps: {steps or config.train.steps}; per step, "
        f"every model gets {config.train.batch_prompts} prompts x n rollouts ({config.rollout.n} unless a row "
        f"sets `rollout.n`), minibatch {config.train.minibatch_prompts} prompts. Evaluation (the paper's "
        f"protocol) of {which} on {benchmarks}: {protocol.samples} samples per problem at T = "
        f"{protocol.temperature:g}, top-p {protocol.top_p:g}, {protocol.max_new_tokens} new tokens; pass@1 "
        f"per benchmark and {AVERAGE} (their unweighted mean, with several), mean ± std over seeds (sample std), in "
        "percent. Compute per variant: rollouts, rows trained and optimizer steps per model, training "
        "wall-clock and CPU-seconds per seed (evaluation excluded; CPU of the cell's process).",
        "",
    ]
