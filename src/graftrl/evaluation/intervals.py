"""The paired difference of two methods with an interval over seeds *and* evaluation problems.

A cell's pass@1 is an estimate twice over: of what training with that seed gives (seed noise), and
of the benchmark's population of problems from a finite sample of them (problem noise, large on
30-problem benchmarks). Two variants are paired by seed (same warm-start and prompt stream) and by
problem (same benchmark), so the per-seed, per-problem difference ``d[s, p]`` of their correct
rates is what varies. We model it as a two-way crossed random-effects design,

    d[s, p] = mu + a[s] + c[p] + e[s, p],

and estimate ``Var(mean d)`` = var(a)/S + var(c)/P + var(e)/(S·P) from the mean squares of seeds,
problems and residual (the ANOVA estimate, its problem component truncated at 0), with
Satterthwaite's degrees of freedom for the Student t quantile. The interval is about new seeds and
new problems from the same source, so it is never narrower than the paired t interval over seeds
(which is about these problems only): where Satterthwaite's df would make it so, it is that
interval. Why this and not a bootstrap: with 3 seeds a percentile bootstrap over seeds has only 10
distinct resamples and its intervals are too short (80% coverage at a nominal 95% where seeds
dominate, simulated), while this interval covers 94-97% with 3, 5 and 10 seeds and 30-500 problems
whichever component dominates (tests/test_intervals.py measures it). The average over benchmarks
(the Avg. column) shares the seeds across benchmarks and has independent problems within each, so
its variance is the variance of the per-seed averages over seeds plus each benchmark's problem
term; the same formula with one benchmark.

Cells written before per-problem results were kept have only one number per seed: they get the
paired t interval over seeds (``seed_interval``), and each result says which ``kind`` it is.

``Difference`` is graftrl's one paired-difference type, whichever interval it has, and ``format`` its
one text (``+2.40 [-0.10, +5.00] **``, in points); ``caption`` is what a table of them says about
its interval and correction (docs/comparing.md, "Reading a paired difference").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import t as student_t

CONFIDENCE = 0.95
"""The level of every interval graftrl reports."""

CROSSED = "seeds × problems"
SEEDS_ONLY = "seeds"
CORRECTED = {"holm": "Holm-corrected", "bh": "Benjamini-Hochberg-corrected", "none": "uncorrected"}
"""How a table's caption names its correction (``decisions.CORRECTIONS``' keys)."""


def difference_text(
    mean: float, low: float | None, high: float | None, scale: float = 100.0, digits: int = 2, mark: str = ""
) -> str:
    """The one text of a paired difference: ``+2.40 [-0.10, +5.00]``, then ``mark`` (``*``: the
    interval excludes 0; ``**``: the difference also survives its table's correction); with one
    seed (no interval) ``+2.40 (1 seed)``. ``scale`` 100: points of pass@1."""
    text = f"{scale * mean:+.{digits}f}"
    if low is None or high is None:
        return text + " (1 seed)"
    text += f" [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"
    return f"{text} {mark}" if mark else text


def dict_text(d: Mapping[str, Any] | None, scale: float = 100.0, digits: int = 2, empty: str = "—") -> str:
    """``difference_text`` of a difference written out (``Difference.as_dict``, as results.json
    holds it), ``*`` where its interval excludes 0; ``empty`` for None."""
    if d is None:
        return empty
    return difference_text(d["mean"], d["low"], d["high"], scale, digits, "*" if d["resolved"] else "")


def interval_name(kinds: Iterable[str]) -> str:
    """The interval a table gives: over seeds × problems (``CROSSED``), over seeds (``SEEDS_ONLY``),
    or both where its rows differ (the ``interval`` column of compare's tables says which)."""
    found = set(kinds)
    if not found:
        return f"{CONFIDENCE:.0%} CI: none yet, one seed"
    if found == {SEEDS_ONLY}:
        return f"{CONFIDENCE:.0%} CI over seeds"
    if found == {CROSSED, SEEDS_ONLY}:
        return f"{CONFIDENCE:.0%} CI over seeds × problems, or over seeds where the `interval` column says so"
    return f"{CONFIDENCE:.0%} CI over seeds × problems"


def caption(what: str, kinds: Iterable[str], correction: str, family: str = "") -> str:
    """The line above a table of paired differences: ``what`` they are, the interval (``kinds``:
    ``CROSSED`` and/or ``SEEDS_ONLY``) and whether its marks are corrected (``correction``: a
    ``CORRECTED`` key; ``family``: for which comparisons, e.g. "the table's 8 comparisons")."""
    head = f"{what}: mean [{interval_name(kinds)}] in points, {CORRECTED[correction]}"
    if correction == "none":
        return (
            f"{head}{f' for {family}' if family else ''}: `*` marks an interval that excludes 0, each "
            "comparison taken alone."
        )
    return (
        f"{head}{f' over {family}' if family else ''}: `**` survives the correction, the only "
        "differences called; `*` the interval excludes 0 uncorrected only."
    )


def _two_sided_p(mean: float, se: float, df: float) -> float:
    """The t test of "no difference": 2 P(T_df > |mean| / se) (1 or 0 where se is 0)."""
    if se == 0:
        return 1.0 if mean == 0 else 0.0
    return float(2 * student_t.sf(abs(mean) / se, df))


@dataclass(frozen=True)
class Difference:
    """treatment - control: the mean paired difference, its standard error, t interval and p-value.

    ``seed_var`` / ``fixed_var``: the parts of ``se**2`` that shrink with more seeds (times the
    seeds, so ``seed_var / n`` with ``n`` seeds) and that do not (the benchmark's problem sample):
    what planning more seeds needs. ``seed_se``: over seeds and problems, the standard error of the
    paired t interval over seeds (df n - 1), which the interval is never narrower than (0 for the
    interval over seeds, whose ``se`` it is). ``low``/``high``/``p`` are None with one seed.
    """

    mean: float
    se: float
    df: float
    seeds: tuple[int, ...]
    kind: str
    seed_var: float
    fixed_var: float = 0.0
    confidence: float = CONFIDENCE
    seed_se: float = 0.0

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def half(self) -> float | None:
        if self.n < 2 or not math.isfinite(self.df):
            return None
        quantile = 0.5 + self.confidence / 2
        half = float(student_t.ppf(quantile, self.df)) * self.se
        if self.seed_se > 0:  # never narrower than the interval over seeds
            half = max(half, float(student_t.ppf(quantile, self.n - 1)) * self.seed_se)
        return half

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half

    @property
    def p(self) -> float | None:
        """Two-sided p-value of "no difference" (the t statistic on ``df``; over seeds and problems
        the larger of it and the seeds' paired t test's, so p <= 1 - confidence exactly when the
        interval excludes 0)."""
        if self.half is None:
            return None
        p = _two_sided_p(self.mean, self.se, self.df)
        if self.seed_se > 0:
            p = max(p, _two_sided_p(self.mean, self.seed_se, self.n - 1.0))
        return p

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 (uncorrected for the other comparisons of a table)."""
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def format(self, scale: float = 100.0, digits: int = 2, mark: str | None = None) -> str:
        """The one text (``difference_text``): ``+1.20 [-0.40, +2.80] *`` in points; ``mark``
        (default ``*`` when resolved) follows the interval."""
        mark = ("*" if self.resolved else "") if mark is None else mark
        return difference_text(self.mean, self.low, self.high, scale, digits, mark)

    def as_dict(self) -> dict[str, float | int | bool | str | None]:
        out: dict[str, float | int | bool | str | None] = {
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
        if self.kind == CROSSED:
            out["seed_se"] = self.seed_se
        return out


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


@dataclass(frozen=True)
class Moments:
    """A batch of crossed designs' estimates (arrays over the leading, replicate axes).

    ``mean``: the mean difference; ``var``: the estimate of its variance over seeds and problems;
    ``df``: Satterthwaite's; ``fixed``: the part of ``var`` that more seeds do not shrink
    (var(c)/P); ``seed_var``: the variance of the mean of the per-seed differences (the paired t
    interval over seeds has ``sqrt(seed_var)`` as its standard error on ``seeds - 1`` df).
    """

    mean: np.ndarray
    var: np.ndarray
    df: np.ndarray
    fixed: np.ndarray
    seed_var: np.ndarray
    seeds: int

    def half(self, confidence: float = CONFIDENCE) -> np.ndarray:
        """The interval's half-width: Satterthwaite's t interval, or the seeds' paired t interval
        where that one is wider (a sample of problems adds uncertainty, it never removes any)."""
        quantile = 0.5 + confidence / 2
        crossed = student_t.ppf(quantile, self.df) * np.sqrt(self.var)
        return np.maximum(crossed, student_t.ppf(quantile, self.seeds - 1) * np.sqrt(self.seed_var))

    def p(self) -> np.ndarray:
        """The two-sided p-value that matches ``half``: p <= 1 - c exactly when the c interval
        excludes 0 (the larger of the two t tests' p-values)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            crossed = 2 * student_t.sf(np.abs(self.mean) / np.sqrt(self.var), self.df)
            seeds = 2 * student_t.sf(np.abs(self.mean) / np.sqrt(self.seed_var), self.seeds - 1)
        return np.maximum(crossed, seeds)


def crossed_moments(diffs: Sequence[np.ndarray]) -> Moments:
    """Mean, variance estimate, Satterthwaite df, the seed-free part of the variance and the
    seed-only variance of the unweighted mean over benchmarks, for a batch of designs.

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
    # var(c)/P, the problem component, truncated at 0 (its ANOVA estimate, problem - noise, is
    # negative when the problems differ less than the residual predicts): a variance is never
    # negative, so the estimate is never below the seeds' own, seed_term
    fixed = np.maximum(problem - noise, 0.0)
    # var(e)/(S·P) is the least the variance can be; seed_term can come out below it by chance
    var = np.maximum(seed_term + fixed, noise)
    # Satterthwaite 1946, Biometrics Bulletin 2: the df of a sum of mean squares, var**2 / sum(term**2 / df)
    denominator = seed_term**2 / (seeds - 1) + sum(t**2 / df for t, df in problem_terms + noise_terms)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(denominator > 0, var**2 / denominator, seeds - 1.0)
    df = np.clip(df, seeds - 1.0, None)  # never fewer than the seeds give
    mean = sum(w * d.mean(axis=(-2, -1)) for d in diffs)
    return Moments(mean, var, df, np.minimum(fixed, var), seed_term, seeds)


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
    m = crossed_moments(arrays)
    mean, var, df, fixed, seed_var = (float(x) for x in (m.mean, m.var, m.df, m.fixed, m.seed_var))
    return Difference(
        mean,
        math.sqrt(var),
        df,
        tuple(seeds),
        CROSSED,
        len(seeds) * (var - fixed),
        fixed,
        confidence,
        math.sqrt(seed_var),
    )
