"""The protocol every training method implements, and the registry that names them.

A method answers, in pure tensor terms, what each receiver trains on at a step: which groups
from which source with which advantages (``plan``), how compatible each transferred response is
(``compatibility``) and how much it counts (``peer_weights``), in which order the groups train
(``order_minibatches``), and the loss of a minibatch (``loss``). It also owns its config section
(``section``, declared once in its module, validated by pydantic) and its rules across sections
(``check``). The trainer does the model work around it (sampling, re-tokenizing, scoring,
backward) and never names a method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from graftrl.core import (
    clipped_policy_loss,
    compatibility_score,
    k3_kl,
    k3_sums,
    minibatch_order,
    pooled_minibatch_order,
)
from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED, SUCCESS_THRESHOLD, is_success
from graftrl.core.losses import EPS_HIGH, EPS_LOW
from graftrl.methods.loss_metrics import CLIPPING, CLIPPING_BY_SIGN, KL, OWN_S, PEER_S, LossMetric, PlanKey

M = TypeVar("M", bound="Method")


@dataclass(frozen=True)
class GroupOutcomes:
    """One model's rollout groups on the step's P prompts, as the method sees them."""

    rewards: Tensor
    """[P, n] verifier rewards."""
    advantages: Tensor
    """[P, n] the model's own GRPO advantages (eq. 1)."""
    success_threshold: float = SUCCESS_THRESHOLD
    """A reward at or above it is a success (``reward.success_threshold``; ``core.is_success``)."""

    @property
    def successes(self) -> Tensor:
        """[P] success count k per prompt: the rewards at or above ``success_threshold``."""
        return is_success(self.rewards, self.success_threshold).sum(dim=-1)

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


@dataclass(frozen=True)
class RescueTarget:
    """One all-fail prompt of a receiver that a peer's success can rescue (``RescuePhase``)."""

    prompt: int
    """Index of the prompt in the step's batch."""
    source: str
    """The peer whose successful response the hint is built from."""
    response: int
    """Index of that response in the peer's group."""


@runtime_checkable
class RescuePhase(Protocol):
    """A method that adds a rescue round between rollout and plan (``graftrl.training.rescue``;
    ``hint``, CoRe; algorithm.md §3.1). The trainer runs the round for a method that implements
    this protocol: each receiver samples its all-fail prompts a peer solved again, with a hint
    from the peer's successful response in the prompt."""

    options: Any
    """The method's section; the round reads its hint template settings."""

    def rescue_targets(
        self, receiver: str, outcomes: Mapping[str, GroupOutcomes], records: Mapping[str, Sequence[Any]]
    ) -> list[RescueTarget]:
        """The receiver's rescued prompts this step, from every other model's groups."""
        ...

    def hint_for(self, response: str) -> str:
        """The hint a peer's successful response gives."""
        ...

    def rescued_outcomes(
        self, outcomes: GroupOutcomes, prompts: Sequence[int], rewards: Tensor
    ) -> GroupOutcomes:
        """The receiver's groups with the rescued ones (prompts [R], their rewards [R, n]) replaced."""
        ...


@dataclass(frozen=True)
class TrainSettings:
    """The ``train`` section's values a method's plan and loss read, fixed when the method is built
    (``Method.from_config``), as torchtune's losses take theirs: never re-sent with a micro-batch.
    The defaults are the section's."""

    eps_low: float = EPS_LOW
    """Lower clip range of the token ratio."""
    eps_high: float = EPS_HIGH
    """Upper clip range of the token ratio (DAPO clip-higher)."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages; None = off."""
    log_ratio_clamp: float | None = None
    """Clamp of log rho before exp; None = off."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen reference policy (the worker then provides
    ``LossInputs.ref_logp``); 0 = off."""
    adv_eps: float = ADV_EPS
    """eps_adv of eq. 1 (advantages a method computes itself: pooled groups, HACPO)."""
    adv_std_unbiased: bool = ADV_STD_UNBIASED
    """Unbiased (n - 1) group std in eq. 1."""

    @classmethod
    def of(cls, train: Any) -> TrainSettings:
        """The settings of a validated run config's ``train`` section."""
        return cls(**{f.name: getattr(train, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class RowOrigins:
    """Where a micro-batch's rows come from and where the micro-batch sits in the update: what a
    loss that compares each row with the policy that sampled it reads (HACPO: omega per source, the
    stepwise clip of optimizer step m, a sequence mean over the minibatch's rows). The worker builds
    it only for a method with ``reads_row_origins``."""

    receiver: str
    """Name of the policy being trained."""
    sources: tuple[str, ...]
    """[B] name of the model that sampled each row."""
    source_mean_logp: Tensor
    """[B] lbar of each row's sampling policy on its own tokenization, terminal EOS excluded (the
    record's ``mean_logprob``: the source's behaviour mean for peer rows, the receiver's own for
    own rows)."""
    finished: Tensor
    """[B] bool: the response ended with EOS, so its last response token is outside lbar's
    content tokens (algorithm.md §2.2)."""
    minibatch_index: int
    """Position of this minibatch among the step's optimizer steps (0-based, across epochs)."""
    minibatch_rows: int
    """Row count of the whole minibatch's surrogate rows (a sequence-mean denominator shared by
    its micro-batches)."""


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch of rows, on the receiver's own tokenization. B rows, T response tokens.

    Only the micro-batch's tensors and counts: a method's hyperparameters are fixed when it is
    built (``Method.train``, its section)."""

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
    is_nll: Tensor | None = None
    """[B] bool: rows of NLL groups (None: no such rows)."""
    nll_normalizer: float = 1.0
    """Token count of the minibatch's NLL rows."""
    minibatch_tokens: float = 1.0
    """Token count of the whole minibatch's surrogate and NLL rows together."""
    ref_logp: Tensor | None = None
    """[B, T] frozen reference policy log-probs when ``train.kl_coef`` > 0, else None."""
    token_weights: Tensor | None = None
    """[B, T] truncated importance-sampling weights for the rollout/trainer mismatch
    (``rollout.tis_cap``); None = no correction."""
    origins: RowOrigins | None = None
    """Where the rows come from, for a method with ``reads_row_origins`` (else None)."""

    @property
    def surrogate(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(logp, old_logp, advantages, weights, mask): the leading arguments of the core losses."""
        return self.logp, self.old_logp, self.advantages, self.weights, self.mask


class ConfigSection(BaseModel):
    """A YAML section: unknown keys are refused, values are frozen, and each field's docstring is its
    description (what `graftrl config-reference` prints); a method section's class docstring
    describes the section itself."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


@dataclass(frozen=True)
class PeerLikelihoods:
    """How likely B transferred responses are under their source and under the receiver, each on its
    own tokenization with a terminal EOS excluded (algorithm.md §2.2): what a compatibility score is made of."""

    receiver_mean_logp: Tensor
    """[B] lbar (eq. 6) of the receiver's old policy on its re-tokenization of each response."""
    receiver_tokens: Tensor
    """[B] content tokens of the receiver's tokenization."""
    source_mean_logp: Tensor
    """[B] lbar of the source's behaviour policy (the record's ``mean_logprob``)."""
    source_tokens: Tensor
    """[B] content tokens of the source's tokenization (the record's ``num_tokens``)."""
    num_bytes: Tensor
    """[B] UTF-8 bytes of each response string, at least 1."""


class Method:
    """What the trainer asks of a method: the protocol every method implements.

    A method is one module: its config section, defaults, validation, plan, weights, minibatch
    order and loss are members of its class. Subclasses implement ``plan`` and ``loss``; every
    other member has a default here. ``register_method`` makes a class selectable in the config.

    Options: a method with a ``section`` (a ``ConfigSection`` model, the YAML section
    ``section_key``) is built from one validated instance of it, ``Method(options)``, or from its
    fields, ``Method(delta=0.7)``; a subclass declares ``options`` with its section's type, so
    ``method.options.delta`` is typed. The ``train`` section's values it reads are fixed at the same
    time (``TrainSettings``, ``Method(train=...)``).
    """

    name: ClassVar[str] = ""
    """Registry name (the ``method:`` config value); set by ``register_method``."""
    section: ClassVar[type[ConfigSection] | None] = None
    """The method's config section (its fields, defaults, docstrings and validators), or None."""
    section_key: ClassVar[str] = ""
    """Top-level YAML key of ``section``: the method's name unless registered otherwise."""
    trains_on_stored_peers: ClassVar[bool] = False
    """Accepts `peers:` (stored peers, algorithm.md §2.3) as sources."""
    allows_tis: ClassVar[bool] = True
    """`rollout.tis_cap` applies (its loss uses the clipped token ratio of own rows)."""
    allows_dynamic_sampling: ClassVar[bool] = False
    """`rollout.dynamic_sampling` applies (policies may train on different prompts)."""
    needs_peer_old_logprobs: ClassVar[bool] = True
    """The loss reads the receiver's old log-probs of peer rows (the ratio's denominator, eq. 9)."""
    scores_peers: ClassVar[bool] = True
    """Transferred responses get a compatibility score s (``compatibility``), weights w
    (``peer_weights``) and a line in compatibility.jsonl. With this and
    ``needs_peer_old_logprobs`` both False the receiver never scores peer rows: each enters with
    w = 1."""
    pairs_only: ClassVar[bool] = False
    """The method pairs exactly two policies (``check`` refuses any other count)."""
    reads_row_origins: ClassVar[bool] = False
    """The loss reads ``LossInputs.origins`` (each row's source and its behaviour mean, the
    minibatch's position and rows); the worker builds them only then."""
    loss_metrics: ClassVar[tuple[LossMetric, ...]] = CLIPPING
    """The metrics.jsonl keys of the loss (``loss_metrics.LossMetric``): each the ratio of two sums
    the loss returns (or of a sum and the worker's count of trained tokens)."""
    plan_keys: ClassVar[tuple[PlanKey, ...]] = ()
    """The metrics.jsonl keys of ``plan``'s ``ExchangePlan.diagnostics`` (``loss_metrics.PlanKey``)."""

    options: ConfigSection | None
    """The validated section (None without one); subclasses narrow its type."""
    train: TrainSettings
    """The ``train`` section's values the plan and loss read."""

    def __init__(
        self, options: ConfigSection | None = None, /, *, train: TrainSettings | None = None, **fields: Any
    ) -> None:
        if self.section is None:
            if options is not None or fields:
                raise TypeError(f"method {self.name!r} has no options, got {sorted(fields) or options}")
        elif options is None:
            options = self.section(**fields)
        elif fields:
            raise TypeError(f"method {self.name!r}: pass its options or its fields, not both")
        self.options = options
        self.train = train if train is not None else TrainSettings()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r}, train={self.train!r})"

    # ----- configuration --------------------------------------------------------------------
    @classmethod
    def recipe(cls, batch_prompts: int, policies: int) -> dict[str, Any]:
        """``train`` fields this method's published recipe sets where a run config leaves them
        unset (the section's own defaults are GRPO's, the paper's Table 3): name -> value, for a
        batch of ``batch_prompts`` prompts and ``policies`` co-trained policies. Empty by default;
        the config applies it when validated, so a preset needs no copy of it."""
        return {}

    @classmethod
    def options_of(cls, config: Any) -> Any:
        """This method's section of a run config (None without a section)."""
        return getattr(config, cls.section_key) if cls.section is not None else None

    @classmethod
    def from_config(cls, config: Any) -> Method:
        """The method of a validated run config: its section and the ``train`` settings."""
        return cls(cls.options_of(config), train=TrainSettings.of(config.train))

    @classmethod
    def check(cls, config: Any) -> None:
        """Rules across sections for a run of this method, applied when the config is validated;
        a ValueError names the field and the fix. Overrides call ``super().check(config)``."""
        if config.peers and not cls.trains_on_stored_peers:
            raise ValueError(
                f"peers: stored peers are used by method {_with_flag('trains_on_stored_peers')}, "
                f"not {cls.name!r}"
            )
        if config.rollout.tis_cap is not None and not cls.allows_tis:
            raise ValueError(
                f"rollout.tis_cap: method {cls.name!r} has its own ratio handling; truncated importance "
                f"sampling is available for {_with_flag('allows_tis')} (remove rollout.tis_cap)"
            )
        if config.rollout.dynamic_sampling and not cls.allows_dynamic_sampling:
            raise ValueError(
                f"rollout.dynamic_sampling is only valid with method: {_with_flag('allows_dynamic_sampling', quote=False)} "
                f"(got {cls.name!r}): it redraws prompts per policy, while cross-model methods need one "
                "shared prompt batch"
            )
        if cls.pairs_only and len(config.policies) != 2:
            raise ValueError(f"method {cls.name!r} pairs exactly two policies, got {len(config.policies)}")

    # ----- one step -------------------------------------------------------------------------
    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        """Receiver name -> what it trains on this step."""
        raise NotImplementedError

    def compatibility(self, peers: PeerLikelihoods) -> Tensor:
        """s [B] of transferred responses (eq. 7): per token of each side's own tokenization."""
        return compatibility_score(peers.receiver_mean_logp, peers.source_mean_logp)

    def peer_weights(self, s: Tensor, generator: torch.Generator) -> Tensor:
        """w [B] for one receiver's transferred responses at this step, given their scores s [B];
        1 (no gate) unless the method weighs them."""
        return torch.ones_like(s)

    @property
    def peer_position(self) -> str:
        """Where minibatches holding peer groups go: the section's ``peer_position``, else last."""
        return getattr(self.options, "peer_position", "last")

    def order_minibatches(
        self, plan: ExchangePlan, prompts_per_minibatch: int, generator: torch.Generator
    ) -> list[Tensor]:
        """Indices into ``plan.groups`` for each optimizer step, in order (``peer_position``)."""
        is_peer = torch.tensor([g.peer for g in plan.groups], dtype=torch.bool)
        return minibatch_order(is_peer, prompts_per_minibatch, self.peer_position, generator)  # type: ignore[arg-type]

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss to minimise, detached sums) of one micro-batch: the sums ``loss_metrics`` name,
        which the worker adds over the step's micro-batches, minibatches and ranks."""
        raise NotImplementedError

    @classmethod
    def loss_sums(cls, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The entries of ``values`` that ``loss_metrics`` name (a core loss function returns more:
        counts of its own call and fractions)."""
        names = {name for metric in cls.loss_metrics for name in metric.sums()}
        return {key: value for key, value in values.items() if key in names}

    def with_own_kl(
        self, loss: Tensor, metrics: dict[str, Tensor], batch: LossInputs, own_mask: Callable[[], Tensor]
    ) -> Tensor:
        """``loss`` plus the k3 KL to the reference over the tokens ``own_mask()`` selects, its sums
        added to ``metrics``; ``loss`` itself without a reference or with ``train.kl_coef`` 0."""
        if batch.ref_logp is None or self.train.kl_coef <= 0:
            return loss
        mask = own_mask()
        kl = k3_kl(batch.logp, batch.ref_logp, mask, normalizer=batch.normalizer)
        metrics["kl_sum"], metrics["kl_tokens"] = k3_sums(batch.logp, batch.ref_logp, mask)
        return loss + self.train.kl_coef * kl

    @staticmethod
    def models_of(outcomes: Mapping[str, GroupOutcomes], fewer_than_two: str) -> list[str]:
        """The step's models in order; a ValueError of ``fewer_than_two`` (formatted with
        ``names`` and ``count``) when there are fewer than two."""
        names = list(outcomes)
        if len(names) < 2:
            raise ValueError(fewer_than_two.format(names=names, count=len(names)))
        return names

    # ----- state across steps ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state kept across steps (saved in checkpoints); {} for stateless methods."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")


class ClippedSurrogate(Method):
    """The DAPO/GRAFT clipped surrogate (eq. 10), with the k3 KL of own rows when configured."""

    loss_metrics = (*CLIPPING, *CLIPPING_BY_SIGN, OWN_S, PEER_S, KL)

    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        train = self.train
        loss, core = clipped_policy_loss(
            *batch.surrogate,
            train.eps_low,
            train.eps_high,
            normalizer=batch.normalizer,
            is_peer=batch.is_peer,
            token_weights=batch.token_weights,
            clip_ratio_c=train.clip_ratio_c,
            log_ratio_clamp=train.log_ratio_clamp,
        )
        metrics = self.loss_sums(core)
        return self.with_own_kl(
            loss, metrics, batch, lambda: batch.mask & ~batch.is_peer.unsqueeze(-1)
        ), metrics


class WholePromptMinibatches:
    """Mixin for pooled methods: each optimizer step holds whole prompts (own + peer groups)."""

    peer_position = "pooled"
    """Informational: each prompt's groups share an optimizer step (``order_minibatches``)."""

    def order_minibatches(
        self, plan: ExchangePlan, prompts_per_minibatch: int, generator: torch.Generator
    ) -> list[Tensor]:
        prompts = torch.tensor([g.prompt for g in plan.groups], dtype=torch.long)
        return pooled_minibatch_order(prompts, prompts_per_minibatch)


METHODS: dict[str, type[Method]] = {}
"""Registered methods by name, in registration order."""
DEFAULT_METHOD = "graft"
"""The paper's method: the default of `method:`."""


def _with_flag(flag: str, quote: bool = True) -> str:
    """The registered methods whose ``flag`` is set, for error messages: 'a', 'b' or 'c'."""
    names = [repr(n) if quote else n for n, method in METHODS.items() if getattr(method, flag)]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def register_method(name: str, section_key: str | None = None) -> Callable[[type[M]], type[M]]:
    """Class decorator: make a method selectable as ``method: <name>``; its section (if any) becomes
    the top-level YAML key ``section_key`` (default: the name) of every run config."""

    def decorator(cls: type[M]) -> type[M]:
        key = section_key or name
        if name in METHODS:
            raise ValueError(f"method {name!r} is registered twice")
        taken = {m.section_key: m.name for m in METHODS.values() if m.section is not None}
        if cls.section is not None and key in taken:
            raise ValueError(f"method {name!r}: config section {key!r} belongs to method {taken[key]!r}")
        cls.name, cls.section_key = name, key
        METHODS[name] = cls
        return cls

    return decorator


def build_method(name: str, config: Any | None = None, **options: Any) -> Method:
    """Instantiate a registered method by name, with a clear error for unknown names.

    With a run ``config`` the method reads its own section (``from_config``); otherwise ``options``
    are the fields of its section.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    method = METHODS[name]
    return method.from_config(config) if config is not None else method(**options)
