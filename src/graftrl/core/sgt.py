"""SGT's choice of supervised peer responses (algorithm.md §3; Liu et al. 2026b)."""

from __future__ import annotations

import torch
from torch import Tensor

from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success


def sgt_eligible(k_receiver: Tensor, k_source: Tensor) -> Tensor:
    """Prompts where the receiver has no correct rollout and the source at least one (k_S = n too).

    k_receiver, k_source: [P] success counts. Returns BoolTensor [P]. Unlike GRAFT's candidates
    (eq. 4) an all-correct source group qualifies.
    """
    return (k_receiver == 0) & (k_source >= 1)


def pick_one_success(
    rewards: Tensor, prompts: Tensor, generator: torch.Generator, threshold: float = SUCCESS_THRESHOLD
) -> Tensor:
    """One correct response per selected prompt, drawn uniformly among that group's successes.

    rewards: [P, n] source rewards; a success is r >= ``threshold`` (``is_success``); prompts:
    BoolTensor [P]. Returns BoolTensor [P, n] with exactly one True per selected prompt that has a
    success, none elsewhere. Draws go in ascending prompt order, one ``randint`` each.
    """
    picked = torch.zeros(rewards.shape, dtype=torch.bool)
    for p in prompts.nonzero().flatten().tolist():
        successes = is_success(rewards[p], threshold).nonzero().flatten()
        if successes.numel():
            j = int(torch.randint(successes.numel(), (1,), generator=generator))
            picked[p, successes[j]] = True
    return picked
