"""Deciding from a table of paired differences: the correction for the table's size, the seeds a
difference needs, and when to stop adding seeds.

- ``correct``: Holm's step-down (family-wise error <= alpha under any dependence; the default) or
  Benjamini-Hochberg (false discovery rate) over the p-values of one report's comparisons.
- ``seeds_needed``: the fewest seeds at which a difference of a given size is resolved with 80% power
  at the observed variance, the power of the two-sided t test taken from the noncentral t law
  (``intervals.Difference``: its seed part shrinks with seeds, its problem part does not, so a
  difference smaller than the benchmark's own noise may need more problems, not more seeds: None).
- ``look_levels`` / ``Sequential``: a group-sequential test for ``--seeds auto``: a look after each
  round of seeds, at information fraction n / K, spends alpha by the Lan-DeMets O'Brien-Fleming-type
  function (almost nothing early, most at K). The levels are calibrated on the exact joint law of
  the paired t statistics over seeds: with 3-10 seeds the normal-theory bounds of the textbook
  design let the error creep above alpha (about 5.6% at 5%), since a t statistic's estimated
  variance changes from look to look. Each comparison of a family spends alpha / m (Bonferroni), so
  the family's error holds under repeated looks; stopping when an unadjusted interval first excludes
  0 would not (about 15% at 5% over 8 looks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.stats import nct, norm
from scipy.stats import t as student_t

from graftrl.evaluation.intervals import Difference

ALPHA = 0.05
POWER = 0.8
"""The power at which ``seeds_needed`` calls a difference resolvable."""
CORRECTIONS = ("holm", "bh", "none")


# Holm 1979, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6
def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (reject where adjusted <= alpha), in input order."""
    p = np.asarray(pvalues, dtype=float)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(adjusted, 1.0)
    return out.tolist()


# Benjamini & Hochberg 1995, "Controlling the false discovery rate", J. R. Statist. Soc. B 57
def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false discovery rate), in input order."""
    p = np.asarray(pvalues, dtype=float)
    m = len(p)
    order = np.argsort(p, kind="stable")
    scaled = p[order] * m / np.arange(1, m + 1)
    adjusted = np.minimum.accumulate(scaled[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(adjusted, 1.0)
    return out.tolist()


def correct(pvalues: Sequence[float], method: str = "holm") -> list[float]:
    """Adjusted p-values by ``method`` ("holm", "bh" or "none")."""
    if method == "holm":
        return holm(pvalues)
    if method == "bh":
        return benjamini_hochberg(pvalues)
    if method == "none":
        return [float(p) for p in pvalues]
    raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}, got {method!r}")


def t_test_power(size: float, se: np.ndarray, df: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """The power of the two-sided t test at level ``alpha`` against a true difference ``size``, for
    a standard error ``se`` on ``df`` degrees of freedom (arrays, one value per n): the noncentral
    t law with noncentrality size / se."""
    # Johnson & Welch 1940, Biometrika 31: the t test's power from the noncentral t distribution
    crit = student_t.ppf(1 - alpha / 2, df)
    se = np.asarray(se, dtype=float)
    with np.errstate(divide="ignore"):
        noncentrality = abs(size) / se
    # the far tail as the upper tail of -T (scipy's nct.cdf gives nan there once it is tiny)
    power = nct.sf(crit, df, noncentrality) + nct.sf(crit, df, -noncentrality)
    return np.where(se > 0, power, float(size != 0))  # no variance: any difference is certain


def seeds_needed(
    diff: Difference, effect: float | None = None, alpha: float = ALPHA, power: float = POWER, cap: int = 1000
) -> int | None:
    """The fewest seeds (>= 2) at which |effect| (default the observed mean) is resolved with
    ``power`` at ``diff``'s variance; None when no number of seeds up to ``cap`` does (the
    benchmark's problem noise alone is too large, or the variance is unknown with one seed).

    The power is the paired t test's at n seeds (``t_test_power``: df n - 1, the seeds' df, which
    is conservative where the problems add df; standard error sqrt(seed_var / n + fixed_var))."""
    size = abs(diff.mean if effect is None else effect)
    if diff.n < 2 or size == 0 or problems_limit(diff, effect, alpha, power):
        return None
    n = np.arange(2, cap + 1)
    reached = t_test_power(size, np.sqrt(diff.seed_var / n + diff.fixed_var), n - 1.0, alpha) >= power
    return int(n[np.argmax(reached)]) if reached.any() else None


def problems_limit(
    diff: Difference, effect: float | None = None, alpha: float = ALPHA, power: float = POWER
) -> bool:
    """The benchmark's problem noise alone is too large for |effect|: no number of seeds resolves it."""
    size = abs(diff.mean if effect is None else effect)
    return (norm.ppf(1 - alpha / 2) + norm.ppf(power)) * math.sqrt(diff.fixed_var) > size


# Lan & DeMets 1983, Biometrika 70: alpha spending; O'Brien & Fleming 1979, Biometrics 35: its shape
def obf_spending(fraction: float | np.ndarray, alpha: float) -> np.ndarray:
    """Lan-DeMets O'Brien-Fleming-type alpha spent by information fraction t: 2 - 2 Φ(z_{α/2} / sqrt t)."""
    t = np.clip(np.asarray(fraction, dtype=float), 1e-12, 1.0)
    return 2.0 - 2.0 * norm.cdf(norm.ppf(1 - alpha / 2) / np.sqrt(t))


CALIBRATION_PATHS = 100_000
"""Null paths that calibrate the look levels (a fixed RNG: the same levels on every machine)."""


@lru_cache(maxsize=32)
def look_levels(schedule: tuple[int, ...], alpha: float = ALPHA) -> tuple[float, ...]:
    """The p-value at or below which each look of ``schedule`` (seeds after each round) rejects, so
    that P(some look rejects) = alpha under no difference, spent as ``obf_spending`` over the
    information fractions n / n_last.

    The joint law of the looks' paired t p-values under no difference does not depend on the
    variance; it is drawn once (``CALIBRATION_PATHS`` normal paths, fixed RNG) and each look's level
    is the quantile of the paths not yet stopped that spends that look's share. The first look's
    level is its share exactly (its p-value is uniform); where a later share is below one path,
    the share itself is the level (a union bound)."""
    if list(schedule) != sorted(set(schedule)) or schedule[0] < 2:
        raise ValueError(f"a look needs >= 2 seeds and looks must add seeds, got {list(schedule)}")
    spent = np.diff(np.concatenate([[0.0], obf_spending(np.array(schedule) / schedule[-1], alpha)]))
    rng = np.random.default_rng(20_260_101)
    paths = rng.standard_normal((CALIBRATION_PATHS, schedule[-1]))
    sums, squares = np.cumsum(paths, axis=1), np.cumsum(paths**2, axis=1)
    alive = np.ones(CALIBRATION_PATHS, dtype=bool)
    levels = []
    for n, share in zip(schedule, spent, strict=True):
        mean = sums[:, n - 1] / n
        sd = np.sqrt(np.maximum(squares[:, n - 1] - n * mean**2, 0.0) / (n - 1))
        p = 2 * student_t.sf(np.abs(mean) / (sd / math.sqrt(n)), n - 1)
        count = int(share * CALIBRATION_PATHS)
        exact = n == schedule[0] or count < 1  # the first look's p is uniform: its share is exact
        level = float(share) if exact else float(np.sort(p[alive])[count - 1])
        levels.append(level)
        alive &= p > level
    return tuple(levels)


def rounds(max_seeds: int, first: int = 3, step: int = 1) -> list[int]:
    """The seeds after each round of ``--seeds auto``: ``first`` (at least 2: an interval needs
    two), then ``step`` more per round up to ``max_seeds``."""
    if max_seeds < 2:
        raise ValueError(f"--max-seeds must be >= 2 (an interval needs two seeds), got {max_seeds}")
    start = min(max(first, 2), max_seeds)
    return [*range(start, max_seeds, step), max_seeds]


@dataclass(frozen=True)
class Sequential:
    """The group-sequential test of one family of ``comparisons`` over the ``rounds`` of seeds."""

    schedule: tuple[int, ...]
    comparisons: int = 1
    alpha: float = ALPHA

    @property
    def levels(self) -> tuple[float, ...]:
        return look_levels(self.schedule, self.alpha / max(self.comparisons, 1))

    def rejects(self, look: int, p: float | None) -> bool:
        """Whether a comparison's p-value at look ``look`` (index into ``schedule``) crosses its level."""
        return p is not None and p <= self.levels[look]
