"""Complementarity per (receiver, peer) and step (paper Figure 1): as the run logged it, and
recomputed from the rewards in a trajectory store to check it (``graftrl analyze``)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graftrl.core import complementarity
from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success

STORE_TOLERANCE = 1e-6
"""How far a logged value may be from the store's before the check reports a mismatch."""


@dataclass
class Complementarity:
    receiver: str
    peer: str
    by_step: dict[int, float]
    """Metrics value at every step where the receiver had an all-fail prompt."""
    store_by_step: dict[int, float] | None = None
    """Recomputed from the store's rewards (None without a store)."""
    mismatches: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, metrics value, store value) where the two disagree."""

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.by_step.values()) if self.by_step else None


def complementarity_by_step(
    rows: Sequence[Mapping[str, Any]], models: Sequence[str]
) -> list[Complementarity]:
    """Each (receiver, peer) pair's logged complementarity, at the steps where it is defined.

    A step where the receiver had no all-fail prompt (``all_fail_frac == 0``) is left out.
    """
    fail_frac = {(int(r["step"]), r["model"]): r.get("all_fail_frac") for r in rows}
    comps: list[Complementarity] = []
    for receiver in models:
        peers = sorted(
            {
                k.split("/", 1)[1]
                for r in rows
                if r["model"] == receiver
                for k in r
                if k.startswith("complementarity/")
            }
        )
        for peer in peers:
            by_step = {
                int(r["step"]): float(r[f"complementarity/{peer}"])
                for r in rows
                if r["model"] == receiver
                and r.get(f"complementarity/{peer}") is not None
                and fail_frac.get((int(r["step"]), receiver)) != 0
            }
            comps.append(Complementarity(receiver, peer, by_step))
    return comps


def _complementarity_from_store(
    store: Any,
    steps: Sequence[int],
    pairs: Sequence[tuple[str, str]],
    notes: list[str],
    threshold: float = SUCCESS_THRESHOLD,
) -> dict[tuple[str, str], dict[int, float]]:
    """(receiver, peer) -> step -> complementarity recomputed from stored rewards (successes: at or
    above ``threshold``, the run's ``reward.success_threshold``)."""
    from graftrl.storage.store import StoreError

    out: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    stored = set(store.steps())
    for step in steps:
        if step not in stored:
            continue
        try:
            rows = store.read_step(step, token_logprobs=False)
        except StoreError as error:
            notes.append(f"store step {step} skipped in the complementarity check: {error}")
            continue
        successes: dict[str, dict[int, tuple[str, float]]] = defaultdict(dict)
        for row in rows:
            prompt, k = successes[row.source].get(row.group_index, (row.prompt_id, 0.0))
            successes[row.source][row.group_index] = (prompt, k + float(is_success(row.reward, threshold)))
        for receiver, peer in pairs:
            own, other = successes.get(receiver), successes.get(peer)
            if not own or not other:
                continue
            if {g: p for g, (p, _) in own.items()} == {g: p for g, (p, _) in other.items()}:
                k_peer = {g: k for g, (_, k) in other.items()}
                k_own = [(g, k) for g, (_, k) in own.items()]
            else:  # groups not aligned by batch position: match by prompt id
                k_peer_by_prompt = {p: k for _, (p, k) in sorted(other.items())}
                k_peer = {g: k_peer_by_prompt.get(p, 0.0) for g, (p, _) in own.items()}
                k_own = [(g, k) for g, (_, k) in own.items()]
            groups = [g for g, _ in k_own]
            value = float(
                complementarity(
                    torch.tensor([k for _, k in k_own]),  # [P] receiver successes per group
                    torch.tensor([k_peer[g] for g in groups]),  # [P] the peer's on the same prompts
                )
            )
            if not math.isnan(value):  # NaN: the receiver had no all-fail prompt (undefined)
                out[(receiver, peer)][step] = value
    return out


def check_against_store(
    comps: Sequence[Complementarity],
    store: Any,
    steps: Sequence[int],
    notes: list[str],
    threshold: float = SUCCESS_THRESHOLD,
) -> tuple[str, bool]:
    """Verify ``store`` and fill each pair's ``store_by_step`` and ``mismatches`` from its rewards
    (successes at or above ``threshold``); returns the store's verification report and whether it
    is sound (StoreError propagates)."""
    report = store.verify()
    pairs = [(c.receiver, c.peer) for c in comps]
    recomputed = _complementarity_from_store(store, steps, pairs, notes, threshold)
    for c in comps:
        c.store_by_step = recomputed.get((c.receiver, c.peer), {})
        for step, value in sorted(c.store_by_step.items()):
            logged_value = c.by_step.get(step)
            if logged_value is None or abs(logged_value - value) > STORE_TOLERANCE:
                c.mismatches.append((step, math.nan if logged_value is None else logged_value, value))
    return str(report), report.ok
