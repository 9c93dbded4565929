"""Served peers in `graftrl analyze`: their share of the exchange and what they cost.

From metrics.jsonl alone: a served peer's per-step cost (``served_<key>/<peer>``, the same on
every receiver's row of a step, so read once per step) and the exchange from it
(``selected/<peer>`` summed over receivers, ``transferred/<peer>`` likewise). The served share is
the peer's transferred responses over all transferred responses of the run; the cost is its
requests, retries, tokens requested and received, missing prompts and request wall time, beside
the run's accelerator-hours (analysis.md's Compute section).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from graftrl.storage.log_keys import SERVED_COST_KEYS as COST_KEYS


@dataclass
class ServedCost:
    peer: str
    steps: int
    totals: dict[str, float]
    """COST_KEYS summed over steps."""
    selected: float
    """Prompts on which some receiver took the peer's group."""
    transferred: float
    """Peer responses transferred (before the gate)."""
    share: float | None
    """transferred / every source's transferred responses (None: nothing was transferred)."""

    @property
    def missing_share(self) -> float | None:
        prompts = self.totals["prompts"]
        return self.totals["missing"] / prompts if prompts else None


def served_costs(rows: Sequence[Mapping[str, Any]]) -> list[ServedCost]:
    """One ``ServedCost`` per served peer logged in ``rows`` (metrics.jsonl rows), by name."""
    peers = sorted(
        {key.split("/", 1)[1] for row in rows for key in row if key.startswith("served_requests/")}
    )
    if not peers:
        return []
    by_step: dict[int, Mapping[str, Any]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), row)  # the cost is logged alike on each receiver's row
    all_transferred = sum(
        float(value or 0.0) for row in rows for key, value in row.items() if key.startswith("transferred/")
    )
    out = []
    for peer in peers:
        steps = [row for row in by_step.values() if f"served_requests/{peer}" in row]
        totals = {
            key: sum(float(row.get(f"served_{key}/{peer}") or 0.0) for row in steps) for key in COST_KEYS
        }
        transferred = sum(float(row.get(f"transferred/{peer}") or 0.0) for row in rows)
        out.append(
            ServedCost(
                peer,
                len(steps),
                totals,
                sum(float(row.get(f"selected/{peer}") or 0.0) for row in rows),
                transferred,
                transferred / all_transferred if all_transferred else None,
            )
        )
    return out
