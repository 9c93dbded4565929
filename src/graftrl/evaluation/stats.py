"""Statistics for comparing methods over seeds: mean ± std and paired differences with intervals.

The one home of these numbers: evaluation's summaries over R runs (``evaluate.mean_std`` is this
``mean_std`` in its dict form), compare's tables and the demo's and analyze's summaries.

Methods compared on the same seeds share the warm-start, the prompt stream and the evaluation
problems, so seed-to-seed variation common to both cancels in the per-seed difference. The
interval reported beside mean ± std is the paired Student t interval over seeds,
``mean(d) ± t_{1-α/2, n-1} · sd(d) / sqrt(n)`` with ``d_s = treatment_s - control_s``; a difference
is called only where that interval excludes 0. With one seed there is no interval.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy.stats import t as student_t

CONFIDENCE = 0.95
"""The level of every interval graftrl reports."""


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


@dataclass(frozen=True)
class PairedDifference:
    """treatment - control, paired by seed: the mean difference and its t interval.

    ``low``/``high`` are None with fewer than two pairs. ``seeds`` are the paired seeds used.
    """

    mean: float
    std: float
    low: float | None
    high: float | None
    seeds: tuple[int, ...]
    confidence: float = CONFIDENCE

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def resolved(self) -> bool:
        """True when the interval excludes 0: the data say which of the two is better."""
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def format(self, scale: float = 1.0, digits: int = 3) -> str:
        """``+0.012 [-0.004, +0.028]`` (``*`` when the interval excludes 0)."""
        text = f"{scale * self.mean:+.{digits}f}"
        if self.low is None or self.high is None:
            return text + " (1 seed)"
        interval = f" [{scale * self.low:+.{digits}f}, {scale * self.high:+.{digits}f}]"
        return text + interval + (" *" if self.resolved else "")

    def as_dict(self) -> dict[str, float | int | bool | None]:
        return {
            "mean": self.mean,
            "std": self.std,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "confidence": self.confidence,
            "resolved": self.resolved,
        }


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


def paired_difference(
    treatment: Mapping[int, float], control: Mapping[int, float], confidence: float = CONFIDENCE
) -> PairedDifference | None:
    """Paired difference over the seeds both sides have (None when they share no seed).

    treatment, control: seed -> score.
    """
    seeds = tuple(sorted(set(treatment) & set(control)))
    if not seeds:
        return None
    diffs = [float(treatment[s]) - float(control[s]) for s in seeds]
    summary = mean_std(diffs)
    if len(diffs) < 2:
        return PairedDifference(summary.mean, 0.0, None, None, seeds, confidence)
    quantile = float(student_t.ppf(0.5 + confidence / 2, df=len(diffs) - 1))  # a Python float: JSON-safe
    half = quantile * summary.std / math.sqrt(len(diffs))
    return PairedDifference(
        summary.mean, summary.std, summary.mean - half, summary.mean + half, seeds, confidence
    )


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
) -> dict[str, dict[str, PairedDifference]]:
    """variant -> model -> pass@1(variant) - pass@1(reference), paired by seed (t interval).

    ``key``: the row field that names the variant ("method" in the demo's results.json).
    """
    scores: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        scores[row[key]][row["model"]][int(row["seed"])] = float(row["pass_at_1"])
    ref = scores.get(reference or "", {})
    out: dict[str, dict[str, PairedDifference]] = {}
    for variant, models in scores.items():
        if variant in (reference, WARM_START):
            continue
        for model, by_seed in models.items():
            if model in ref and (diff := paired_difference(by_seed, ref[model])) is not None:
                out.setdefault(variant, {})[model] = diff
    return out
