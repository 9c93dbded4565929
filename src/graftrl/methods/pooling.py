"""Naive pooling (algorithm.md §3): every model trains on the pooled group of all models, no corrections.

For every prompt, the groups of all K models (2n responses for a pair) form one pool; a single
GRPO advantage (eq. 1, ``train.adv_eps`` and ``train.adv_std_unbiased``) is computed over the
pool and shared by own and peer responses alike. Each model trains on the whole pool of every
prompt: its own group (behaviour log-probs) and each peer's group (re-tokenized, with the
receiver's old log-probs as the ratio's denominator, eq. 9). No corrections: no compatibility
gate or weight (w = 1), the standard token clip of eq. 2 for every row, token-mean over all
tokens of the minibatch, no balancing, no selection. Every prompt's pool trains in one optimizer
step (``order_minibatches``), ``train.minibatch_prompts`` prompts per step, so the number of
optimizer steps is GRPO's while each step holds K n responses per prompt.

algorithm.md §3 also names a GSPO variant of the pooled advantage's loss; this is the GRPO one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graftrl.core.pooling import pooled_advantages
from graftrl.methods.base import (
    ClippedSurrogate,
    ExchangePlan,
    GroupOutcomes,
    TrainGroup,
    WholePromptMinibatches,
    register_method,
)
from graftrl.methods.loss_metrics import PlanKey


@register_method("pooling")
class Pooling(WholePromptMinibatches, ClippedSurrogate):
    """K >= 1 models; each trains on every prompt's pooled group with one shared GRPO advantage.

    ``train.adv_eps`` and ``train.adv_std_unbiased`` (eq. 1, over the pool) come from the ``train``
    section."""

    plan_keys = (
        PlanKey("pooled_prompts", "prompts trained on as pooled groups of all policies (pooling)", "prompts"),
        PlanKey("pooled/<source>", "prompts on which <source>'s group joined the pool (pooling)", "prompts"),
        PlanKey("mixed_pools", "pools whose rewards are not all equal (pooling)", "prompts"),
        PlanKey("pool_rescued", "prompts with a uniform own group but a mixed pool (pooling)", "prompts"),
    )

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        models = list(outcomes)
        rewards = [outcomes[m].rewards for m in models]
        advantages = dict(
            zip(
                models,
                pooled_advantages(rewards, self.train.adv_eps, self.train.adv_std_unbiased),
                strict=True,
            )
        )
        pool = torch.cat([r.float() for r in rewards], dim=-1)  # [P, K n]
        mixed = ~(pool == pool[:, :1]).all(dim=-1)  # [P] pools with a learning signal
        plans: dict[str, ExchangePlan] = {}
        for receiver in models:
            rcv = outcomes[receiver]
            order = [receiver] + [m for m in models if m != receiver]
            groups = [
                TrainGroup(prompt=p, source=m, peer=m != receiver, advantages=advantages[m][p])
                for p in range(rcv.num_prompts)
                for m in order
            ]
            # Prompts where the receiver's own group had no signal but the pool has one.
            own_uniform = (rcv.rewards == rcv.rewards[:, :1]).all(dim=-1)
            diagnostics = {
                "pooled_prompts": float(rcv.num_prompts),
                "mixed_pools": float(mixed.sum()),
                "pool_rescued": float((own_uniform & mixed).sum()),
            }
            diagnostics.update({f"pooled/{m}": float(rcv.num_prompts) for m in order[1:]})
            plans[receiver] = ExchangePlan(groups=groups, diagnostics=diagnostics)
        return plans
