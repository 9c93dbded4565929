"""Advantages over a pooled group of several models' responses (naive pooling; eq. 12)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED, grpo_advantages


def pooled_advantages(
    rewards: Sequence[Tensor], eps: float = ADV_EPS, unbiased: bool = ADV_STD_UNBIASED
) -> list[Tensor]:
    """One GRPO advantage (eq. 1) over the concatenation of the groups, split back per group.

    rewards: K tensors [P, n_k] — the groups of K models on the same P prompts. The pool of
    prompt p is G_1(p) || ... || G_K(p) (sum n_k responses); mean and std are taken over the pool,
    and a zero-variance pool gets 0. Returns K tensors [P, n_k], in the input order.
    With two groups of n where the first has no success and the second k: mean = k / (2n), so the
    first group's responses all get -(k / 2n) / (std + eps) < 0.
    """
    if not rewards:
        return []
    sizes = [r.shape[-1] for r in rewards]
    pooled = grpo_advantages(torch.cat([r.float() for r in rewards], dim=-1), eps, unbiased)  # [P, sum n_k]
    return list(torch.split(pooled, sizes, dim=-1))
