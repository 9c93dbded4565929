"""``graftrl compare --seeds auto --max-seeds K``: seeds added in rounds until each comparison is resolved.

The rounds are those of ``evaluation.decisions.rounds`` (3 seeds, then one more per round, up to
K). After each round every unresolved comparison of the report's family (each variant against the
baseline and against the reference, per model and column, as the report corrects them) is looked
at with the group-sequential test (``evaluation.decisions.Sequential``: alpha spent over the looks,
split over the family); one that crosses its look's level is resolved for good. A variant stops
getting seeds once every comparison it is part of is resolved; the others go on to K. The looks
read only the finished cells, so a rerun after a kill takes the same decisions and finishes as the
uninterrupted run; the cells are ordinary cells (reused by digest, ``--only-cell``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graftrl.evaluation.decisions import Sequential, rounds
from graftrl.experiments.benchmark_tables import AVERAGE
from graftrl.experiments.compare.task import CompareTask
from graftrl.experiments.matrix import CompareError, Matrix, Variant
from graftrl.experiments.paired_decisions import Decisions, report_family, shows_table2

Key = tuple[str, str, str, str, str]
"""A comparison: (table, versus, variant, model, column)."""


@dataclass
class Rounds:
    """The sequential plan of one ``--seeds auto`` compare and what its looks decided."""

    schedule: tuple[int, ...]
    family: int
    """Comparisons in the family (alpha is split over them)."""
    resolved: dict[Key, int] = field(default_factory=dict)
    """Comparison -> the seeds at the look that resolved it."""
    looks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def test(self) -> Sequential:
        return Sequential(self.schedule, self.family)

    def active(self, matrix: Matrix, keys: Sequence[Key]) -> list[str]:
        """The variants with a comparison still unresolved."""
        open_keys = [k for k in keys if k not in self.resolved]
        return [v.name for v in matrix.variants if any(v.name in (k[1], k[2]) for k in open_keys)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "schedule": list(self.schedule),
            "family": self.family,
            "levels": list(self.test.levels),
            "looks": self.looks,
        }


def family_keys(matrix: Matrix, task: CompareTask) -> list[Key]:
    """Every comparison the report will correct, before any cell has run."""
    names = [v.name for v in matrix.variants]
    benchmarks = task.evaluation.names
    columns = [*benchmarks, AVERAGE] if task.benchmark_columns and len(benchmarks) > 1 else benchmarks
    models = [p.name for p in task.config.policies]
    keys: list[Key] = []
    pairs = [("Table 1", matrix.baseline_name, n) for n in names if n != matrix.baseline_name]
    if shows_table2(matrix):
        reference = matrix.reference_name
        pairs += [("Table 2", reference, n) for n in names if n not in (reference, matrix.baseline_name)]
    for table, versus, variant in pairs:
        if versus is not None:
            keys += [(table, versus, variant, model, column) for model in models for column in columns]
    if not keys:
        raise CompareError(
            "--seeds auto adds seeds until each comparison is resolved: the matrix needs a baseline or a "
            "reference variant to compare against"
        )
    return keys


def run_rounds(
    out_dir: Path,
    matrix: Matrix,
    task: CompareTask,
    max_seeds: int,
    decisions: Decisions,
    execute: Callable[[Sequence[tuple[int, Variant]]], Mapping[tuple[int, str], Mapping[str, Any]]],
    stop_when_unfinished: bool = False,
) -> tuple[Rounds, list[tuple[int, Variant]]]:
    """Runs the rounds: ``execute(cells)`` runs (or finds) those cells and returns every finished
    cell's done record by (seed, variant). Returns the rounds and, with ``stop_when_unfinished``
    (``--list-cells``, ``--report-only``), the cells of the first round that are not finished."""
    try:
        schedule = tuple(rounds(max_seeds))
    except ValueError as error:
        raise CompareError(str(error)) from None
    keys = family_keys(matrix, task)
    plan = Rounds(schedule, len(keys))
    levels = plan.test.levels
    active = [v.name for v in matrix.variants]
    for look, seeds in enumerate(schedule):
        cells = [(s, v) for s in range(seeds) for v in matrix.variants if v.name in active]
        finished = execute(cells)
        missing = [(s, v) for s, v in cells if (s, v.name) not in finished]
        if missing:
            if stop_when_unfinished:
                return plan, missing
            break  # cells that died: the report holds what finished
        rows = [
            row
            for (s, name), done in finished.items()
            if s < seeds and name in active
            for row in done["rows"]
        ]
        newly = []
        for c in report_family(out_dir, matrix, rows, task, Decisions("none", seed_only=decisions.seed_only)):
            key = (c.table, c.versus, c.variant, c.model, c.column)
            if key in keys and key not in plan.resolved and plan.test.rejects(look, c.diff.p):
                plan.resolved[key] = seeds
                newly.append(" / ".join(key[1:]))
        plan.looks.append({"seeds": seeds, "variants": active, "level": levels[look], "resolved": newly})
        active = plan.active(matrix, keys)
        if not active:
            break
    return plan, []


def rounds_section(plan: Rounds) -> list[str]:
    """report.md's account of the rounds."""
    lines = [
        "## Seeds added until resolved (`--seeds auto`)",
        "",
        f"Rounds of seeds {', '.join(map(str, plan.schedule))}; after each, every unresolved comparison of the "
        f"family ({plan.family}) is looked at with a group-sequential test (O'Brien-Fleming-type alpha "
        "spending over the looks, calibrated on the paired t statistics; alpha split over the family), so "
        "the chance of any false call over all looks stays at 5%. A variant stops getting seeds once "
        "each of its comparisons is resolved. The intervals above are those of the seeds run; the call "
        "is the sequential test's.",
        "",
        "| look | seeds | level (p <=) | variants run | resolved at this look |",
        "|---|---|---|---|---|",
    ]
    for i, look in enumerate(plan.looks):
        resolved = "; ".join(look["resolved"]) or "—"
        lines.append(
            f"| {i + 1} | {look['seeds']} | {look['level']:.2g} | {', '.join(look['variants'])} | {resolved} |"
        )
    left = plan.family - len(plan.resolved)
    lines += [
        "",
        f"Resolved: {len(plan.resolved)} of {plan.family} comparisons; unresolved at the last look: {left}.",
        "",
    ]
    return lines
