"""The probe's verdict rule (docs/results.md §7) and how it is scored against trained outcomes.

The rule was fixed from the committed mastery line before any condition that tests it ran
(pre-registered at ``REGISTERED``): for the direction peer -> receiver of a ``method: graft`` probe,
"GRAFT beats GRPO into this receiver" when the net advantage mass per moved group exceeds ``M0``
and the gate admits a larger share of the candidate correct responses than of the wrong ones;
otherwise "no gain from GRAFT predicted". Its score: hits over the new receiver-points, with a
Clopper-Pearson interval; it passes with at most ``MAX_MISSES`` misses *and* more hits than the
constant rule "GRAFT never beats GRPO". ``TRACK_RECORD`` is what the embedded testbed measured;
the probe prints a verdict only if that record passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy.stats import binomtest

M0 = 0.65
"""Net advantage mass per moved group above which the rule calls a gain (results.md §7)."""
MAX_MISSES = 1
"""Misses the rule may make over the new conditions and still pass (7 of 8)."""
REGISTERED = "1c2398a"
"""The commit that fixed the rule and its scoring, before the conditions that test it ran."""
SEEDS = 5
"""Seeds per receiver-point the outcome is paired over."""
RULE_METHOD = "graft"
"""The rule reads the moved groups of a probe run with this method."""
GAIN = "GRAFT beats GRPO into this receiver"
NO_GAIN = "no gain from GRAFT predicted"
CONFIDENCE = 0.95


@dataclass(frozen=True)
class RuleInputs:
    """What the rule reads of one direction of a probe: ``mass`` the net advantage mass per moved
    group, ``admitted_correct`` / ``admitted_wrong`` the shares of the candidate correct / wrong
    responses the gate admits (s > delta), ``groups`` the moved groups the mass is a mean over."""

    source: str
    receiver: str
    mass: float
    admitted_correct: float
    admitted_wrong: float
    groups: int

    @property
    def predicts_gain(self) -> bool:
        return self.mass > M0 and self.admitted_correct > self.admitted_wrong


def rule_inputs(pair: Mapping[str, Any]) -> RuleInputs | None:
    """The rule's inputs from one entry of probe.json's ``pairs`` (None where nothing moved or an
    outcome had no scored response)."""
    mass = (pair["moved"].get("mass") or {}).get("net")
    correct = (pair["scored"].get("correct") or {}).get("passed_share")
    wrong = (pair["scored"].get("wrong") or {}).get("passed_share")
    if mass is None or correct is None or wrong is None:
        return None
    return RuleInputs(pair["source"], pair["receiver"], mass, correct, wrong, pair["moved"]["groups"])


def verdict_of(inputs: RuleInputs | None) -> str:
    """The rule's call for one direction; nothing moved (no inputs) calls no gain."""
    return GAIN if inputs is not None and inputs.predicts_gain else NO_GAIN


@dataclass(frozen=True)
class TrackRecord:
    """The rule scored over ``trials`` receiver-points: ``hits`` right, ``called`` gains it called
    of which ``called_right`` happened, the hit rate's Clopper-Pearson interval, and ``never_hits``:
    what the constant rule "GRAFT never beats GRPO" gets right on the same outcomes."""

    trials: int
    hits: int
    called: int
    called_right: int
    never_hits: int
    low: float
    high: float

    @property
    def passed(self) -> bool:
        return self.hits >= self.trials - MAX_MISSES and self.hits > self.never_hits

    def describe(self) -> str:
        return (
            f"{self.hits} of {self.trials} right (hit rate 95% Clopper-Pearson [{self.low:.0%}, {self.high:.0%}]); "
            f"{self.called_right} of the {self.called} gains it called happened; the constant rule "
            f"'GRAFT never beats GRPO' gets {self.never_hits} of {self.trials}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def score(outcomes: Sequence[tuple[bool, bool]]) -> TrackRecord:
    """The record of (predicted gain, gain happened) pairs, one per receiver-point."""
    if not outcomes:
        raise ValueError("no outcome to score the rule on")
    hits = sum(predicted == happened for predicted, happened in outcomes)
    # Clopper & Pearson 1934, Biometrika 26: the exact binomial interval ("exact" in scipy)
    interval = binomtest(hits, len(outcomes)).proportion_ci(CONFIDENCE, method="exact")
    return TrackRecord(
        trials=len(outcomes),
        hits=hits,
        called=sum(predicted for predicted, _ in outcomes),
        called_right=sum(predicted and happened for predicted, happened in outcomes),
        never_hits=sum(not happened for _, happened in outcomes),
        low=float(interval.low),
        high=float(interval.high),
    )


TRACK_RECORD: TrackRecord | None = TrackRecord(
    trials=8, hits=5, called=2, called_right=0, never_hits=7, low=0.2449, high=0.9148
)
"""The rule's record on the embedded testbed's 8 new receiver-points (docs/results.md §7 "Track
record", ``experiments/worked/mastery-new``): it failed, so the probe prints no verdict. A test
recomputes it from the committed cells."""


def verdicts(figures: Mapping[str, Any], record: TrackRecord | None = TRACK_RECORD) -> dict[str, Any]:
    """probe.json's ``verdict``: the rule, its measured record, and per direction its inputs and
    verdict. ``directions`` is empty unless the record passed and the probe ran ``RULE_METHOD``."""
    out: dict[str, Any] = {
        "rule": f"GRAFT beats GRPO into a receiver when the net mass / group it would move is above {M0} "
        f"and its correct s > delta share is above its wrong one (read on a `{RULE_METHOD}` probe)",
        "registered": REGISTERED,
        "track_record": record.as_dict() if record else None,
        "directions": [],
    }
    if record is None or not record.passed or figures["probe"]["method"] != RULE_METHOD:
        return out
    for pair in figures["pairs"]:
        inputs = rule_inputs(pair)
        out["directions"].append(
            {
                "source": pair["source"],
                "receiver": pair["receiver"],
                "inputs": asdict(inputs) if inputs else None,
                "verdict": verdict_of(inputs),
            }
        )
    return out
