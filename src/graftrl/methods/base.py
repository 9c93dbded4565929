"""The protocol every training method implements, and the registry that names them.

A method answers, in pure tensor terms, what each receiver trains on at a step: which groups
from which source with which advantages (``plan``), how much each transferred response counts
given its compatibility score (``peer_weights``), and the loss of a minibatch (``loss``). The
trainer does the model work around it (sampling, re-tokenizing, scoring, backward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from graftrl.core import clipped_policy_loss, compatibility_weight, k3_kl, pooled_minibatch_order


@dataclass(frozen=True)
class GroupOutcomes:
    """One model's rollout groups on the step's P prompts, as the method sees them."""

    rewards: Tensor
    """[P, n] verifier rewards."""
    advantages: Tensor
    """[P, n] the model's own GRPO advantages (eq. 1)."""

    @property
    def successes(self) -> Tensor:
        """[P] success count k per prompt."""
        return self.rewards.sum(dim=-1).round().long()

    @property
    def n(self) -> int:
        return self.rewards.shape[-1]

    @property
    def num_prompts(self) -> int:
        return self.rewards.shape[0]


@dataclass(frozen=True)
class TrainGroup:
    """One group of responses that a receiver trains on."""

    prompt: int
    """Index of the prompt in the step's batch."""
    source: str
    """Model whose sampled responses these are (the receiver itself for own groups)."""
    peer: bool
    """True for another model's responses (re-tokenized, re-scored, weighted by compatibility)."""
    advantages: Tensor
    """[n] advantage of each response as the receiver trains on it."""
    keep: Tensor | None = None
    """[n] bool: responses that enter the loss at all (None: every response)."""
    nll: bool = False
    """Train these responses with a supervised NLL term instead of the policy-gradient surrogate
    (SGT); they get no compatibility weight and no old log-probs."""


@dataclass
class ExchangePlan:
    """Everything one receiver trains on at one step."""

    groups: list[TrainGroup] = field(default_factory=list)
    """Own and peer groups; the trainer orders them into minibatches (peer position)."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    """Counts for the metrics log, keyed e.g. ``candidates/<source>``."""

    @property
    def peer_groups(self) -> list[TrainGroup]:
        return [g for g in self.groups if g.peer]


def own_groups(receiver: str, outcomes: GroupOutcomes, skip: Tensor | None = None) -> list[TrainGroup]:
    """The receiver's own groups with its own advantages, except the prompts in ``skip`` [P]."""
    return [
        TrainGroup(prompt=p, source=receiver, peer=False, advantages=outcomes.advantages[p])
        for p in range(outcomes.num_prompts)
        if skip is None or not bool(skip[p])
    ]


def replacement_plan(
    receiver: str, outcomes: Mapping[str, GroupOutcomes], incoming: Mapping[str, Tensor]
) -> ExchangePlan:
    """GRAFT's group replacement: the receiver's group at each incoming prompt is swapped for the
    source's whole group, every response keeping its source-computed advantage (SPEC 2.1).

    incoming: source name -> BoolTensor [P] of prompts whose group comes from that source.
    """
    replaced = torch.zeros(outcomes[receiver].num_prompts, dtype=torch.bool)
    peer: list[TrainGroup] = []
    for source, selected in incoming.items():
        replaced |= selected
        peer += [
            TrainGroup(prompt=p, source=source, peer=True, advantages=outcomes[source].advantages[p])
            for p in selected.nonzero().flatten().tolist()
        ]
    return ExchangePlan(groups=own_groups(receiver, outcomes[receiver], skip=replaced) + peer)


@dataclass
class LossInputs:
    """One micro-batch of rows, on the receiver's own tokenization. B rows, T response tokens."""

    logp: Tensor
    """[B, T] current policy log-probs (with grad)."""
    old_logp: Tensor
    """[B, T] receiver's old policy log-probs (behaviour log-probs for own rows)."""
    advantages: Tensor
    """[B]"""
    weights: Tensor
    """[B] 1 for own rows, w for peer rows; 0 removes a row."""
    mask: Tensor
    """[B, T] response tokens."""
    is_peer: Tensor
    """[B] bool."""
    normalizer: float
    """Token count of the whole minibatch's surrogate rows (token-mean denominator shared by its
    micro-batches); NLL rows are not counted."""
    eps_low: float
    eps_high: float
    is_nll: Tensor | None = None
    """[B] bool: rows of NLL groups (None: no such rows)."""
    nll_normalizer: float = 1.0
    """Token count of the minibatch's NLL rows."""
    sources: tuple[str, ...] = ()
    """[B] name of the model that sampled each row."""
    receiver: str = ""
    """Name of the policy being trained."""
    minibatch_index: int = 0
    """Position of this minibatch among the step's optimizer steps (0-based, across epochs)."""
    ref_logp: Tensor | None = None
    """[B, T] frozen reference policy log-probs when ``train.kl_coef`` > 0, else None."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy."""
    num_rows: int = 0
    """Row count of the whole minibatch's surrogate rows (sequence-mean denominator shared by its
    micro-batches; 0: not given, use this call's rows)."""
    source_mean_logp: Tensor | None = None
    """[B] lbar of each row's sampling policy on its own tokenization, terminal EOS excluded (the
    record's ``mean_logprob``: the source's behaviour mean for peer rows, the receiver's own for
    own rows); None when the trainer does not provide it."""
    finished: Tensor | None = None
    """[B] bool: the response ended with EOS, so its last response token is outside lbar's
    content tokens (SPEC 2.2); None when not provided."""
    token_weights: Tensor | None = None
    """[B, T] truncated importance-sampling weights for the rollout/trainer mismatch
    (``rollout.tis_cap``); None = no correction."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages (``train.clip_ratio_c``); None = off."""
    log_ratio_clamp: float | None = None
    """Clamp of log rho before exp (``train.log_ratio_clamp``); None = off."""


class Method(Protocol):
    """What the trainer asks of a method."""

    name: str
    """Registry name (the ``method:`` config value)."""
    peer_position: str
    """Where peer-containing minibatches go: last / first / uniform."""

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        """Receiver name -> what it trains on this step."""
        ...

    def peer_weights(self, s: Tensor, generator: torch.Generator) -> Tensor:
        """w [B] for one receiver's transferred responses at this step, given their scores s [B]."""
        ...

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss to minimise, detached metrics) of one micro-batch."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state kept across steps (saved in checkpoints); {} for stateless methods."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class ClippedSurrogate:
    """Shared defaults: the DAPO/GRAFT clipped surrogate (eq. 10) and the gate-and-cap weight (eq. 8)."""

    delta: float = 0.8
    """Compatibility floor: a transferred response with s <= delta is removed."""
    peer_position: str = "last"
    """Where minibatches holding peer groups go in the receiver's update."""

    def peer_weights(self, s: Tensor, generator: torch.Generator) -> Tensor:
        return compatibility_weight(s, self.delta)

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = clipped_policy_loss(
            batch.logp,
            batch.old_logp,
            batch.advantages,
            batch.weights,
            batch.mask,
            batch.eps_low,
            batch.eps_high,
            normalizer=batch.normalizer,
            is_peer=batch.is_peer,
            token_weights=batch.token_weights,
            clip_ratio_c=batch.clip_ratio_c,
            log_ratio_clamp=batch.log_ratio_clamp,
        )
        if batch.ref_logp is not None and batch.kl_coef > 0:
            own_mask = batch.mask & ~batch.is_peer.unsqueeze(-1)
            kl = k3_kl(batch.logp, batch.ref_logp, own_mask, normalizer=batch.normalizer)
            loss = loss + batch.kl_coef * kl
            metrics["kl"] = kl.detach()
        return loss, metrics

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")


class WholePromptMinibatches:
    """Mixin for pooled methods: each optimizer step holds whole prompts (own + peer groups).

    The trainer uses ``order_minibatches`` when a method defines it, instead of peer-last order.
    """

    def order_minibatches(
        self, plan: ExchangePlan, prompts_per_minibatch: int, generator: torch.Generator
    ) -> list[Tensor]:
        prompts = torch.tensor([g.prompt for g in plan.groups], dtype=torch.long)
        return pooled_minibatch_order(prompts, prompts_per_minibatch)


METHODS: dict[str, Callable[..., Method]] = {}


def register_method(name: str) -> Callable[[Callable[..., Method]], Callable[..., Method]]:
    """Class decorator: make a method selectable as ``method: <name>``."""

    def decorator(factory: Callable[..., Method]) -> Callable[..., Method]:
        if name in METHODS:
            raise ValueError(f"method {name!r} is registered twice")
        METHODS[name] = factory
        return factory

    return decorator


def build_method(name: str, config: Any | None = None, **options: Any) -> Method:
    """Instantiate a registered method by name, with a clear error for unknown names.

    With a run ``config``, the method reads its own section (e.g. ``config.graft``) through its
    ``from_config`` classmethod; otherwise ``options`` go to its constructor.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    factory = METHODS[name]
    if config is not None and hasattr(factory, "from_config"):
        return factory.from_config(config)  # type: ignore[attr-defined]
    return factory(**options)
