"""Sequence-level compatibility of a peer response with the receiver (algorithm.md §2.2, eqs. 6-8)."""

from __future__ import annotations

import torch
from torch import Tensor


def mean_token_logprob(token_logprobs: Tensor, mask: Tensor) -> Tensor:
    """lbar (eq. 6): per-row mean of token log-probs over the masked tokens.

    token_logprobs, mask: [B, T]. Returns [B]; a row with no tokens gets 0 (so s = 1 for an
    empty response on both sides).
    """
    mask = mask.bool()
    total = torch.where(mask, token_logprobs, torch.zeros_like(token_logprobs)).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1).to(token_logprobs.dtype)


def content_mean_logprob(token_logprobs: Tensor, finished: bool) -> float:
    """lbar (eq. 6) over a response's own tokens: a terminal EOS is excluded (algorithm.md §2.2).

    token_logprobs: [L] one response's token log-probs. An empty response has lbar = 0, so two
    empty sides give s = 1.
    """
    content = token_logprobs[:-1] if finished else token_logprobs  # [L'] without the EOS
    # The EOS is sliced off, not masked: a masked zero would shift the summation order, and
    # stored records, resumed runs and the trainer must agree bit for bit.
    everything = torch.ones_like(content, dtype=torch.bool)
    return float(mean_token_logprob(content[None], everything[None])[0])


def compatibility_score(receiver_mean_logp: Tensor, source_mean_logp: Tensor) -> Tensor:
    """s(o|q) = exp(lbar(pi_old^R, o^R) - lbar(pi_src, o^S)) (eq. 7). Shapes broadcast."""
    return torch.exp(receiver_mean_logp - source_mean_logp)


DELTA = 0.8
"""The paper's compatibility floor of eq. 8 (the default of `graft.delta`)."""


def compatibility_weight(s: Tensor, delta: float = DELTA) -> Tensor:
    """w(o|q) = 1[s > delta] * min(s, 1) (eq. 8): gate below delta, cap at 1."""
    return torch.where(s > delta, s.clamp(max=1.0), torch.zeros_like(s))
