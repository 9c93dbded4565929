"""SGT (Liu et al. 2026b): GRPO plus a supervised NLL term on one verified peer success (algorithm.md §3).

Which: whenever the receiver has no correct rollout on a prompt (k_R = 0) and the peer has at
least one (k_S >= 1, an all-correct peer group included), one of the peer's correct responses is
drawn uniformly (the step's ``generator``; direction A -> B first, then B -> A, prompts
ascending). Both directions, no balancing, no compatibility weight. ``selection: balanced`` is
"SGT + GRAFT which" (Appendix G): the draw is restricted to GRAFT's complementary, balanced
selection (eq. 4, m = min of the two directions, boundary ties).

How: the receiver keeps every own group with its own advantages (plain GRPO, the failed group
included: its advantages are 0), and the drawn responses become NLL groups
(``TrainGroup(peer=True, nll=True, keep=one-hot)``), re-tokenized by the receiver after its own
prompt template, response tokens as the trainer encodes them (the terminal EOS of a finished
response included, so the model also learns where to stop). Per minibatch the loss is

    L = -J_GRPO + lambda * (1 / N_nll) * sum_{NLL rows j} sum_t -log pi_theta(o^R_{j,t} | q, o^R_{j,<t})

with J_GRPO the token-mean clipped surrogate over the minibatch's surrogate tokens (algorithm.md eq. 2;
NLL rows are outside it: no old log-probs, weight 0), N_nll the minibatch's NLL token count
(``LossInputs.nll_normalizer``; ``sgt.nll_normalization: minibatch_tokens`` adds the surrogate
tokens to it) and lambda = ``sgt.nll_coef`` = 0.1. A minibatch without NLL
rows is exactly GRPO.

Where the NLL rows train (``sgt.peer_position``): "with_prompt" (default) puts each NLL group in
the optimizer step of its prompt's own group, so every step is GRPO + lambda NLL of its own
prompts, as SGT adds the term to the GRPO loss of the same batch, and the number of optimizer
steps is GRPO's. "last" / "first" / "uniform" order them like peer groups (GRAFT's
``minibatch_order``); there the NLL groups fill minibatches of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from graftrl.core import balanced_selection, nll_loss, pooled_minibatch_order
from graftrl.core.sgt import pick_one_success, sgt_eligible
from graftrl.methods.base import (
    ClippedSurrogate,
    ConfigSection,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    TrainGroup,
    own_groups,
    register_method,
)
from graftrl.methods.loss_metrics import LossMetric, PlanKey


class SGTConfig(ConfigSection):
    """SGT settings (ignored by other methods)."""

    nll_coef: float = Field(default=0.1, ge=0)
    """lambda: weight of the NLL term (token-mean over the minibatch's NLL responses)."""
    selection: Literal["all", "balanced"] = "all"
    """all: SGT's rule (receiver 0 successes, peer >= 1); balanced: GRAFT's complementary balanced
    selection ("SGT + GRAFT which")."""
    peer_position: Literal["with_prompt", "last", "first", "uniform"] = "with_prompt"
    """Optimizer step of each NLL response: its prompt's (with_prompt), or ordered like GRAFT's
    peer groups (last / first / uniform)."""
    nll_normalization: Literal["nll_tokens", "minibatch_tokens"] = "nll_tokens"
    """Denominator of the NLL term, which the paper leaves open: the minibatch's NLL tokens (a
    supervised token-mean, so lambda's scale does not depend on how many own tokens share the
    step; default), or all its tokens, surrogate and NLL (one token-mean over a mixed batch)."""


NLL = LossMetric(
    "nll",
    "nll_sum",
    "nll_tokens",
    "token-mean negative log-likelihood of the peer successes trained with SGT's NLL term (before "
    "`sgt.nll_coef`)",
    "nats",
)


@register_method("sgt")
class SGT(ClippedSurrogate):
    """GRPO on own groups + nll_coef * token-mean NLL of one drawn peer success per eligible prompt."""

    section = SGTConfig
    loss_metrics = (*ClippedSurrogate.loss_metrics, NLL)
    plan_keys = (
        PlanKey(
            "eligible/<source>", "prompts the policy failed entirely that <source> solved (SGT)", "prompts"
        ),
        PlanKey(
            "nll_responses/<source>",
            "correct <source> responses trained on with the NLL term (SGT)",
            "responses",
        ),
    )
    pairs_only = True
    options: SGTConfig

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        if len(outcomes) != 2:
            raise ValueError(f"SGT pairs exactly two policies, got {len(outcomes)}")
        (name_a, a), (name_b, b) = outcomes.items()
        if self.options.selection == "balanced":
            a_to_b, b_to_a = balanced_selection(a.successes, b.successes, a.n, balance=True)
        else:
            a_to_b, b_to_a = sgt_eligible(b.successes, a.successes), sgt_eligible(a.successes, b.successes)
        # [P, n] each; A -> B drawn first
        picked_a_to_b = pick_one_success(a.rewards, a_to_b, generator, a.success_threshold)
        picked_b_to_a = pick_one_success(b.rewards, b_to_a, generator, b.success_threshold)
        return {
            name_b: self._plan_for(name_b, name_a, b, a_to_b, picked_a_to_b),
            name_a: self._plan_for(name_a, name_b, a, b_to_a, picked_b_to_a),
        }

    @staticmethod
    def _plan_for(
        receiver: str, source: str, rcv: GroupOutcomes, eligible: Tensor, picked: Tensor
    ) -> ExchangePlan:
        nll = [
            TrainGroup(
                prompt=p,
                source=source,
                peer=True,
                advantages=torch.zeros(rcv.n),
                keep=picked[p].clone(),
                nll=True,
            )
            for p in picked.any(dim=-1).nonzero().flatten().tolist()
        ]
        diagnostics = {
            f"eligible/{source}": float(eligible.sum()),
            f"nll_responses/{source}": float(len(nll)),
        }
        return ExchangePlan(groups=own_groups(receiver, rcv) + nll, diagnostics=diagnostics)

    def order_minibatches(
        self, plan: ExchangePlan, prompts_per_minibatch: int, generator: torch.Generator
    ) -> list[Tensor]:
        """Group indices per optimizer step (the trainer's hook); see ``peer_position``."""
        if self.options.peer_position == "with_prompt":
            prompts = torch.tensor([g.prompt for g in plan.groups], dtype=torch.long)
            return pooled_minibatch_order(prompts, prompts_per_minibatch)
        return super().order_minibatches(plan, prompts_per_minibatch, generator)

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().loss(batch)  # NLL rows have weight 0: outside the surrogate
        if batch.is_nll is not None and bool(batch.is_nll.any()):
            nll_mask = batch.mask.bool() & batch.is_nll.bool().unsqueeze(-1)  # [B, T]
            tokens_only = self.options.nll_normalization == "nll_tokens"
            denominator = batch.nll_normalizer if tokens_only else batch.minibatch_tokens
            nll = nll_loss(batch.logp, nll_mask, normalizer=denominator)
            loss = loss + self.options.nll_coef * nll
            metrics["nll_sum"] = nll_loss(batch.logp.detach(), nll_mask, normalizer=1.0)
            metrics["nll_tokens"] = nll_mask.sum().float()
        return loss, metrics
