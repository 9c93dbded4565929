"""GRAFT: gated replacement of answer-failed groups with peer trajectories (algorithm.md §2).

The paper's method is the default of every switch below; each switch is one ``graft:`` config
field (algorithm.md §2.4, paper Table 2 and Appendix G):

- ``delta`` (0.8): compatibility floor of eq. 8; the threshold sweep is 0 / 0.7 / 0.8 / 0.9, and
  ``delta: 0`` is "no floor" (w = min(s, 1)).
- ``gate`` (true): false is "w/o compatibility gate", w = 1 for every transferred response (no
  floor, no weighting).
- ``balance`` (true): false selects every candidate in each direction ("w/o balanced exchange").
  This is also "SGT + GRAFT how" (Appendix G: SGT's unbalanced eligibility with GRAFT's update;
  the paper reports it as GRAFT without balancing, so all-correct source groups, whose source
  advantages are all 0, stay out as in eq. 4).
- ``ratio_level`` (token): "sequence" replaces the token ratio of *grafted* rows by the row's
  geometric-mean ratio s_j = exp(mean_t log rho_{j,t}) applied to every token of the row, clipped
  with the same (eps_low, eps_high). The paper leaves open whether the sequence term is then
  averaged per token or per sequence; we keep eq. 10's token-mean (a row still weighs |o_j|), so
  the switch changes only the ratio. Own rows keep token ratios.
- ``selection`` (complementary): "random_prompts" transfers, per direction, as many prompts as
  GRAFT's selection would (ties included), drawn uniformly from the whole batch regardless of
  rewards (``generator``); the receiver's group there is replaced (or pooled) as usual and the
  compatibility weight still applies.
- ``admission`` (gate): "random" keeps GRAFT's prompts, counts the responses the gate would admit
  (s > delta) and admits that many uniformly at random among all transferred responses of the
  receiver at this step, with w = min(s, 1) and no floor (eq. 11). Needs ``gate: true``.
- ``peer_position`` (last): first / uniform.
- ``groups`` (replace): "pooled" keeps the receiver's failed group as well (eq. 12): advantages
  over the concatenation of the receiver's and the peer's group (mean k_S / (2n) when k_R = 0, so
  the receiver's failures go negative); peer rows keep w, receiver rows w = 1, every retained
  token in the denominator. The receiver's group stays an own group (behaviour log-probs), the
  peer group trains last as usual.
- ``transfer`` (all): "success_only" lets only the reward-1 peer responses enter (numerator and
  denominator, via ``TrainGroup.keep``), with the advantages of the full source group.

"SGT + GRAFT which" is the ``sgt`` method with ``sgt.selection: balanced``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from graftrl.core import (
    balanced_selection,
    compatibility_score,
    compatibility_weight,
    multi_source_selection,
    transfer_candidates,
)
from graftrl.core.ablations import (
    random_admission_weight,
    random_prompt_selection,
    sequence_ratio_logp,
    success_only_keep,
)
from graftrl.core.compatibility import DELTA
from graftrl.core.pooling import pooled_advantages
from graftrl.methods.base import (
    ClippedSurrogate,
    ConfigSection,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    PeerLikelihoods,
    TrainGroup,
    TrainSettings,
    register_method,
)
from graftrl.methods.loss_metrics import PlanKey


class GraftConfig(ConfigSection):
    """GRAFT switches (luffy reads `balance` and `peer_position`; ignored by other methods)."""

    delta: float = Field(default=DELTA, ge=0, le=1)
    """Compatibility floor in [0, 1]: a transferred response with s <= delta is removed (eq. 8);
    weights are min(s, 1), so delta >= 1 would admit nothing."""
    balance: bool = True
    """Balanced exchange: m = min(|C_AB|, |C_BA|) with boundary ties; False moves every candidate."""
    peer_position: Literal["last", "first", "uniform"] = "last"
    """Where minibatches containing peer groups go in the receiver's update."""
    gate: bool = True
    """Compatibility weighting (eq. 8); false: w = 1 for every transferred response (no floor, no
    weighting; ablation "w/o compatibility gate")."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio of grafted responses: per token (eq. 9), or the row's geometric mean
    exp(mean_t log rho) applied to all its tokens, same clip range, still token-mean (algorithm.md §2.4)."""
    selection: Literal["complementary", "random_prompts"] = "complementary"
    """Which prompts transfer: GRAFT's (eq. 4 + balancing), or per direction as many prompts drawn
    uniformly from the whole batch regardless of rewards (compatibility weighting still applies)."""
    admission: Literal["gate", "random"] = "gate"
    """Which transferred responses enter: the gate (eq. 8), or as many as it would admit (s > delta)
    drawn uniformly among them with w = min(s, 1) and no floor (eq. 11). Random needs `gate: true`."""
    groups: Literal["replace", "pooled"] = "replace"
    """Replace the receiver's failed group by the peer group, or keep both with advantages over
    their concatenation (eq. 12; receiver rows w = 1, peer rows keep w)."""
    compat_normalization: Literal["token", "byte"] = "token"
    """How the compatibility score normalises log-likelihoods: per token of each model's own
    tokenization (eq. 7, the paper's), or per UTF-8 byte of the response string — s is then the
    per-byte geometric mean of the string-level likelihood ratio, comparable across tokenizers."""
    transfer: Literal["all", "success_only"] = "all"
    """Transfer every response of a selected peer group, or only its successes (advantages still
    from the full source group). "SGT + GRAFT how" is `balance: false` with the defaults."""

    @model_validator(mode="after")
    def _check_admission(self) -> GraftConfig:
        if self.admission == "random" and not self.gate:
            raise ValueError("admission: 'random' counts the gate's admissions, so it needs gate: true")
        return self


PLAN_KEYS = (
    PlanKey(
        "candidates/<source>",
        "prompts the policy failed entirely on which <source>'s group is mixed (GRAFT eq. 4)",
        "prompts",
    ),
    PlanKey("selected/<source>", "candidates selected for transfer from <source> (GRAFT eq. 5)", "prompts"),
    PlanKey(
        "transferred/<source>", "responses of <source> planned into the policy's batch (GRAFT)", "responses"
    ),
)
"""GRAFT's plan diagnostics (also LUFFY's, which plans as GRAFT)."""


@register_method("graft")
class GRAFT(ClippedSurrogate):
    """Peers exchange whole groups where the receiver failed all n (eq. 4).

    Two models follow the paper exactly; K > 2 models use ``multi_source_selection`` (each
    receiver takes its best eligible source's group, balanced per pair of models).

    Selection is balanced across the two directions; each transferred response keeps its source
    advantage and is weighted by w = 1[s > delta] min(s, 1) (eq. 8); peer groups train last.
    The ablation switches (``GraftConfig``) are described in the module docstring.
    ``train.adv_eps`` and ``train.adv_std_unbiased`` (eq. 1) serve pooled groups.
    """

    section = GraftConfig
    trains_on_stored_peers = True
    plan_keys = PLAN_KEYS
    options: GraftConfig

    @classmethod
    def from_config(cls, config: Any) -> GRAFT:
        options = cls.options_of(config)
        if config.peers:  # transfer from a stored peer is one-way: nothing to balance (algorithm.md §2.3)
            options = options.model_copy(update={"balance": False})
        return cls(options, train=TrainSettings.of(config.train))

    @classmethod
    def check(cls, config: Any) -> None:
        super().check(config)
        if len(config.policies) + len(config.peers) < 2:
            raise ValueError(
                f"method {cls.name!r} needs at least two models: add a policy to `policies` or a stored "
                "or served peer to `peers`"
            )

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        names = self.models_of(
            outcomes, "GRAFT needs at least two models (policies or stored peers), got {names}"
        )
        if len(names) == 2:
            (name_a, a), (name_b, b) = outcomes.items()
            a_to_b, b_to_a = balanced_selection(a.successes, b.successes, a.n, balance=self.options.balance)
            if self.options.selection == "random_prompts":  # count-matched, per direction, A->B drawn first
                a_to_b = random_prompt_selection(int(a_to_b.sum()), a.num_prompts, generator)
                b_to_a = random_prompt_selection(int(b_to_a.sum()), b.num_prompts, generator)
            return {
                name_b: self._plan_for(name_b, outcomes, {name_a: a_to_b}),
                name_a: self._plan_for(name_a, outcomes, {name_b: b_to_a}),
            }
        if self.options.selection != "complementary":
            raise ValueError("graft.selection 'random_prompts' is defined for two models only")
        # K > 2: each receiver takes the group of its best eligible source, balanced per pair.
        successes = torch.stack([outcomes[name].successes for name in names])  # [K, P]
        source_index = multi_source_selection(successes, outcomes[names[0]].n, self.options.balance)  # [K, P]
        return {
            receiver: self._plan_for(
                receiver, outcomes, {source: source_index[r] == j for j, source in enumerate(names) if j != r}
            )
            for r, receiver in enumerate(names)
        }

    def _plan_for(
        self, receiver: str, outcomes: Mapping[str, GroupOutcomes], incoming: Mapping[str, Tensor]
    ) -> ExchangePlan:
        """Own groups (prompt order), then each source's groups on its ``incoming`` [P] prompts."""
        rcv = outcomes[receiver]
        pooled = self.options.groups == "pooled"
        selected = torch.zeros(rcv.num_prompts, dtype=torch.bool)
        own_advantages = rcv.advantages.clone()
        peer_groups: list[TrainGroup] = []
        diagnostics: dict[str, float] = {}
        for source, chosen in incoming.items():
            src = outcomes[source]
            selected |= chosen
            if pooled:
                rcv_adv, src_adv = pooled_advantages(
                    [rcv.rewards, src.rewards], self.train.adv_eps, self.train.adv_std_unbiased
                )
                own_advantages[chosen] = rcv_adv[chosen]
            else:
                src_adv = src.advantages
            keep = (
                success_only_keep(src.rewards, src.success_threshold)
                if self.options.transfer == "success_only"
                else None
            )  # [P, n]
            prompts = chosen.nonzero().flatten().tolist()
            peer_groups += [
                TrainGroup(
                    prompt=p,
                    source=source,
                    peer=True,
                    advantages=src_adv[p],
                    keep=None if keep is None else keep[p],
                )
                for p in prompts
            ]
            transferred = sum(src.n if keep is None else int(keep[p].sum()) for p in prompts)
            candidates = transfer_candidates(rcv.successes, src.successes, src.n)
            diagnostics[f"candidates/{source}"] = float(candidates.sum())
            diagnostics[f"selected/{source}"] = float(chosen.sum())
            diagnostics[f"transferred/{source}"] = float(transferred)
        # Unselected prompts keep the receiver's own group; selected ones drop it (replace) or keep
        # it with pooled advantages (eq. 12).
        groups = [
            TrainGroup(prompt=p, source=receiver, peer=False, advantages=own_advantages[p])
            for p in range(rcv.num_prompts)
            if pooled or not bool(selected[p])
        ]
        return ExchangePlan(groups=groups + peer_groups, diagnostics=diagnostics)

    def compatibility(self, peers: PeerLikelihoods) -> Tensor:
        if self.options.compat_normalization == "byte":
            # Total log-likelihood of the same string under each model, per UTF-8 byte.
            receiver = peers.receiver_mean_logp * peers.receiver_tokens / peers.num_bytes
            source = peers.source_mean_logp * peers.source_tokens / peers.num_bytes
            return compatibility_score(receiver, source)
        return super().compatibility(peers)

    def peer_weights(self, s: Tensor, generator: torch.Generator) -> Tensor:
        if not self.options.gate:
            return torch.ones_like(s)
        if self.options.admission == "random":
            return random_admission_weight(s, self.options.delta, generator)
        return compatibility_weight(s, self.options.delta)

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        if self.options.ratio_level == "sequence":
            rows = batch.is_peer.bool() & (batch.weights > 0)
            batch = replace(batch, logp=sequence_ratio_logp(batch.logp, batch.old_logp, batch.mask, rows))
        return super().loss(batch)
