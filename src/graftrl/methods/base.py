"""The protocol every training method implements, and the registry that names them.

A method answers two questions for each receiver at each step, in pure tensor terms:
which prompts' groups it trains on from which source (``plan``), and how much each transferred
response counts (``peer_weights``). The trainer does the model work around it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor


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


@dataclass
class ExchangePlan:
    """For one receiver: which prompts' groups are replaced by which source's group."""

    incoming: dict[str, Tensor] = field(default_factory=dict)
    """source name -> BoolTensor [P]: prompts whose group comes from that source."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    """Counts for the metrics log, keyed e.g. ``candidates/<source>``."""

    def peer_mask(self, num_prompts: int) -> Tensor:
        """BoolTensor [P]: the receiver trains on a peer group at this prompt."""
        mask = torch.zeros(num_prompts, dtype=torch.bool)
        for selected in self.incoming.values():
            mask |= selected
        return mask


class Method(Protocol):
    """What the trainer asks of a method."""

    name: str
    """Registry name (the ``method:`` config value)."""
    peer_position: str
    """Where peer-containing minibatches go: last / first / uniform."""

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        """Receiver name -> its exchange plan for this step."""
        ...

    def peer_weights(self, receiver_mean_logp: Tensor, source_mean_logp: Tensor) -> tuple[Tensor, Tensor]:
        """(s, w) for transferred responses; inputs [B] mean token log-probs (eq. 6)."""
        ...


METHODS: dict[str, Callable[..., Method]] = {}


def register_method(name: str) -> Callable[[Callable[..., Method]], Callable[..., Method]]:
    """Class decorator: make a method selectable as ``method: <name>``."""

    def decorator(factory: Callable[..., Method]) -> Callable[..., Method]:
        if name in METHODS:
            raise ValueError(f"method {name!r} is registered twice")
        METHODS[name] = factory
        return factory

    return decorator


def build_method(name: str, **options: Any) -> Method:
    """Instantiate a registered method by name, with a clear error for unknown names."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name](**options)
