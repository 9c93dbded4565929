"""The weight each transferred response was trained with, as compatibility.jsonl logs it.

A compatibility.jsonl row carries, per transferred response, its score ``s`` and the weight ``w``
the update applied (eq. 8, or the method's rule: no gate, random admission, HACPO's w = 1). A log
written before graftrl recorded ``w`` has only ``s``: its weights are recomputed with the run's
rule where the rule is a function of s (the gate of eq. 8 with the run's delta, or w = 1), and
are unknown where it is not (random admission draws which responses enter). Every reader of the
weights goes through ``applied_weights``, so a report says once which weights it recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graftrl.core import compatibility_weight
from graftrl.core.compatibility import DELTA


@dataclass(frozen=True)
class WeightRule:
    """How a run weighed its transferred responses, for logs that did not record ``w``."""

    method: str
    gate: bool = True
    delta: float = DELTA
    admission: str = "gate"

    @classmethod
    def of(cls, method: str, graft: Mapping[str, Any] | None) -> WeightRule:
        """The rule of a run of ``method`` with the ``graft`` config section (a mapping or None)."""
        graft = graft or {}
        return cls(
            method,
            gate=bool(graft.get("gate", True)),
            delta=float(graft.get("delta", DELTA)),
            admission=str(graft.get("admission", "gate")),
        )

    @property
    def recomputable(self) -> bool:
        """The weights are a function of s (random admission's draw is not logged)."""
        return not (self.weighs and self.admission == "random")

    @property
    def weighs(self) -> bool:
        """Only GRAFT's gate weighs transferred responses; every other method trains them with w = 1."""
        return self.method == "graft" and self.gate

    def weights(self, s: Sequence[float]) -> list[float] | None:
        """w of each score: eq. 8 in float64 (so a logged score's weight is the score itself, or 1,
        or 0, to the last bit), 1 without the gate, None when not recomputable."""
        if not self.recomputable:
            return None
        if not self.weighs:
            return [1.0] * len(s)
        return compatibility_weight(torch.tensor(list(s), dtype=torch.float64), self.delta).tolist()

    def describe(self) -> str:
        """The recomputation in words, for a report's note."""
        if not self.recomputable:
            return "random admission draws which responses enter, so their weights cannot be recomputed"
        if not self.weighs:
            return "w = 1 (no gate)"
        return f"w = 1[s > {self.delta}] min(s, 1) (eq. 8)"


def logs_weights(record: Mapping[str, Any]) -> bool:
    """The compatibility.jsonl row records the applied weights (one per score)."""
    w = record.get("w")
    return isinstance(w, list) and len(w) == len(record.get("s") or [])


def applied_weights(record: Mapping[str, Any], rule: WeightRule) -> list[float] | None:
    """The weights a compatibility.jsonl row's responses were trained with: as logged, else
    recomputed with ``rule`` (None when the rule cannot be recomputed)."""
    if logs_weights(record):
        return [float(x) for x in record["w"]]
    return rule.weights([float(x) for x in record["s"]])


def recomputed_note(records: Sequence[Mapping[str, Any]], rule: WeightRule) -> str | None:
    """A note for a report whose ``records`` lack the logged weights (None when every row has them)."""
    if all(logs_weights(record) for record in records):
        return None
    return f"compatibility.jsonl has no applied weights w (written before graftrl logged them): {rule.describe()}"
