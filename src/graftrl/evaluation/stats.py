"""Statistics for comparing methods over seeds: mean ± std, and the paired differences of result rows.

The one home of these numbers: evaluation's summaries over R runs (``evaluate.mean_std`` is this
``mean_std`` in its dict form), compare's tables and the demo's and analyze's summaries.

Methods compared on the same seeds share the warm-start, the prompt stream and the evaluation
problems, so seed-to-seed variation common to both cancels in the per-seed difference.
``paired_deltas`` gives, per variant and model, the paired Student t interval over seeds,
``mean(d) ± t_{1-α/2, n-1} · sd(d) / sqrt(n)`` with ``d_s = treatment_s - control_s``, as an
``intervals.Difference`` (graftrl's one paired-difference type, from ``intervals.seed_interval``),
for the tables that read result rows only: the sweeps' lines, the demo's, and compare's per-family
section. With one seed there is no interval.
"""

from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from graftrl.evaluation.intervals import CONFIDENCE as CONFIDENCE  # its home before issue 57
from graftrl.evaluation.intervals import Difference, seed_interval

_DEPRECATED = {
    "PairedDifference": ("Difference", Difference),
    "paired_difference": ("seed_interval", seed_interval),
}
"""Names this module had before graftrl had one paired-difference type (issue 57): their
replacements in ``graftrl.evaluation.intervals``."""


def __getattr__(name: str) -> Any:
    """A deprecated name (``_DEPRECATED``), with a DeprecationWarning; removed in the next release."""
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(
            f"graftrl.evaluation.stats.{name} is deprecated: use graftrl.evaluation.intervals.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class MeanStd:
    """Mean and sample standard deviation (n - 1; 0 for a single value) of ``n`` values."""

    mean: float
    std: float
    n: int

    def format(self, scale: float = 1.0, digits: int = 3) -> str:
        return f"{scale * self.mean:.{digits}f} ± {scale * self.std:.{digits}f}"


def mean_std(values: Sequence[float]) -> MeanStd:
    """Mean ± sample std of ``values`` (at least one)."""
    if not values:
        raise ValueError("mean_std: no values")
    floats = [float(v) for v in values]
    return MeanStd(
        statistics.fmean(floats), statistics.stdev(floats) if len(floats) > 1 else 0.0, len(floats)
    )


def family_rows(rows: Sequence[Mapping[str, Any]], key: str = "model") -> list[dict[str, Any]]:
    """One row per (row, family) with ``key`` set to "<model> · <family>" and that family's pass@1.

    Rows carry ``per_family`` ({family: pass@1}); the result feeds the same tables and paired
    differences as whole-benchmark rows. Rows without families contribute nothing.
    """
    return [
        {**row, key: f"{row[key]} · {family}", "pass_at_1": score}
        for row in rows
        for family, score in (row.get("per_family") or {}).items()
    ]


# --------------------------------------------------------------------------------------------
# Result rows: {"variant"/"method", "model", "seed", "pass_at_1", "wall_s", ...}, one per cell
# --------------------------------------------------------------------------------------------

WARM_START = "warm-start"
"""Pseudo-variant of the untrained policies: shown beside the others, never compared."""


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """variant -> model -> {"mean", "std", "seeds", "wall_s"} over seeds.

    std is the sample standard deviation (n - 1; 0 for one seed); wall_s the mean training
    wall-clock per seed.
    """
    values: dict[str, dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        values[row["variant"]][row["model"]].append(row)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant, models in values.items():
        for model, cells in models.items():
            scores = mean_std([float(c["pass_at_1"]) for c in cells])
            out.setdefault(variant, {})[model] = {
                "mean": scores.mean,
                "std": scores.std,
                "seeds": scores.n,
                "wall_s": statistics.fmean(float(c["wall_s"]) for c in cells),
            }
    return out


def deltas(
    summary: Mapping[str, Mapping[str, Mapping[str, Any]]], reference: str | None
) -> dict[str, dict[str, float | None]]:
    """variant -> model -> mean(variant) - mean(reference) (None without a reference score)."""
    ref = summary.get(reference or "", {})
    return {
        variant: {
            model: (s["mean"] - ref[model]["mean"]) if model in ref else None for model, s in models.items()
        }
        for variant, models in summary.items()
    }


def paired_deltas(
    rows: Sequence[Mapping[str, Any]], reference: str | None, key: str = "variant"
) -> dict[str, dict[str, Difference]]:
    """variant -> model -> pass@1(variant) - pass@1(reference), paired by seed: the t interval over
    seeds (``intervals.seed_interval``), uncorrected.

    ``key``: the row field that names the variant ("method" in the demo's results.json).
    """
    scores: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        scores[row[key]][row["model"]][int(row["seed"])] = float(row["pass_at_1"])
    ref = scores.get(reference or "", {})
    out: dict[str, dict[str, Difference]] = {}
    for variant, models in scores.items():
        if variant in (reference, WARM_START):
            continue
        for model, by_seed in models.items():
            if model in ref and (diff := seed_interval(by_seed, ref[model])) is not None:
                out.setdefault(variant, {})[model] = diff
    return out
