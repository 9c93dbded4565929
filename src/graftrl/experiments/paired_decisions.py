"""The paired comparisons of one compare report, decided: each difference's interval (over seeds and
problems where the cells kept per-problem results, else over seeds), the correction for the
report's family of comparisons, and the seeds each would need.

The statistics are ``evaluation.intervals`` and ``evaluation.decisions``; this module pairs the
cells (by seed, and by problem within each benchmark), names the family and writes the tables.
``compare.report`` places them; ``plan`` prints them for ``graftrl compare --plan``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graftrl.evaluation.decisions import ALPHA, CORRECTIONS, correct, problems_limit, seeds_needed
from graftrl.evaluation.intervals import (
    CROSSED,
    SEEDS_ONLY,
    Difference,
    caption,
    crossed_interval,
    interval_name,
    seed_interval,
)
from graftrl.evaluation.stats import WARM_START
from graftrl.experiments.benchmark_tables import AVERAGE, benchmark_scores
from graftrl.experiments.compare.task import CompareTask
from graftrl.experiments.matrix import Matrix
from graftrl.reporting.problem_results import ProblemRates, folder_problem_results

CORRECTION_NAMES = {"holm": "Holm's step-down", "bh": "Benjamini-Hochberg", "none": "no correction"}


@dataclass(frozen=True)
class Decisions:
    """How a report decides: ``correction`` over its family ("holm", "bh" or "none"), ``mde`` (in
    points) the difference the seeds are planned for (default each one's observed difference),
    ``seed_only`` the paired t interval over seeds even where per-problem results exist."""

    correction: str = "holm"
    mde: float | None = None
    seed_only: bool = False
    alpha: float = ALPHA

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"--correction must be one of {', '.join(CORRECTIONS)}, got {self.correction!r}")
        if self.mde is not None and self.mde <= 0:
            raise ValueError(f"--mde must be > 0 points, got {self.mde}")


@dataclass
class Comparison:
    """One paired difference of a report: ``variant`` - ``versus`` on ``model``'s ``column``."""

    table: str
    versus: str
    variant: str
    model: str
    column: str
    diff: Difference
    adjusted: float | None = None
    survives: bool = False

    @property
    def mark(self) -> str:
        """``**`` survives the family's correction, ``*`` excludes 0 only uncorrected."""
        return "**" if self.survives else ("*" if self.diff.resolved else "")

    def cell(self, digits: int = 2) -> str:
        """The difference's one text (``Difference.format``) in points, with this comparison's mark."""
        return self.diff.format(digits=digits, mark=self.mark)


def column_scores(row: Mapping[str, Any], column: str) -> float:
    """A result row's pass@1 on one benchmark, or on their average (``AVERAGE``: its pass@1)."""
    return benchmark_scores(row, [column])[column]


def _difference(
    seeds: Sequence[int],
    treatment: Mapping[int, Mapping[str, Any]],
    control: Mapping[int, Mapping[str, Any]],
    rates: tuple[Mapping[int, Mapping[str, Any]], Mapping[int, Mapping[str, Any]]],
    benchmarks: Sequence[str],
    column: str,
) -> Difference | None:
    """Over seeds and problems when every paired cell has the column's per-problem rates, of the
    same problems on both sides; else over seeds (None without a shared seed)."""
    names = list(benchmarks) if column == AVERAGE else [column]
    t_rates, c_rates = rates
    try:
        arrays = {name: [t_rates[s][name] - c_rates[s][name] for s in seeds] for name in names}
        if len(seeds) >= 2 and all(len(a[0]) >= 2 for a in arrays.values()):
            return crossed_interval(arrays, seeds)
    except (KeyError, ValueError):  # a cell without per-problem results, or other problems
        pass
    return seed_interval(
        {s: column_scores(treatment[s], column) for s in seeds},
        {s: column_scores(control[s], column) for s in seeds},
    )


def paired_table(
    rows: Sequence[Mapping[str, Any]],
    problems: Mapping[tuple[str, int], ProblemRates],
    benchmarks: Sequence[str],
    versus: str,
    variants: Sequence[str],
    columns: Sequence[str],
    seed_only: bool = False,
    table: str = "",
) -> list[Comparison]:
    """Every variant - ``versus`` per model and column, paired by seed (and by problem)."""
    by_cell: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    for row in rows:
        by_cell.setdefault((row["variant"], row["model"]), {})[int(row["seed"])] = row

    def rates(variant: str, model: str, seeds: Sequence[int]) -> dict[int, Mapping[str, Any]]:
        if seed_only:
            return {}
        return {s: problems[(variant, s)][model] for s in seeds if model in problems.get((variant, s), {})}

    out = []
    models = sorted({model for variant, model in by_cell if variant != WARM_START})
    for variant in variants:
        if variant in (versus, WARM_START):
            continue
        for model in models:
            treatment, control = by_cell.get((variant, model), {}), by_cell.get((versus, model), {})
            seeds = sorted(set(treatment) & set(control))
            if not seeds:
                continue
            pair = (rates(variant, model, seeds), rates(versus, model, seeds))
            for column in columns:
                diff = _difference(seeds, treatment, control, pair, benchmarks, column)
                if diff is not None:
                    out.append(Comparison(table, versus, variant, model, column, diff))
    return out


def decide(family: Sequence[Comparison], decisions: Decisions) -> None:
    """Adjusts the p-values of the comparisons with an interval, together, by the correction."""
    tested = [c for c in family if c.diff.p is not None]
    for c, adjusted in zip(tested, correct([c.diff.p for c in tested], decisions.correction), strict=True):
        c.adjusted, c.survives = adjusted, adjusted <= decisions.alpha


def kinds_note(family: Sequence[Comparison]) -> str:
    """Which interval each row has, when they differ (cells from before per-problem results)."""
    seed_rows = sorted(
        {f"{c.variant} vs {c.versus}" for c in family if c.diff.kind == SEEDS_ONLY and c.diff.n > 1}
    )
    if not seed_rows:
        return ""
    if all(c.diff.kind == SEEDS_ONLY for c in family):
        return "Every interval is over seeds only: these cells predate per-problem results."
    return (
        f"Over seeds only (a cell without per-problem results): {', '.join(seed_rows)}; every other "
        "interval is over seeds and problems."
    )


def family_note(family: Sequence[Comparison], decisions: Decisions, tables: Sequence[str]) -> str:
    tested = [c for c in family if c.adjusted is not None]
    name = CORRECTION_NAMES[decisions.correction]
    survive = sum(c.survives for c in tested)
    only = sum(c.diff.resolved and not c.survives for c in tested)
    models = sorted({c.model for c in tested})
    columns = list(dict.fromkeys(c.column for c in tested))
    kinds = sorted({c.diff.kind for c in tested})
    return (
        f"Family: the {len(tested)} paired comparisons with an interval in {' and '.join(tables)} "
        f"(rows: each variant vs its table's reference, per model {', '.join(models)}; columns: "
        f"{', '.join(columns)}), corrected together by {name} at {decisions.alpha:.0%}"
        + ("" if decisions.correction != "bh" else " (false discovery rate)")
        + f". `**`: survives the correction ({survive}); `*`: the interval excludes 0 but the "
        f"difference does not survive ({only}). Intervals: {interval_name(kinds)}."
        + (f" {CROSSED_SCOPE}" if CROSSED in kinds else "")
    )


CROSSED_SCOPE = (
    "An interval over seeds × problems is about new seeds and new problems from the same source as "
    "the benchmark's, and is never narrower than the one over seeds; if you only ever evaluate on "
    "these problems (a fixed benchmark), the problem term drops out and the interval over seeds "
    "(`--seed-intervals`) is the one that applies."
)
"""What the seeds × problems interval is about, said once per report (in the family's note)."""


@dataclass
class Costs:
    """Per variant: the seeds finished, and the compute of one seed in the report's units."""

    seeds: dict[str, int] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    rollouts: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: Sequence[Mapping[str, Any]], cells: Mapping[str, Sequence[Mapping[str, Any]]]) -> Costs:
        seeds: dict[str, set[int]] = {}
        for row in rows:
            seeds.setdefault(row["variant"], set()).add(int(row["seed"]))
        costs = cls({variant: len(found) for variant, found in seeds.items()})
        for variant, done in cells.items():
            walls = [float(d["rows"][0]["wall_s"]) for d in done if d.get("rows")]
            rollouts = [float(d["rollouts_per_model"]) for d in done if "rollouts_per_model" in d]
            if walls:
                costs.wall_s[variant] = statistics.fmean(walls)
            if rollouts:
                costs.rollouts[variant] = statistics.fmean(rollouts)
        return costs

    def of_more(self, needed: int, variants: Sequence[str]) -> str:
        """What running both sides of a comparison to ``needed`` seeds adds."""
        extra = {v: max(0, needed - self.seeds.get(v, 0)) for v in variants}
        wall = sum(extra[v] * self.wall_s.get(v, 0.0) for v in variants)
        rollouts = sum(extra[v] * self.rollouts.get(v, 0.0) for v in variants)
        if not any(extra.values()):
            return "none"
        runs = " + ".join(f"{n} x {v}" for v, n in extra.items() if n)
        text = f"{runs}: {wall / 3600:.2f} h train wall-clock" if wall else runs
        return text + (f", {rollouts:,.0f} rollouts/model" if rollouts else "")


def planning_alpha(family: Sequence[Comparison], decisions: Decisions) -> float:
    """The level one comparison must reach to be called: alpha / m under Holm (the step-down's
    strictest step, so the plan is safe whatever the other comparisons do), alpha otherwise."""
    tested = sum(c.diff.n > 1 for c in family)
    return decisions.alpha / max(tested, 1) if decisions.correction == "holm" else decisions.alpha


def plan_markdown(family: Sequence[Comparison], decisions: Decisions, costs: Costs) -> str:
    """| model | variant | vs | column | Δ | adjusted p | seeds | seeds needed | to add |: seeds
    planned at the level the correction asks of one comparison (``planning_alpha``)."""
    target = "--mde" if decisions.mde is not None else "observed Δ"
    alpha = planning_alpha(family, decisions)
    header = [
        "model",
        "variant",
        "vs",
        "column",
        "Δ (points)",
        "interval",
        "adjusted p",
        "seeds",
        f"seeds needed ({target}, 80% power)",
        "to add (train cost)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in family:
        effect = None if decisions.mde is None else decisions.mde / 100
        needed = seeds_needed(c.diff, effect, alpha)
        if c.diff.n < 2:
            need, add = "— (1 seed: no variance yet)", ""
        elif (effect if effect is not None else c.diff.mean) == 0:
            need, add = "— (no difference to resolve)", ""
        elif needed is None and problems_limit(c.diff, effect, alpha):
            need, add = "none suffices: the benchmark's problems limit it", "more problems"
        elif needed is None:
            need, add = "over 1,000", ""
        else:
            need, add = str(needed), costs.of_more(needed, [c.variant, c.versus])
        adjusted = "" if c.adjusted is None else f"{c.adjusted:.3g}"
        kind = "seeds × problems" if c.diff.kind == CROSSED else "seeds"
        cells = [c.model, c.variant, c.versus, c.column, c.cell(), kind, adjusted, str(c.diff.n), need, add]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kind(comparisons: Sequence[Comparison]) -> str:
    kinds = {c.diff.kind for c in comparisons if c.diff.n > 1}
    return " / ".join(sorted(kinds)) if kinds else "—"


def models_markdown(family: Sequence[Comparison], table: str, variants: Sequence[str]) -> str:
    """Rows = variants, per model the decided paired Δ (the embedded task's layout)."""
    mine = [c for c in family if c.table == table]
    models = sorted({c.model for c in mine})
    header = ["variant", *[f"paired Δ {model} (points, 95% CI)" for model in models], "interval"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant in variants:
        row = {c.model: c for c in mine if c.variant == variant}
        if row:
            cells = [row[m].cell() if m in row else "" for m in models]
            lines.append("| " + " | ".join([variant, *cells, _kind(list(row.values()))]) + " |")
    return "\n".join(lines)


def benchmarks_markdown(
    family: Sequence[Comparison], table: str, variants: Sequence[str], columns: Sequence[str]
) -> str:
    """| model | variant | Δ B1 | ... | Δ Avg. | interval |: the decided paired Δ per benchmark."""
    mine = [c for c in family if c.table == table]
    header = ["model", "variant", *(f"paired Δ {c} (points, 95% CI)" for c in columns), "interval"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model in sorted({c.model for c in mine}):
        for variant in variants:
            row = {c.column: c for c in mine if c.variant == variant and c.model == model}
            if row:
                cells = [row[col].cell() if col in row else "" for col in columns]
                lines.append("| " + " | ".join([model, variant, *cells, _kind(list(row.values()))]) + " |")
    return "\n".join(lines)


def family_size(family: Sequence[Comparison], of: str = "the report's family (Decisions, below) of") -> str:
    """The comparisons a decided table's marks are corrected over, for its caption."""
    tested = sum(c.adjusted is not None for c in family)
    return f"{of} {tested} comparison{'s' if tested != 1 else ''}"


def decided_caption(
    what: str,
    table: Sequence[Comparison],
    family: Sequence[Comparison],
    decisions: Decisions,
    of: str = "the report's family (Decisions, below) of",
) -> str:
    """The line above a table of decided comparisons (``table``, of ``family``): what they are, their
    interval(s) and the family's correction (``intervals.caption``)."""
    kinds = {c.diff.kind for c in table if c.diff.n > 1}
    return caption(what, kinds, decisions.correction, family_size(family, of))


def decisions_section(
    family: Sequence[Comparison], decisions: Decisions, costs: Costs, tables: Sequence[str]
) -> list[str]:
    """The family and its correction, then the seeds each comparison needs."""
    if not family:
        return []
    lines = [
        "## Decisions: the correction for this table and the seeds planned",
        "",
        family_note(family, decisions, tables),
        "",
    ]
    if note := kinds_note(family):
        lines += [note, ""]
    what = (
        f"a difference of {decisions.mde:g} points (`--mde`)"
        if decisions.mde is not None
        else "its observed difference"
    )
    lines += [
        f"Seeds each comparison needs to resolve {what} with 80% power at its observed paired variance, "
        f"at the level the correction asks of it ({planning_alpha(family, decisions):.2g}; the part of the "
        "variance from the benchmark's problems does not shrink with seeds), and what adding them "
        "costs in training per seed of each side. `graftrl compare --plan OUT` prints this table "
        "before training more; `--seeds auto --max-seeds K` adds seeds in rounds until each comparison "
        "is resolved.",
        "",
        decided_caption("Δ of each comparison", family, family, decisions, "the family's"),
        "",
        plan_markdown(family, decisions, costs),
        "",
    ]
    return lines


def shows_table2(matrix: Matrix) -> bool:
    """Table 2 is written unless only the baseline is beside the reference (it would mirror Table 1)."""
    names = {v.name for v in matrix.variants}
    return matrix.reference_name is not None and bool(names - {matrix.baseline_name, matrix.reference_name})


def report_family(
    out_dir: Path, matrix: Matrix, rows: Sequence[Mapping[str, Any]], task: CompareTask, decisions: Decisions
) -> list[Comparison]:
    """The paired comparisons of Tables 1 and 2, decided together as one family (Table 2 leaves out
    the baseline: that comparison is Table 1's)."""
    names = [v.name for v in matrix.variants]
    benchmarks = task.evaluation.names
    columns = [*benchmarks, AVERAGE] if task.benchmark_columns and len(benchmarks) > 1 else benchmarks
    problems = folder_problem_results(out_dir, sorted({(r["variant"], int(r["seed"])) for r in rows}))
    family = []
    for versus, table, shown in (
        (matrix.baseline_name, "Table 1", True),
        (matrix.reference_name, "Table 2", shows_table2(matrix)),
    ):
        if versus is not None and shown:
            others = [n for n in names if table == "Table 1" or n != matrix.baseline_name]
            family += paired_table(
                rows, problems, benchmarks, versus, others, columns, decisions.seed_only, table
            )
    decide(family, decisions)
    return family
