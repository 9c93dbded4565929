"""Pure pieces of GRAFT's ablation switches (algorithm.md §2.4, paper Appendix G).

P prompts, n rollouts per prompt, B responses, T tokens. Randomness comes only from the
``generator`` argument, so a step's draws are reproducible from its seed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success


def random_prompt_selection(count: int, num_prompts: int, generator: torch.Generator) -> Tensor:
    """Count-matched random prompts: ``count`` distinct prompts drawn uniformly from the whole batch.

    Rewards play no part (Appendix G, "random prompts"). Returns BoolTensor [P] with exactly
    ``min(count, P)`` entries set.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    selected = torch.zeros(num_prompts, dtype=torch.bool)
    if count:
        selected[torch.randperm(num_prompts, generator=generator)[:count]] = True
    return selected


def random_admission_weight(s: Tensor, delta: float, generator: torch.Generator) -> Tensor:
    """w_random (eq. 11): admit as many responses as the gate would, but chosen uniformly at random.

    s: [B] compatibility scores of one receiver's transferred responses. The count is
    |{s > delta}|; that many responses are drawn without replacement from all B, and each drawn
    response gets w = min(s, 1) (no floor: a drawn response with s <= delta keeps its weight);
    the others get 0. Returns [B].
    """
    count = int((s > delta).sum())
    weights = torch.zeros_like(s)
    if count:
        chosen = torch.randperm(s.numel(), generator=generator)[:count].to(s.device)
        weights[chosen] = s[chosen].clamp(max=1.0)
    return weights


def success_only_keep(rewards: Tensor, threshold: float = SUCCESS_THRESHOLD) -> Tensor:
    """Success-only transfer: the responses that enter are the successes (r >= ``threshold``).
    rewards: [..., n] -> bool."""
    return is_success(rewards, threshold)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log of the geometric-mean token ratio, mean_t (log pi_theta - log pi_old), per row.

    logp, old_logp, mask: [B, T]. Returns [B] (0 for a row without tokens); differentiable in logp.
    """
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)


def sequence_ratio_logp(logp: Tensor, old_logp: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
    """Log-probs whose token ratio to ``old_logp`` is the row's sequence-level ratio on ``rows``.

    For the selected rows, every token gets log rho = mean_t log rho_{j,t}, i.e. the ratio
    s_j = exp(mean_t log rho_{j,t}) (geometric mean of the token ratios) is applied to all tokens
    of the row, so the clipped surrogate clips s_j with the usual range and the row contributes
    |o_j| * min(s_j a_j, clip(s_j) a_j) to the token-mean sum. Other rows are returned unchanged.
    logp, old_logp, mask: [B, T]; rows: BoolTensor [B]. Returns [B, T] (gradient flows into logp).
    """
    sequence = old_logp + sequence_log_ratio(logp, old_logp, mask).unsqueeze(-1)  # [B, T]
    return torch.where(rows.unsqueeze(-1), sequence, logp)
