"""GRAFT with LUFFY-style peer updates (algorithm.md §2.4; paper Appendix G, "LUFFY-style peer updates").

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
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from graftrl.core.luffy import GAMMA, luffy_policy_loss
from graftrl.methods.base import (
    ConfigSection,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    Method,
    TrainSettings,
    register_method,
)
from graftrl.methods.graft import GRAFT, PLAN_KEYS, GraftConfig
from graftrl.methods.loss_metrics import CLIPPING, CLIPPING_BY_SIGN, KL, OWN_S


class LuffyConfig(ConfigSection):
    """LUFFY-style peer update settings (ignored by other methods)."""

    gamma: float = Field(default=GAMMA, gt=0)
    """Shaping f(x) = x / (x + gamma) of peer tokens' probability. Selection, balancing and peer
    position come from `graft.balance` and `graft.peer_position`."""


@register_method("luffy")
class LUFFY(Method):
    """GRAFT's selection with f(pi_theta) a on peer tokens instead of gate + clipped ratio.

    Its own section holds ``gamma``; ``balance`` and ``peer_position`` are GRAFT's (``graft``
    section, or keyword arguments here)."""

    section = LuffyConfig
    loss_metrics = (*CLIPPING, *CLIPPING_BY_SIGN, OWN_S, KL)  # peer tokens have no ratio (no s)
    allows_tis = False  # peer tokens have no ratio; own rows keep the rollout's behaviour log-probs
    needs_peer_old_logprobs = False  # f(pi_theta) only: no ratio to an old policy on peer tokens
    scores_peers = False  # no compatibility gate or weight
    plan_keys = PLAN_KEYS  # GRAFT's plan
    pairs_only = True
    options: LuffyConfig

    def __init__(
        self,
        options: LuffyConfig | None = None,
        /,
        *,
        graft: GraftConfig | None = None,
        train: TrainSettings | None = None,
        **fields: Any,
    ):
        graft_fields = {k: fields.pop(k) for k in list(fields) if k in GraftConfig.model_fields}
        super().__init__(options, train=train, **fields)
        self.graft = graft if graft is not None else GraftConfig(**graft_fields)

    @property
    def balance(self) -> bool:
        return self.graft.balance

    @property
    def peer_position(self) -> str:
        return self.graft.peer_position

    @classmethod
    def from_config(cls, config: Any) -> LUFFY:
        return cls(
            cls.options_of(config), graft=GRAFT.options_of(config), train=TrainSettings.of(config.train)
        )

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        return GRAFT(balance=self.balance, train=self.train).plan(outcomes, generator)

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        train = self.train
        loss, core = luffy_policy_loss(
            *batch.surrogate,
            batch.is_peer.bool(),
            train.eps_low,
            train.eps_high,
            self.options.gamma,
            normalizer=batch.normalizer,
            clip_ratio_c=train.clip_ratio_c,
            log_ratio_clamp=train.log_ratio_clamp,
        )
        metrics = self.loss_sums(core)

        def own_mask() -> Tensor:  # own rows that train: a zero weight drops a row from the KL too
            return batch.mask.bool() & ~batch.is_peer.bool().unsqueeze(-1) & (batch.weights > 0).unsqueeze(-1)

        return self.with_own_kl(loss, metrics, batch, own_mask), metrics
