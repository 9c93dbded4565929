"""GRAFT: gated replacement of answer-failed groups with peer trajectories (SPEC section 2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from graftrl.core import balanced_selection, transfer_candidates
from graftrl.methods.base import (
    ClippedSurrogate,
    ExchangePlan,
    GroupOutcomes,
    register_method,
    replacement_plan,
)


@register_method("graft")
@dataclass(frozen=True)
class GRAFT(ClippedSurrogate):
    """Two online peers exchange whole groups where the receiver failed all n (eq. 4).

    Selection is balanced across the two directions; each transferred response keeps its source
    advantage and is weighted by w = 1[s > delta] min(s, 1) (eq. 8); peer groups train last.
    """

    name: str = "graft"
    balance: bool = True
    """Balanced exchange (m = min of the two candidate counts); False moves every candidate."""

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        if len(outcomes) != 2:
            raise ValueError(f"online GRAFT pairs exactly two policies, got {len(outcomes)}")
        (name_a, a), (name_b, b) = outcomes.items()
        a_to_b, b_to_a = balanced_selection(a.successes, b.successes, a.n, balance=self.balance)
        return {
            name_b: self._plan_for(name_b, name_a, outcomes, a_to_b),
            name_a: self._plan_for(name_a, name_b, outcomes, b_to_a),
        }

    @staticmethod
    def _plan_for(
        receiver: str, source: str, outcomes: Mapping[str, GroupOutcomes], selected: Tensor
    ) -> ExchangePlan:
        src, rcv = outcomes[source], outcomes[receiver]
        plan = replacement_plan(receiver, outcomes, {source: selected})
        plan.diagnostics = {
            f"candidates/{source}": float(transfer_candidates(rcv.successes, src.successes, src.n).sum()),
            f"selected/{source}": float(selected.sum()),
        }
        return plan
