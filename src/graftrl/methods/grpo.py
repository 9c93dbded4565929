"""GRPO with the DAPO loss: each model learns only from its own groups (SPEC section 1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from graftrl.methods.base import ExchangePlan, GroupOutcomes, register_method


@register_method("grpo")
@dataclass(frozen=True)
class GRPO:
    """Independent GRPO: nothing crosses between models."""

    name: str = "grpo"
    peer_position: str = "last"

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        return {receiver: ExchangePlan() for receiver in outcomes}

    def peer_weights(self, receiver_mean_logp: Tensor, source_mean_logp: Tensor) -> tuple[Tensor, Tensor]:
        raise RuntimeError("GRPO transfers no responses, so it weighs none")
