"""Each compare cell's per-problem results, kept beside its done marker.

``per_problem.json`` holds, per model and benchmark, the correct samples of every evaluation
problem (in the benchmark's order) and the samples per problem. It is written with the cell's
marker and is not part of the marker or its digest, so cells finished before it existed keep
their digests and numbers; the report gives those the interval over seeds only. The problems are
the same in every cell of a matrix (the digest holds the evaluation's problem ids), which is what
pairs two variants by problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PER_PROBLEM = "per_problem.json"

ProblemRates = dict[str, dict[str, np.ndarray]]
"""model -> benchmark -> each problem's correct rate."""


def problem_results(
    per_problem: Mapping[str, Mapping[str, Sequence[float]]], evaluation: Any
) -> dict[str, Any]:
    """What a cell writes: ``per_problem`` is model -> benchmark -> correct rates (``evaluate_cell``)."""
    samples = int(evaluation.samples)
    return {
        "samples": samples,
        "correct": {
            model: {bench: [round(rate * samples) for rate in rates] for bench, rates in by_bench.items()}
            for model, by_bench in per_problem.items()
        },
    }


def read_problem_results(run_dir: Path) -> ProblemRates | None:
    """The cell's per-problem correct rates, or None for a cell that predates them (or a damaged file)."""
    try:
        data = json.loads((Path(run_dir) / PER_PROBLEM).read_text(encoding="utf-8"))
        samples = float(data["samples"])
        return {
            model: {bench: np.asarray(counts, dtype=float) / samples for bench, counts in by_bench.items()}
            for model, by_bench in data["correct"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def folder_problem_results(
    out_dir: Path, cells: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], ProblemRates]:
    """(variant, seed) -> the cell's per-problem rates, for the cells of ``out_dir`` that have them."""
    from graftrl.storage.rundir import ExperimentDir

    found = {}
    for variant, seed in cells:
        rates = read_problem_results(ExperimentDir(out_dir).run(variant, seed).root)
        if rates is not None:
            found[(variant, seed)] = rates
    return found
