"""LUFFY's regularised importance-sampling objective for off-policy tokens (algorithm.md §2.4, Appendix G)."""

from __future__ import annotations

import torch
from torch import Tensor

from graftrl.core.losses import EPS_HIGH, EPS_LOW, clipped_policy_loss

GAMMA = 0.1
"""LUFFY's shaping constant of f(x) = x / (x + gamma) (the default of `luffy.gamma`)."""


def luffy_shaping(logp: Tensor, gamma: float = GAMMA) -> Tensor:
    """f(pi_theta(o_t)) with f(x) = x / (x + gamma), x = exp(logp). logp: [B, T] -> [B, T].

    The behaviour probability is taken as 1, so x is pi_theta itself (no ratio to an old policy),
    and d f(x) / d logp = gamma x / (x + gamma)^2: small both for near-certain tokens and for very
    unlikely ones, which is LUFFY's point.
    """
    x = torch.exp(logp)
    return x / (x + gamma)


def luffy_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    mask: Tensor,
    is_peer: Tensor,
    eps_low: float = EPS_LOW,
    eps_high: float = EPS_HIGH,
    gamma: float = GAMMA,
    *,
    normalizer: float | Tensor | None = None,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Return (-J, metrics): own rows use the clipped surrogate (eq. 10), peer rows f(pi_theta) * a.

    logp, old_logp, mask: [B, T]; advantages, weights, is_peer: [B]. Peer tokens are never clipped
    and ignore ``old_logp``. J = 1/sum_j |o_j| * sum_j w_j sum_t g_{j,t}, with g the clipped
    surrogate on own rows and f(pi_theta(o_t)) a_j on peer rows: one token-mean over every kept
    token of the minibatch, own and peer together (``normalizer`` overrides the count as in
    ``clipped_policy_loss``). Rows with weight 0 are removed.
    """
    kept_rows = weights > 0
    token_mask = mask.bool() & kept_rows.unsqueeze(-1)  # [B, T]
    denominator = token_mask.sum().clamp(min=1) if normalizer is None else normalizer
    own_loss, metrics = clipped_policy_loss(
        logp,
        old_logp,
        advantages,
        weights * ~is_peer,
        mask,
        eps_low,
        eps_high,
        normalizer=denominator,
        is_peer=is_peer,
        clip_ratio_c=clip_ratio_c,
        log_ratio_clamp=log_ratio_clamp,
    )
    peer_mask = token_mask & is_peer.unsqueeze(-1)  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Selected, not multiplied: non-finite log-probs off the peer tokens never reach the loss.
    shaped = luffy_shaping(torch.where(peer_mask, logp, zero), gamma)  # [B, T]
    shaped = shaped * torch.where(peer_mask, (advantages * weights).unsqueeze(-1), zero)
    peer_loss = -torch.where(peer_mask, shaped, zero).sum() / denominator
    with torch.no_grad():
        metrics["tokens"] = token_mask.sum().float()
        metrics["peer_tokens"] = peer_mask.sum().float()
        metrics["peer_clipped_tokens"] = torch.zeros(())
    return own_loss + peer_loss, metrics
