"""The exchange volume of ``graftrl analyze``: per direction source -> receiver and step, the
prompts a method offered and moved and the responses it trained on, from the plan keys each
method logs (``EXCHANGE_KEYS``) and compatibility.jsonl (``analyze``'s docstring defines them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from graftrl.reporting.weights import WeightRule, applied_weights


@dataclass
class Exchange:
    source: str
    receiver: str
    steps: list[int]
    candidates: list[float]
    selected: list[float]
    transferred: list[int | None]
    admitted: list[int | None]
    s: list[float]
    """Every compatibility score of the direction (from compatibility.jsonl)."""
    w: list[float] | None
    """The weight each of them was trained with (None: a log without weights whose rule cannot be
    recomputed, random admission)."""

    @property
    def admission_rate(self) -> float | None:
        pairs = [(t, a) for t, a in zip(self.transferred, self.admitted, strict=True) if t is not None]
        total = sum(t for t, _ in pairs)
        if not total or any(a is None for _, a in pairs):
            return None
        return sum(a for _, a in pairs if a is not None) / total


@dataclass(frozen=True)
class ExchangeKeys:
    """The per-source plan diagnostics one family of methods logs (``Method.plan_keys``, listed by
    ``graftrl metrics-reference``): a row holding ``selected`` for a source moved that source's
    rows into its training batch."""

    candidates: str | None
    """Prompts offered; None: every prompt of the batch (``train.batch_prompts``)."""
    selected: str
    """Prompts moved (a batch-wide key when ``candidates`` is None: every prompt)."""
    responses: str | None = None
    """Responses moved, when the method counts them per source (compatibility.jsonl otherwise)."""
    ungated: bool = False
    """Every moved response enters the loss (no gate): admitted = moved."""


EXCHANGE_KEYS = (
    ExchangeKeys("candidates/", "selected/", "transferred/"),  # GRAFT, LUFFY
    ExchangeKeys("eligible/", "nll_responses/", "nll_responses/", ungated=True),  # SGT: one each
    ExchangeKeys("pooled/", "pooled/"),  # pooling: every prompt, every source
    ExchangeKeys(None, "omega/"),  # HACPO: every prompt of every source
)
"""What each method that trains on peer rows logs per source, first match wins."""


def _direction_keys(row: Mapping[str, Any]) -> tuple[ExchangeKeys | None, list[str]]:
    """The ``EXCHANGE_KEYS`` entry a metrics row holds, and its sources."""
    for keys in EXCHANGE_KEYS:
        sources = [k[len(keys.selected) :] for k in row if k.startswith(keys.selected)]
        if sources:
            return keys, sources
    return None, []


def exchange_by_direction(
    rows: Sequence[dict[str, Any]], compat: Sequence[dict[str, Any]], rule: WeightRule, batch_prompts: int
) -> list[Exchange]:
    """Per direction (source, receiver), the exchange of every step from the metrics rows (the
    plan keys each method logs, ``EXCHANGE_KEYS``) and compatibility.jsonl (s and the applied w)."""
    compat_at = {
        (int(c["step"]), c["receiver"]): c
        for c in compat
        if isinstance(c.get("s"), list)
        and isinstance(c.get("source"), list)
        and len(c["s"]) == len(c["source"])
    }
    directions: dict[tuple[str, str], Exchange] = {}
    for row in rows:
        receiver = row["model"]
        keys, sources = _direction_keys(row)
        if keys is None:
            continue
        for source in sources:
            ex = directions.setdefault(
                (source, receiver), Exchange(source, receiver, [], [], [], [], [], [], [])
            )
            admitted_logged = row.get("peer_admitted") if len(sources) == 1 else None
            step = int(row["step"])
            ex.steps.append(step)
            selected = float(
                batch_prompts if keys.candidates is None else row.get(f"{keys.selected}{source}") or 0.0
            )
            ex.selected.append(selected)
            ex.candidates.append(
                selected if keys.candidates is None else float(row.get(f"{keys.candidates}{source}") or 0.0)
            )
            moved = row.get(f"{keys.responses}{source}") if keys.responses else None
            entry = compat_at.get((step, receiver))
            if entry is not None:
                mine = [i for i, src in enumerate(entry["source"]) if src == source]
                ex.s += [float(entry["s"][i]) for i in mine]
                weights = applied_weights(entry, rule)
                ex.transferred.append(len(mine))
                if weights is None:  # unknown: the receiver's own count, when it has one source
                    ex.w = None
                    ex.admitted.append(None if admitted_logged is None else int(admitted_logged))
                    continue
                w = [weights[i] for i in mine]
                if ex.w is not None:
                    ex.w += w
                ex.admitted.append(sum(x > 0 for x in w))
            elif keys.ungated and moved is not None:  # every moved response trains
                ex.transferred.append(int(moved))
                ex.admitted.append(int(moved))
            elif len(sources) == 1 and "peer_responses" in row:
                transferred = int(row.get("peer_responses") or 0)
                admitted = row.get("peer_admitted")
                ex.transferred.append(transferred)
                # the trainer logs peer_admitted only on steps with grafted responses
                ex.admitted.append(int(admitted) if admitted is not None else (None if transferred else 0))
            else:
                ex.transferred.append(None if moved is None else int(moved))
                ex.admitted.append(None)
    return [directions[k] for k in sorted(directions)]
