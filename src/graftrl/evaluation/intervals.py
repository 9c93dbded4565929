"""The paired difference of two methods with an interval over seeds *and* evaluation problems.

A cell's pass@1 is an estimate twice over: of what training with that seed gives (seed noise), and
of the benchmark's population of problems from a finite sample of them (problem noise, large on
30-problem benchmarks). Two variants are paired by seed (same warm-start and prompt stream) and by
problem (same benchmark), so the per-seed, per-problem difference ``d[s, p]`` of their correct
rates is what varies. We model it as a two-way crossed random-effects design,

    d[s, p] = mu + a[s] + c[p] + e[s, p],

and estimate ``Var(mean d)`` = var(a)/S + var(c)/P + var(e)/(S·P) by its unbiased ANOVA estimate
(the mean squares of seeds, problems and residual), with Satterthwaite's degrees of freedom for
the Student t quantile (the seed term taken at its median-unbiased size for the df alone). Why this and not a bootstrap: with 3 seeds a percentile bootstrap over
seeds has only 10 distinct resamples and its intervals are too short (80% coverage at a nominal
95% where seeds dominate, simulated), while the t quantile on a Satterthwaite df reaches its nominal coverage with 3, 5
and 10 seeds and 30-500 problems whichever component dominates (tests/test_intervals.py measures
it). The average over benchmarks (the Avg. column) shares the seeds across benchmarks and has
independent problems within each, so its variance is the variance of the per-seed averages over
seeds plus each benchmark's problem term; the same formula with one benchmark.

Cells written before per-problem results were kept have only one number per seed: they get the
paired t interval over seeds (``seed_interval``), and each result says which ``kind`` it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2
from scipy.stats import t as student_t

from graftrl.evaluation.stats import CONFIDENCE

CROSSED = "seeds × problems"
SEEDS_ONLY = "seeds"


@dataclass(frozen=True)
class Difference:
    """treatment - control: the mean paired difference, its standard error, t interval and p-value.

    ``seed_var`` / ``fixed_var``: the parts of ``se**2`` that shrink with more seeds (times the
    seeds, so ``seed_var / n`` with ``n`` seeds) and that do not (the benchmark's problem sample):
    what planning more seeds needs. ``low``/``high``/``p`` are None with one seed.
    """

    mean: float
    se: float
    df: float
    seeds: tuple[int, ...]
    kind: str
    seed_var: float
    fixed_var: float = 0.0
    confidence: float = CONFIDENCE

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def half(self) -> float | None:
        if self.n < 2 or not math.isfinite(self.df):
            return None
        return float(student_t.ppf(0.5 + self.confidence / 2, self.df)) * self.se

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half

    @property
    def p(self) -> float | None:
        """Two-sided p-value of "no difference" (the t statistic on ``df``)."""
        if self.half is None:
            return None
        if self.se == 0:
            return 1.0 if self.mean == 0 else 0.0
        return float(2 * student_t.sf(abs(self.mean) / self.se, self.df))

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 (uncorrected for the other comparisons of a table)."""
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def format(self, scale: float = 1.0, digits: int = 3, mark: str | None = None) -> str:
        """``+1.20 [-0.40, +2.80]``; ``mark`` (default ``*`` when resolved) follows the interval."""
        text = f"{scale * self.mean:+.{digits}f}"
        if self.low is None or self.high is None:
            return text + " (1 seed)"
        text += f" [{scale * self.low:+.{digits}f}, {scale * self.high:+.{digits}f}]"
        mark = ("*" if self.resolved else "") if mark is None else mark
        return f"{text} {mark}" if mark else text

    def as_dict(self) -> dict[str, float | int | bool | str | None]:
        return {
            "mean": self.mean,
            "se": self.se,
            "df": self.df if math.isfinite(self.df) else None,
            "low": self.low,
            "high": self.high,
            "p": self.p,
            "n": self.n,
            "kind": self.kind,
            "confidence": self.confidence,
            "resolved": self.resolved,
        }


def seed_interval(
    treatment: Mapping[int, float], control: Mapping[int, float], confidence: float = CONFIDENCE
) -> Difference | None:
    """The paired t interval over the seeds both sides have (None when they share none)."""
    seeds = tuple(sorted(set(treatment) & set(control)))
    if not seeds:
        return None
    d = np.array([float(treatment[s]) - float(control[s]) for s in seeds])
    if len(d) < 2:
        return Difference(float(d[0]), 0.0, math.inf, seeds, SEEDS_ONLY, 0.0, confidence=confidence)
    var = float(d.var(ddof=1))
    return Difference(
        float(d.mean()), math.sqrt(var / len(d)), len(d) - 1.0, seeds, SEEDS_ONLY, var, confidence=confidence
    )


def crossed_moments(diffs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, variance estimate, Satterthwaite df and the seed-free part of the variance of the
    unweighted mean over benchmarks, for a batch of designs.

    ``diffs``: per benchmark an array ``[..., S, P_b]`` of paired differences (leading axes are
    independent replicates: the simulation tests pass thousands at once). Every benchmark has the
    same S >= 2 seeds.
    """
    w = 1.0 / len(diffs)
    seeds = diffs[0].shape[-2]
    g = sum(w * d.mean(axis=-1) for d in diffs)  # per-seed average over benchmarks: [..., S]
    seed_term = g.var(axis=-1, ddof=1) / seeds
    problem_terms, noise_terms = [], []  # (variance term, its df) per benchmark
    for d in diffs:
        problems = d.shape[-1]
        h = d.mean(axis=-2)  # per-problem mean over seeds: [..., P]
        resid = d - d.mean(axis=-1, keepdims=True) - h[..., None, :] + d.mean(axis=(-2, -1))[..., None, None]
        ms_err = (resid**2).sum(axis=(-2, -1)) / ((seeds - 1) * (problems - 1))
        problem_terms.append((w * w * h.var(axis=-1, ddof=1) / problems, problems - 1.0))
        noise_terms.append((w * w * ms_err / (seeds * problems), (seeds - 1.0) * (problems - 1)))
    noise = sum(term for term, _ in noise_terms)
    problem = sum(term for term, _ in problem_terms)
    # var(e)/(S·P) is the least the variance can be; the ANOVA combination can undershoot it
    var = np.maximum(seed_term + problem - noise, noise)
    fixed = np.clip(problem - noise, 0.0, var)  # var(c)/P: what more seeds do not shrink
    # Satterthwaite's df, with the seed term at its median-unbiased value (x (S-1) / chi2 median):
    # a seed term that came out small would otherwise raise the df of an interval already too
    # short (with 3 seeds, 92-93% coverage where seeds and problems weigh alike; 94-95% so)
    lifted = seed_term * (seeds - 1) / chi2.median(seeds - 1)
    lifted_var = np.maximum(lifted + problem - noise, noise)
    denominator = lifted**2 / (seeds - 1) + sum(t**2 / df for t, df in problem_terms + noise_terms)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(denominator > 0, lifted_var**2 / denominator, seeds - 1.0)
    df = np.clip(df, seeds - 1.0, None)  # never fewer than the seeds give
    mean = sum(w * d.mean(axis=(-2, -1)) for d in diffs)
    return mean, var, df, fixed


def crossed_interval(
    diffs: Mapping[str, np.ndarray], seeds: Sequence[int], confidence: float = CONFIDENCE
) -> Difference:
    """The paired difference over seeds and problems: ``diffs`` is benchmark -> ``[S, P]`` array
    of treatment - control correct rates (rows in ``seeds`` order, columns the benchmark's
    problems in order); the mean is the unweighted mean over benchmarks (the Avg. column's)."""
    arrays = [np.asarray(a, dtype=float) for a in diffs.values()]
    if len(seeds) < 2:
        mean = float(np.mean([a.mean() for a in arrays]))
        return Difference(mean, 0.0, math.inf, tuple(seeds), CROSSED, 0.0, confidence=confidence)
    if any(a.shape[0] != len(seeds) or a.shape[1] < 2 for a in arrays):
        raise ValueError("crossed_interval: every benchmark needs a row per seed and >= 2 problems")
    mean, var, df, fixed = (float(x) for x in crossed_moments(arrays))
    return Difference(
        mean, math.sqrt(var), df, tuple(seeds), CROSSED, len(seeds) * (var - fixed), fixed, confidence
    )
