"""Per-step diagnostics of algorithm.md §5: pure functions of rewards, and of a step's s and w."""

from __future__ import annotations

from torch import Tensor

from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success


def complementarity(k_receiver: Tensor, k_source: Tensor) -> Tensor:
    """Fraction of the receiver's all-fail prompts that the source solves at least once (Figure 1).

    k_receiver, k_source: [P] success counts. Returns a scalar; NaN (undefined, logged as null)
    when the receiver has no all-fail prompt.
    """
    all_fail = k_receiver == 0
    solved = all_fail & (k_source >= 1)
    return solved.sum().float() / all_fail.sum().float()


def group_outcome_fractions(rewards: Tensor, threshold: float = SUCCESS_THRESHOLD) -> tuple[Tensor, Tensor]:
    """(all-fail fraction, all-pass fraction) over groups. rewards: [P, n]; a group is all-fail
    when none of its rewards is a success (r >= ``threshold``, ``is_success``), all-pass when all are."""
    successes = is_success(rewards, threshold).sum(dim=-1)  # [P]
    n = rewards.shape[-1]
    return (successes == 0).float().mean(), (successes == n).float().mean()


def all_fail_signal_fraction(rewards: Tensor, threshold: float = SUCCESS_THRESHOLD) -> Tensor:
    """Share of groups that are all-fail yet whose rewards differ. rewards: [P, n]. Such a group
    has no success for exchange to miss, but GRPO's advantages there are not zero: partial credit
    (a test suite's fraction passed) ranks its responses."""
    all_fail = is_success(rewards, threshold).sum(dim=-1) == 0  # [P]
    differ = rewards.amax(dim=-1) > rewards.amin(dim=-1)  # [P]
    return (all_fail & differ).float().mean()


def weight_summary(s: Tensor | None, w: Tensor) -> dict[str, float]:
    """What a step's exchange admitted and how compatible it was (the exchange metrics).

    s, w: [N] compatibility scores and applied weights of the step's peer responses, N > 0; s is
    None when the method does not score them (no s statistics). ``peer_admitted`` counts the
    responses that entered the loss (w > 0).
    """
    admitted = w > 0
    scores = (
        {}
        if s is None
        else {
            "s_mean": float(s.mean()),
            "s_median": float(s.median()),
            "s_min": float(s.min()),
            "s_max": float(s.max()),
        }
    )
    return {
        "peer_admitted": int(admitted.sum()),
        "admit_rate": float(admitted.float().mean()),
        **scores,
        "w_mean": float(w.mean()),
    }
