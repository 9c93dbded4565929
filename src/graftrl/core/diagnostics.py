"""Per-step diagnostics of algorithm.md §5 that are pure functions of rewards."""

from __future__ import annotations

from torch import Tensor


def complementarity(k_receiver: Tensor, k_source: Tensor) -> Tensor:
    """Fraction of the receiver's all-fail prompts that the source solves at least once (Figure 1).

    k_receiver, k_source: [P] success counts. Returns a scalar; NaN (undefined, logged as null)
    when the receiver has no all-fail prompt.
    """
    all_fail = k_receiver == 0
    solved = all_fail & (k_source >= 1)
    return solved.sum().float() / all_fail.sum().float()


def group_outcome_fractions(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """(all-fail fraction, all-pass fraction) over groups. rewards: [P, n] in {0, 1}."""
    successes = rewards.sum(dim=-1)
    n = rewards.shape[-1]
    return (successes == 0).float().mean(), (successes == n).float().mean()
