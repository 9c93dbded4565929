"""GRPO with the DAPO loss: each model learns only from its own groups (algorithm.md §1)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graftrl.methods.base import ClippedSurrogate, ExchangePlan, GroupOutcomes, own_groups, register_method


@register_method("grpo")
class GRPO(ClippedSurrogate):
    """Independent GRPO: nothing crosses between models, so each policy may draw its own prompts."""

    allows_dynamic_sampling = True

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        return {receiver: ExchangePlan(groups=own_groups(receiver, o)) for receiver, o in outcomes.items()}
