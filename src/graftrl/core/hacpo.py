"""HACPO's pure tensor pieces (algorithm.md §3, HACPO bullet; review arXiv 2603.02604).

K agents, P prompts, n rollouts per prompt per agent, B rows, T response tokens.

- capability ratios omega^(k,j) = clip(P_hat^(k) / P_hat^(j), 0.1, 10);
- the capability-aware advantage of learner k over the pooled group of K*n responses;
- the own-response GSPO sequence term and the peer term c * sg(c)^alpha * omega^(j,k) * A with
  the stepwise lower clip bound;
- the pooled minibatch order (every group of a prompt in the same optimizer step).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED
from graftrl.core.compatibility import mean_token_logprob

OMEGA_MIN = 0.1
OMEGA_MAX = 10.0
"""Clip range of the capability ratio omega (the defaults of `hacpo.omega_min` / `omega_max`)."""
OWN_CLIP_LOW = 3e-4
OWN_CLIP_HIGH = 4e-4
"""GSPO clip range of own responses' sequence ratio (`hacpo.own_clip_low` / `own_clip_high`)."""
CLIP_LOWER = 0.8
CLIP_STEP = 0.025
"""Stepwise peer clip lower_m = min(1, 0.8 + 0.025 m) of docs/algorithm.md (`hacpo.clip_lower` / `clip_step`)."""
ALPHA = 1.0
"""Exponent of the peer reweighting sg(c)^alpha (`hacpo.alpha`)."""
MAX_LOG_RATIO = 10.0
"""Own GSPO log-ratio cap before exp (verl's GSPO clamps at 10 too): keeps exp finite, never binds
in practice since the clip range is 1 +- 4e-4."""

ExpRatio = Literal["clipped", "raw"]


def capability_ratios(p_hat: Tensor, low: float = OMEGA_MIN, high: float = OMEGA_MAX) -> Tensor:
    """omega[k, j] = clip(P_hat[k] / P_hat[j], low, high) for capabilities P_hat [K] -> [K, K].

    Where the ratio is undefined the agents are taken as equally capable: 0 / 0 and any unknown
    capability (NaN, e.g. an empty window) give omega = 1. Otherwise the clip decides: x / 0
    (x > 0) gives ``high``, 0 / x gives ``low``. The diagonal is 1.
    """
    p = p_hat.double()
    num, den = p.unsqueeze(1), p.unsqueeze(0)
    ratio = torch.where(den > 0, num / den.clamp(min=torch.finfo(p.dtype).tiny), num * math.inf)
    undefined = torch.isnan(num) | torch.isnan(den) | ((num == 0) & (den == 0))
    omega = torch.where(undefined, torch.ones_like(ratio), ratio.nan_to_num(nan=1.0).clamp(low, high))
    return omega.float()


def capability_baseline(rewards: Tensor, omega_row: Tensor, learner: int) -> tuple[Tensor, Tensor]:
    """mu^(k) per prompt for learner k = ``learner``, and where it fell back to its own mean.

    rewards: [K, P, n] every agent's rewards (agent-major); omega_row: [K] omega^(k, j) for each
    source j. mu^(k) = mean over the pooled K*n responses of omega^(k,j) r_i^(j); uniform-reward
    pooled groups use the plain mean; where mu^(k) > 1 it falls back to the learner's own group
    mean. Returns (mu [P], fell_back [P] bool).
    """
    rewards = rewards.float()
    k, p, n = rewards.shape
    pooled = rewards.permute(1, 0, 2).reshape(p, k * n)  # [P, K*n], sources in agent order
    weights = omega_row.float().to(rewards.device).repeat_interleave(n)  # [K*n]
    mu = (pooled * weights).mean(dim=-1)
    uniform = (pooled == pooled[:, :1]).all(dim=-1)
    mu = torch.where(uniform, pooled.mean(dim=-1), mu)
    fell_back = (mu > 1.0) & ~uniform
    mu = torch.where(fell_back, rewards[learner].mean(dim=-1), mu)
    return mu, fell_back


def hacpo_advantages(
    rewards: Tensor, omega_row: Tensor, learner: int, eps: float = ADV_EPS, unbiased: bool = ADV_STD_UNBIASED
) -> Tensor:
    """Capability-aware advantages A^(k) of every pooled response, for learner k = ``learner``.

    rewards: [K, P, n]; omega_row: [K] = omega^(k, j). A = (r - mu^(k)) / (std_joint + eps) with
    std_joint the std of the pooled K*n rewards (unbiased unless ``unbiased`` is False, as eq. 1);
    the same A serves own and peer responses. Uniform pooled groups get exactly 0.
    Returns [K, P, n] (learner k's advantage of agent j's response i on prompt p at [j, p, i]).
    """
    rewards = rewards.float()
    k, p, n = rewards.shape
    mu, _ = capability_baseline(rewards, omega_row, learner)
    pooled = rewards.permute(1, 0, 2).reshape(p, k * n)
    std = pooled.std(dim=-1, correction=1 if unbiased else 0)
    advantages = (rewards - mu.view(1, p, 1)) / (std.view(1, p, 1) + eps)
    uniform = (pooled == pooled[:, :1]).all(dim=-1).view(1, p, 1)
    return torch.where(uniform, torch.zeros_like(advantages), advantages)


def stepwise_lower_bound(minibatch_index: int, start: float = CLIP_LOWER, step: float = CLIP_STEP) -> float:
    """lower_m = min(1, start + step * m) for optimizer step m (0-based) within the rollout step."""
    return min(1.0, start + step * minibatch_index)


def content_mask(mask: Tensor, finished: Tensor) -> Tensor:
    """The response mask [B, T] without the terminal EOS of finished rows [B] (lbar's tokens).

    Response masks are right-padded (a row's tokens are its first ``mask.sum()`` positions).
    """
    mask = mask.bool()
    lengths = mask.sum(dim=-1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    eos = torch.zeros_like(mask)
    eos[rows, (lengths - 1).clamp(min=0)] = finished.to(mask.device).bool() & (lengths > 0)
    return mask & ~eos


def gspo_own_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = OWN_CLIP_LOW,
    clip_high: float = OWN_CLIP_HIGH,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO on own responses: s = exp(mean_t log rho_t), term = min(s A, clip(s, 1-lo, 1+hi) A).

    logp (with grad), old_logp: [B, T] on the receiver's tokens; advantages: [B]; mask: [B, T]
    (all response tokens, EOS included). Returns (term [B] to maximise, s [B] detached,
    clipped [B] bool: A > 0 with s > 1 + hi or A < 0 with s < 1 - lo).
    """
    # mean over tokens of log rho = lbar(new) - lbar(old): eq. 6's per-row mean over the mask
    log_s = mean_token_logprob(logp - old_logp, mask).clamp(max=MAX_LOG_RATIO)
    s = torch.exp(log_s)
    adv = advantages.to(s.dtype)
    term = torch.minimum(s * adv, s.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    with torch.no_grad():
        clipped = ((adv > 0) & (s > 1.0 + clip_high)) | ((adv < 0) & (s < 1.0 - clip_low))
    return term, s.detach(), clipped


def hacpo_peer_terms(
    logp: Tensor,
    source_mean_logp: Tensor,
    advantages: Tensor,
    omega: Tensor,
    mask: Tensor,
    lower: float,
    alpha: float = ALPHA,
    exp_ratio: ExpRatio = "clipped",
) -> tuple[Tensor, Tensor, Tensor]:
    """HACPO on peer responses: term = c * sg(c)^alpha * omega^(j,k) * A.

    s = exp(lbar(pi_theta^k, y^k) - lbar(pi_old^j, y^j)): the current receiver's mean token
    log-prob over ``mask`` (its own tokenization, content tokens) against the source's behaviour
    mean ``source_mean_logp`` [B]; c = clip(s, lower, 1) (gradient only inside the bounds).
    ``exp_ratio`` "clipped" (algorithm.md) uses sg(c)^alpha; "raw" (the review's eqs. 12 and 53) uses
    sg(min(s, 1))^alpha, the unclipped ratio below 1.
    omega: [B] omega^(j,k) = P_hat^(j) / P_hat^(k) (clipped) of each row's source j.
    Returns (term [B] to maximise, s [B] detached, clipped [B] bool: s outside [lower, 1]).
    """
    log_s = mean_token_logprob(logp, mask) - source_mean_logp.to(logp.dtype)
    log_lower = math.log(lower) if lower > 0 else -math.inf
    # clip in log space: exp(clamp(log s)) == clamp(s) with the same gradient, and never overflows.
    c = torch.exp(log_s.clamp(min=log_lower, max=0.0))
    base = c if exp_ratio == "clipped" else torch.exp(log_s.clamp(max=0.0))
    term = c * base.detach().pow(alpha) * omega.to(c.dtype) * advantages.to(c.dtype)
    with torch.no_grad():
        clipped = (log_s < log_lower) | (log_s > 0.0)
    return term, torch.exp(log_s.detach()), clipped


def pooled_minibatch_order(prompts: Tensor, prompts_per_minibatch: int) -> list[Tensor]:
    """Group indices for each optimizer step, every group of a prompt in the same step.

    prompts: LongTensor [G] the prompt of each planned group. Prompts go in ascending order,
    ``prompts_per_minibatch`` per step; within a step the groups keep their plan order.
    """
    if prompts_per_minibatch < 1:
        raise ValueError(f"prompts_per_minibatch must be >= 1, got {prompts_per_minibatch}")
    unique = torch.unique(prompts, sorted=True)
    chunks = torch.split(unique, prompts_per_minibatch)
    return [torch.isin(prompts, chunk).nonzero().flatten() for chunk in chunks]
