"""GRAFT: gated replacement of answer-failed groups with peer trajectories (SPEC section 2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from graftrl.core import balanced_selection, compatibility_score, compatibility_weight, transfer_candidates
from graftrl.methods.base import ExchangePlan, GroupOutcomes, register_method


@register_method("graft")
@dataclass(frozen=True)
class GRAFT:
    """Two online peers exchange whole groups where the receiver failed all n (eq. 4).

    Selection is balanced across the two directions; each transferred response keeps its source
    advantage and is weighted by w = 1[s > delta] min(s, 1) (eq. 8).
    """

    name: str = "graft"
    delta: float = 0.8
    """Compatibility floor: responses with s <= delta are removed."""
    balance: bool = True
    """Balanced exchange (m = min of the two candidate counts); False moves every candidate."""
    peer_position: str = "last"
    """Where minibatches holding peer groups go in the receiver's update."""

    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        if len(outcomes) != 2:
            raise ValueError(f"online GRAFT pairs exactly two policies, got {len(outcomes)}")
        (name_a, a), (name_b, b) = outcomes.items()
        a_to_b, b_to_a = balanced_selection(a.successes, b.successes, a.n, balance=self.balance)
        return {
            name_b: self._plan_for(name_a, a, b, a_to_b),
            name_a: self._plan_for(name_b, b, a, b_to_a),
        }

    @staticmethod
    def _plan_for(source: str, src: GroupOutcomes, rcv: GroupOutcomes, selected: Tensor) -> ExchangePlan:
        candidates = transfer_candidates(rcv.successes, src.successes, src.n)
        return ExchangePlan(
            incoming={source: selected},
            diagnostics={
                f"candidates/{source}": float(candidates.sum()),
                f"selected/{source}": float(selected.sum()),
            },
        )

    def peer_weights(self, receiver_mean_logp: Tensor, source_mean_logp: Tensor) -> tuple[Tensor, Tensor]:
        s = compatibility_score(receiver_mean_logp, source_mean_logp)
        return s, compatibility_weight(s, self.delta)
