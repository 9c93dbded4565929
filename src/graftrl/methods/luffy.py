"""GRAFT with LUFFY-style peer updates (SPEC 2.4; paper Appendix G, "LUFFY-style peer updates").

Which prompts and groups: exactly GRAFT's defaults — complementary candidates (eq. 4), balanced
exchange (``graft.balance``), the receiver's failed group replaced by the whole source group with
source-computed advantages, peer groups last (``graft.peer_position``).

How peers are learned (Yan et al. 2025): every peer token contributes f(pi_theta(o_t | q, o_<t)) a
with f(x) = x / (x + gamma), gamma = ``luffy.gamma`` = 0.1: the behaviour probability of a peer
token is taken as 1 (no ratio to an old policy), there is no clip, and there is no compatibility
gate or weight (``peer_weights`` is 1). Own tokens use the standard clipped surrogate (eq. 2).
The loss is one token-mean over all tokens of the minibatch, own and peer (``normalizer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graftrl.core import k3_kl
from graftrl.core.luffy import luffy_policy_loss
from graftrl.methods.base import ClippedSurrogate, ExchangePlan, GroupOutcomes, LossInputs, register_method
from graftrl.methods.graft import GRAFT


@register_method("luffy")
@dataclass(frozen=True)
class LUFFY(ClippedSurrogate):
    """GRAFT's selection with f(pi_theta) a on peer tokens instead of gate + clipped ratio."""

    name: str = "luffy"
    gamma: float = 0.1
    """Shaping constant of f(x) = x / (x + gamma)."""
    balance: bool = True
    """GRAFT's balanced exchange (``graft.balance``)."""

    def __post_init__(self) -> None:
        if self.gamma <= 0:
            raise ValueError(f"luffy.gamma must be > 0, got {self.gamma}")

    @classmethod
    def from_config(cls, config: Any) -> LUFFY:
        if len(config.policies) != 2:
            raise ValueError(f"method 'luffy' pairs exactly two policies, got {len(config.policies)}")
        return cls(
            gamma=config.luffy.gamma,
            balance=config.graft.balance,
            peer_position=config.graft.peer_position,
        )

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        return GRAFT(balance=self.balance).plan(outcomes, generator)

    def peer_weights(self, s: Tensor, generator: torch.Generator) -> Tensor:
        return torch.ones_like(s)

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = luffy_policy_loss(
            batch.logp,
            batch.old_logp,
            batch.advantages,
            batch.weights,
            batch.mask,
            batch.is_peer.bool(),
            batch.eps_low,
            batch.eps_high,
            self.gamma,
            normalizer=batch.normalizer,
            clip_ratio_c=batch.clip_ratio_c,
            log_ratio_clamp=batch.log_ratio_clamp,
        )
        if batch.ref_logp is not None and batch.kl_coef > 0:
            own_mask = (
                batch.mask.bool() & ~batch.is_peer.bool().unsqueeze(-1) & (batch.weights > 0).unsqueeze(-1)
            )
            kl = k3_kl(batch.logp, batch.ref_logp, own_mask, normalizer=batch.normalizer)
            loss = loss + batch.kl_coef * kl
            metrics["kl"] = kl.detach()
        return loss, metrics
