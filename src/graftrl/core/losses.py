"""The clipped surrogate every method trains with (algorithm.md eqs. 2, 3, 9, 10).

Masked positions (padding, removed rows) are *selected out* with ``torch.where`` before any
arithmetic, never multiplied by 0: a NaN or inf in a padded log-prob then reaches neither the loss
nor its gradient (NaN * 0 is NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS_LOW = 0.2
EPS_HIGH = 0.28
"""DAPO's clip range of the token ratio, [1 - 0.2, 1 + 0.28] (`train.eps_low` / `train.eps_high`)."""


def clipped_token_mask(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Tokens where the clipped surrogate is strictly below the unclipped one (algorithm.md §5).

    ratio: [B, T]; advantages: [B] or [B, T]. Returns BoolTensor [B, T]:
    a > 0 with rho > 1 + eps_high, or a < 0 with rho < 1 - eps_low.
    """
    adv = advantages if advantages.dim() == ratio.dim() else advantages.unsqueeze(-1)
    return ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    mask: Tensor,
    eps_low: float = EPS_LOW,
    eps_high: float = EPS_HIGH,
    *,
    normalizer: float | Tensor | None = None,
    is_peer: Tensor | None = None,
    token_weights: Tensor | None = None,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Return (-J, metrics) with J of eq. 10 — GRPO's DAPO objective when every weight is 1.

    logp, old_logp: [B, T] per-token log-probs under the current and the receiver's old policy on
    the receiver's own tokenization; advantages, weights: [B]; mask: [B, T] response tokens.
    J = 1/sum_j |o_j| * sum_j w_j sum_t min(rho a, clip(rho, 1-eps_low, 1+eps_high) a).
    Rows with weight 0 are removed responses: they count in neither numerator nor denominator.
    ``normalizer`` replaces the token count of this call, so micro-batches of one minibatch can
    share the minibatch's denominator. ``is_peer`` [B] splits the clip metrics own vs peer.
    ``token_weights`` [B, T] (detached) multiply each token's term: truncated importance sampling
    (``truncated_is_weights``); None = 1.
    ``clip_ratio_c`` (> 1): dual clip for negative advantages, each token's term is at least
    c * a, so an exploding ratio on a bad token cannot dominate (verl's default 3.0; None = off,
    docs/algorithm.md's eq. 10). ``log_ratio_clamp``: log rho is clamped to [-x, x] before exp (None = off).
    Masked tokens are selected out before any arithmetic, so non-finite padding never matters.
    Metrics are detached counts and sums (add them across calls) plus this call's fractions; with
    ``is_peer``, also per side the rows with kept tokens and the sum of their sequence ratios
    s_j = exp(mean_t log rho_{j,t}) (how far the update has moved each row from the old policy).
    """
    kept_rows = weights > 0
    token_mask = mask.bool() & kept_rows.unsqueeze(-1)  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(token_mask, logp - old_logp, zero)  # [B, T], 0 (ratio 1) off the mask
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = torch.where(kept_rows, advantages, zero).unsqueeze(-1)  # [B, 1]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)  # [B, T]
    if clip_ratio_c is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, clip_ratio_c * adv), surrogate)
    weighted = surrogate * torch.where(kept_rows, weights, zero).unsqueeze(-1)
    if token_weights is not None:
        weighted = weighted * torch.where(token_mask, token_weights, zero)
    weighted = torch.where(token_mask, weighted, zero)
    token_count = token_mask.sum()
    denominator = token_count.clamp(min=1) if normalizer is None else normalizer
    loss = -weighted.sum() / denominator

    with torch.no_grad():
        clipped = clipped_token_mask(ratio, advantages, eps_low, eps_high) & token_mask
        metrics: dict[str, Tensor] = {
            "tokens": token_count.float(),
            "clipped_tokens": clipped.sum().float(),
            "clip_fraction": clipped.sum().float() / token_count.clamp(min=1),
            "ratio_mean": torch.where(token_mask, ratio, zero).sum() / token_count.clamp(min=1),
        }
        if is_peer is not None:
            peer_tokens = token_mask & is_peer.unsqueeze(-1)
            own_tokens = token_mask & ~is_peer.unsqueeze(-1)
            metrics["peer_tokens"] = peer_tokens.sum().float()
            metrics["peer_clipped_tokens"] = (clipped & peer_tokens).sum().float()
            # By the advantage's sign: clipping a > 0 stops a push up, a < 0 a push down (§5).
            positive, negative = (advantages > 0).unsqueeze(-1), (advantages < 0).unsqueeze(-1)
            metrics["peer_pos_clipped_tokens"] = (clipped & peer_tokens & positive).sum().float()
            metrics["peer_neg_clipped_tokens"] = (clipped & peer_tokens & negative).sum().float()
            metrics["own_tokens"] = own_tokens.sum().float()
            metrics["own_clipped_tokens"] = (clipped & own_tokens).sum().float()
            row_tokens = token_mask.sum(dim=-1)  # [B]
            s = torch.exp(log_ratio.sum(dim=-1) / row_tokens.clamp(min=1))  # [B]
            for side, rows in (("own", ~is_peer.bool()), ("peer", is_peer.bool())):
                trained = rows & (row_tokens > 0)  # [B]
                metrics[f"{side}_rows"] = trained.sum().float()
                metrics[f"{side}_s_sum"] = torch.where(trained, s, zero).sum()
    return loss, metrics


def truncated_is_weights(trainer_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS): min(pi_trainer / pi_rollout, cap) per token.

    trainer_logp, rollout_logp: [B, T] log-probs of the sampled tokens under the trainer's old
    policy and under the rollout engine that sampled them (the same weights, different kernels).
    Returns [B, T], detached: the correction reweights the gradient, it is not differentiated.
    """
    return torch.exp(trainer_logp - rollout_logp).clamp(max=cap).detach()


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Low-variance KL(pi || pi_ref) estimator k3 = exp(d) - d - 1 with d = log pi_ref - log pi.

    logp, ref_logp, mask: [B, T] (``mask`` bool, or non-negative per-token weights). Token-mean
    over ``mask`` (or sum / ``normalizer``). k3 >= 0 and
    is unbiased for KL under samples from pi (Schulman's k3, as in GRPO).
    """
    weights = mask.to(logp.dtype)  # a bool mask, or per-token weights (HACPO's 1 / length)
    selected = weights != 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    d = torch.where(selected, ref_logp - logp, zero).clamp(-20.0, 20.0)
    per_token = torch.where(selected, _k3(d) * weights, zero)
    denominator = weights.sum().clamp(min=1) if normalizer is None else normalizer
    return per_token.sum() / denominator


def _k3(d: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 of d = log pi_ref - log pi (clamped by the caller)."""
    return torch.exp(d) - d - 1.0


def k3_sums(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of k3 over the tokens of ``mask``, their count), detached: the sums of a token-mean KL
    estimate that add up exactly across micro-batches. logp, ref_logp, mask (bool): [B, T]."""
    with torch.no_grad():
        selected = mask.bool()
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        d = torch.where(selected, ref_logp - logp, zero).clamp(-20.0, 20.0)
        return torch.where(selected, _k3(d), zero).sum(), selected.sum().float()


def nll_loss(logp: Tensor, mask: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Token-mean negative log-likelihood of the masked tokens. logp, mask: [B, T]."""
    mask = mask.bool()
    denominator = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return -torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum() / denominator
