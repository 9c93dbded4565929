"""``graftrl compare --plan``: the decisions of earlier compares (or a pilot), read from their
folders, with the seeds and the cost that would resolve each comparison, before training more."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graftrl.embedded.base import HELDOUT
from graftrl.evaluation.stats import WARM_START
from graftrl.experiments.benchmark_tables import AVERAGE
from graftrl.experiments.paired_decisions import (
    Comparison,
    Costs,
    Decisions,
    decide,
    decided_caption,
    family_note,
    kinds_note,
    paired_table,
    plan_markdown,
    planning_alpha,
)
from graftrl.reporting.problem_results import folder_problem_results


def _read_results(folder: Path) -> dict[str, Any]:
    from graftrl.experiments.matrix import CompareError
    from graftrl.storage.rundir import ExperimentDir

    path = ExperimentDir(folder).results
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(results["rows"], list) or not isinstance(results["variants"], list):
            raise TypeError("rows and variants must be lists")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CompareError(
            f"--plan {folder}: no compare results there ({path}: {error}); give a compare's output folder"
        ) from None
    return results


def folder_family(folder: Path, decisions: Decisions) -> tuple[list[Comparison], Costs]:
    """The comparisons of an earlier compare (or pilot) folder: each variant against the baseline,
    and against the reference, per model, on every benchmark and their average."""
    from graftrl.storage.rundir import ExperimentDir, RunDir

    results = _read_results(folder)
    rows = [r for r in results["rows"] if r["variant"] != WARM_START]
    names = [v["name"] for v in results["variants"]]
    benchmarks = list((results.get("settings") or {}).get("benchmarks") or {}) or [HELDOUT]
    columns = [*benchmarks, AVERAGE] if len(benchmarks) > 1 else benchmarks
    cells_seen = sorted({(r["variant"], int(r["seed"])) for r in rows})
    problems = folder_problem_results(folder, cells_seen)
    family: list[Comparison] = []
    for versus, table in ((results.get("baseline"), "Table 1"), (results.get("reference"), "Table 2")):
        if versus and any(r["variant"] == versus for r in rows):
            others = [n for n in names if table == "Table 1" or n != results.get("baseline")]
            family += paired_table(
                rows, problems, benchmarks, versus, others, columns, decisions.seed_only, table
            )
    done: dict[str, list[dict[str, Any]]] = {}
    for variant, seed in cells_seen:
        marker = RunDir(ExperimentDir(folder).run(variant, seed).root).done
        if marker.is_file():
            done.setdefault(variant, []).append(json.loads(marker.read_text()))
    return family, Costs.of(rows, done)


def plan(folders: Sequence[Path], decisions: Decisions) -> str:
    """``graftrl compare --plan``: the comparisons of earlier compares, as one family, with the
    seeds and the cost that resolve each (its observed difference, or ``decisions.mde``)."""
    family: list[Comparison] = []
    costs = Costs()
    for folder in folders:
        found, folder_costs = folder_family(folder, decisions)
        label = Path(folder).name
        for c in found:
            c.table = f"{label} {c.table}" if len(folders) > 1 else c.table
            if len(folders) > 1:
                c.model = f"{label}: {c.model}"
        family += found
        if len(folders) == 1:
            costs = folder_costs
        else:  # variants share names across folders: the first folder's cost per seed stands in
            for attribute in ("seeds", "wall_s", "rollouts"):
                for key, value in getattr(folder_costs, attribute).items():
                    getattr(costs, attribute).setdefault(key, value)
    decide(family, decisions)
    tables = list(dict.fromkeys(c.table for c in family))
    what = (
        f"a difference of {decisions.mde:g} points"
        if decisions.mde is not None
        else "its observed difference"
    )
    lines = [
        f"# graftrl compare --plan: {', '.join(str(f) for f in folders)}",
        "",
        f"Seeds each comparison needs to resolve {what} with 80% power, two-sided, at the level the "
        f"correction asks of it ({planning_alpha(family, decisions):.2g}), at its observed paired "
        "variance; the part of that variance that comes from the benchmark's problems does not shrink "
        "with seeds. Costs: the variants' mean training per seed.",
        "",
        family_note(family, decisions, tables) if family else "No paired comparison: no shared seeds yet.",
        "",
    ]
    if note := kinds_note(family):
        lines += [note, ""]
    if family:
        lines += [decided_caption("Δ of each comparison", family, family, decisions, "the plan's"), ""]
    return "\n".join([*lines, plan_markdown(family, decisions, costs), ""])
