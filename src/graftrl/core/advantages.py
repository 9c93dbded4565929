"""Group-relative advantages (algorithm.md §1, eq. 1), and what counts as a success.

Advantages use the reward itself, 0/1 or continuous; GRAFT's counts (k of eq. 4, all-fail,
all-pass, complementarity, pass@k) count successes, rewards at or above a threshold
(``is_success``; algorithm.md §1.1).
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

ADV_EPS = 1e-6
"""eps_adv of eq. 1 (the default of `train.adv_eps`)."""
ADV_STD_UNBIASED = True
"""Unbiased (n - 1) group std in eq. 1, as verl (the default of `train.adv_std_unbiased`)."""
SUCCESS_THRESHOLD = 1.0
"""A response is a success when its reward is at least this (the default of
`reward.success_threshold`): on 0/1 rewards, the rewarded responses."""


@overload
def is_success(rewards: Tensor, threshold: float = SUCCESS_THRESHOLD) -> Tensor: ...
@overload
def is_success(rewards: float, threshold: float = SUCCESS_THRESHOLD) -> bool: ...
def is_success(rewards: Tensor | float, threshold: float = SUCCESS_THRESHOLD) -> Tensor | bool:
    """Which rewards are successes: r >= threshold (algorithm.md §1.1).

    rewards: a tensor of any shape (returns a bool tensor of the same shape) or one reward (returns
    a bool). The one definition of success: every count of GRAFT (k of eq. 4, all-fail, all-pass,
    complementarity, pass@k, success-only transfer, SGT's pick) goes through it. On rewards in
    {0, 1} with the default threshold it is r == 1, the same set as r > 0.5 and r > 0.
    """
    return rewards >= threshold


def grpo_advantages(rewards: Tensor, eps: float = ADV_EPS, unbiased: bool = ADV_STD_UNBIASED) -> Tensor:
    """a_i = (r_i - mean(R(q))) / (std(R(q)) + eps) per group; zero-variance groups get 0.

    rewards: [P, n] — P prompts, n rollouts each. Returns [P, n] (float).
    ``unbiased`` selects the std correction (verl uses the unbiased std, the default).
    """
    rewards = rewards.float()
    n = rewards.shape[-1]
    mean = rewards.mean(dim=-1, keepdim=True)
    if n < 2:
        return torch.zeros_like(rewards)
    std = rewards.std(dim=-1, keepdim=True, correction=1 if unbiased else 0)
    advantages = (rewards - mean) / (std + eps)
    # A group whose rewards are all equal carries no signal; eps alone would not make it exactly 0.
    zero_variance = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(zero_variance, torch.zeros_like(advantages), advantages)


def reverified_advantages(
    stored_rewards: Tensor,
    stored_advantages: Tensor,
    rewards: Tensor,
    eps: float = ADV_EPS,
    unbiased: bool = ADV_STD_UNBIASED,
) -> tuple[Tensor, Tensor]:
    """A stored peer's advantages once its rewards are re-verified (algorithm.md §2.3).

    stored_rewards, stored_advantages, rewards: [P, n] (the store's rewards and advantages, and
    this run's verifier's rewards of the same responses). A group whose rewards are unchanged keeps
    its stored (source-computed) advantages; a changed group gets eq. 1 on its re-verified rewards.
    Returns (advantages [P, n], changed [P] bool).
    """
    changed = (rewards != stored_rewards).any(dim=-1)  # [P]
    recomputed = grpo_advantages(rewards, eps, unbiased)
    return torch.where(changed.unsqueeze(-1), recomputed, stored_advantages.float()), changed
