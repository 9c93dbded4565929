"""The rescue round's math (CoRe, arXiv 2601.21600; algorithm.md §3.1): which all-fail prompts a
peer's verified success can rescue, and the advantages of the rescued group.

P prompts, K peers, n rollouts per prompt, R rescued prompts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED, SUCCESS_THRESHOLD, grpo_advantages, is_success

NO_PEER = -1
"""``rescue_sources``' value for a prompt that gets no rescue round."""


def rescue_sources(receiver_successes: Tensor, peer_successes: Tensor) -> Tensor:
    """The peer each prompt's hint comes from, NO_PEER where there is no rescue round.

    receiver_successes: [P] the receiver's success count k_B (eq. 4); peer_successes: [K, P] each
    peer's. A prompt is rescued when k_B = 0 and some peer succeeded at least once; its hint comes
    from the peer with the most successes (the first of them on a tie: deterministic, and the
    likeliest to hold a clean solution). Returns [P] long: a row index into ``peer_successes``.
    """
    if peer_successes.numel() == 0:
        return torch.full_like(receiver_successes, NO_PEER, dtype=torch.long)
    best, source = peer_successes.max(dim=0)  # [P], first maximum on ties
    rescued = (receiver_successes == 0) & (best > 0)
    return torch.where(rescued, source, torch.full_like(source, NO_PEER))


def rescued_advantages(
    rewards: Tensor,
    bonus: float = 0.0,
    eps: float = ADV_EPS,
    unbiased: bool = ADV_STD_UNBIASED,
    threshold: float = SUCCESS_THRESHOLD,
) -> Tensor:
    """Advantages of rescued groups: GRPO's (eq. 1) of their own rewards, plus ``bonus`` on each
    rescued success (r >= ``threshold``, ``is_success``).

    rewards: [R, n] the rewards of the n responses sampled with the hint. The bonus is added
    after eq. 1: added to every success's reward before it, it would cancel in the group's
    z-score (scaling all successes of a 0/1 group changes neither its mean's sign nor the
    normalised values). A group still all-fail keeps advantage 0 (nothing to learn, as GRPO).
    Returns [R, n] (float).
    """
    rewards = rewards.float()
    advantages = grpo_advantages(rewards, eps, unbiased)
    return advantages + bonus * is_success(rewards, threshold).float()


def rescue_counts(rewards: Tensor, threshold: float = SUCCESS_THRESHOLD) -> tuple[int, int]:
    """(rescued prompts, of them solved at least once with the hint) of rewards [R, n]; solved:
    some reward is a success (r >= ``threshold``)."""
    return rewards.shape[0], int(is_success(rewards, threshold).any(dim=-1).sum())
