"""The probe's verdict rule (docs/results.md §7) and how it is scored against trained outcomes.

The rule was fixed from the committed mastery line before any condition that tests it ran: for
the direction peer -> receiver of a probe run with the rule's method, its ``gain`` verdict ("GRAFT
beats GRPO into this receiver") when the net advantage mass per moved group exceeds ``m0`` and the
gate admits a larger share of the candidate correct responses than of the wrong ones; otherwise its
``no_gain`` verdict. Its score: hits over the new receiver-points, with a Clopper-Pearson interval;
it passes with at most ``max_misses`` misses *and* more hits than the constant rule "GRAFT never
beats GRPO". The rule's parameters and text, the commit that registered it and its track record
(what the embedded testbed measured) are lab data, in ``docs/probe/rule.json``
(``reporting.lab_data``); the probe prints a verdict only if that record passed, and none where
graftrl runs from no checkout.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

from graftrl.reporting.lab_data import RULE_FILE, LabData, read_lab_data

CONFIDENCE = 0.95
"""The hit rate's interval: 95% Clopper-Pearson."""


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


def rule_inputs(pair: Mapping[str, Any]) -> RuleInputs | None:
    """The rule's inputs from one entry of probe.json's ``pairs`` (None where nothing moved or an
    outcome had no scored response)."""
    mass = (pair["moved"].get("mass") or {}).get("net")
    correct = (pair["scored"].get("correct") or {}).get("passed_share")
    wrong = (pair["scored"].get("wrong") or {}).get("passed_share")
    if mass is None or correct is None or wrong is None:
        return None
    return RuleInputs(pair["source"], pair["receiver"], mass, correct, wrong, pair["moved"]["groups"])


@dataclass(frozen=True)
class TrackRecord:
    """The rule scored over ``trials`` receiver-points: ``hits`` right, ``called`` gains it called
    of which ``called_right`` happened, the hit rate's Clopper-Pearson interval, ``never_hits``:
    what the constant rule "GRAFT never beats GRPO" gets right on the same outcomes, and whether
    that passed the rule's bar (``score``)."""

    trials: int
    hits: int
    called: int
    called_right: int
    never_hits: int
    low: float
    high: float
    passed: bool

    def describe(self) -> str:
        return (
            f"{self.hits} of {self.trials} right (hit rate 95% Clopper-Pearson [{self.low:.0%}, {self.high:.0%}]); "
            f"{self.called_right} of the {self.called} gains it called happened; the constant rule "
            f"'GRAFT never beats GRPO' gets {self.never_hits} of {self.trials}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def passes(hits: int, trials: int, never_hits: int, max_misses: int) -> bool:
    """The bar: at most ``max_misses`` misses and more hits than "GRAFT never beats GRPO"."""
    return hits >= trials - max_misses and hits > never_hits


def score(outcomes: Sequence[tuple[bool, bool]], max_misses: int) -> TrackRecord:
    """The record of (predicted gain, gain happened) pairs, one per receiver-point, against a bar
    of at most ``max_misses`` misses."""
    if not outcomes:
        raise ValueError("no outcome to score the rule on")
    hits = sum(predicted == happened for predicted, happened in outcomes)
    never_hits = sum(not happened for _, happened in outcomes)
    # Clopper & Pearson 1934, Biometrika 26: the exact binomial interval ("exact" in scipy)
    interval = binomtest(hits, len(outcomes)).proportion_ci(CONFIDENCE, method="exact")
    return TrackRecord(
        trials=len(outcomes),
        hits=hits,
        called=sum(predicted for predicted, _ in outcomes),
        called_right=sum(predicted and happened for predicted, happened in outcomes),
        never_hits=never_hits,
        low=float(interval.low),
        high=float(interval.high),
        passed=passes(hits, len(outcomes), never_hits, max_misses),
    )


@dataclass(frozen=True)
class Rule:
    """The registered rule (``docs/probe/rule.json``): the commit that fixed it, the method whose
    probe it reads, its threshold ``m0`` on the net mass per moved group, its text (``text``, with
    ``{m0}`` and ``{method}``) and verdicts, the seeds per receiver-point its outcome is paired
    over, the misses its bar allows, and its measured ``record`` (None before one was measured)."""

    registered: str
    method: str
    m0: float
    text: str
    gain: str
    no_gain: str
    seeds: int
    max_misses: int
    record: TrackRecord | None

    @property
    def description(self) -> str:
        return self.text.format(m0=self.m0, method=self.method)

    def predicts_gain(self, inputs: RuleInputs | None) -> bool:
        return (
            inputs is not None and inputs.mass > self.m0 and inputs.admitted_correct > inputs.admitted_wrong
        )

    def verdict(self, inputs: RuleInputs | None) -> str:
        """The rule's call for one direction; nothing moved (no inputs) calls no gain."""
        return self.gain if self.predicts_gain(inputs) else self.no_gain

    def score(self, outcomes: Sequence[tuple[bool, bool]]) -> TrackRecord:
        return score(outcomes, self.max_misses)


def _track_record(data: LabData, max_misses: int) -> TrackRecord:
    counts = {
        key: data.integer(key, "a count, at least 0")
        for key in ("trials", "hits", "called", "called_right", "never_hits")
    }
    if any(value < 0 for value in counts.values()) or max(counts.values()) > counts["trials"]:
        raise data.fail(f"counts must lie in [0, trials], got {counts}")
    bounds = {key: data.number(key, "a hit rate in [0, 1]") for key in ("low", "high")}
    passed = passes(counts["hits"], counts["trials"], counts["never_hits"], max_misses)
    return TrackRecord(**counts, **bounds, passed=passed)


def load_rule(root: Path | None = None) -> Rule | None:
    """The registered rule from ``docs/probe/rule.json`` of the checkout (or of ``root``); None
    where graftrl runs from no checkout; a one-line ``LabDataError`` where the file is missing or
    malformed."""
    data = read_lab_data(RULE_FILE, root)
    if data is None:
        return None
    max_misses = data.integer("max_misses", "the misses the bar allows, an integer")
    seeds = data.integer("seeds", "the seeds per receiver-point, an integer")
    if max_misses < 0 or seeds < 1:
        raise data.fail(f"`max_misses` must be at least 0 and `seeds` at least 1, got {max_misses}, {seeds}")
    text = data.text("rule", "the rule in words, with {m0} and {method}")
    fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    if not fields <= {"m0", "method"}:
        raise data.fail(f"`rule` may name only {{m0}} and {{method}}, got {sorted(fields)}")
    record = data.data.get("track_record")
    return Rule(
        registered=data.text("registered", "the commit that fixed the rule"),
        method=data.text("method", "the method whose probe the rule reads"),
        m0=data.number("m0", "the threshold on the net mass per moved group, a number"),
        text=text,
        gain=data.text("gain", "the verdict that calls a gain"),
        no_gain=data.text("no_gain", "the verdict that calls none"),
        seeds=seeds,
        max_misses=max_misses,
        record=None
        if record is None
        else _track_record(data.section("track_record", "the measured record, or null"), max_misses),
    )


@functools.cache
def registered_rule() -> Rule | None:
    """The checkout's registered rule (read once); None where graftrl runs from no checkout."""
    return load_rule()


def verdicts(figures: Mapping[str, Any], rule: Rule | None = None) -> dict[str, Any] | None:
    """probe.json's ``verdict``: the rule (by default the registered one), its measured record, and
    per direction its inputs and verdict. ``directions`` is empty unless the record passed and the
    probe ran the rule's method; None where there is no rule (graftrl runs from no checkout)."""
    rule = rule if rule is not None else registered_rule()
    if rule is None:
        return None
    record = rule.record
    out: dict[str, Any] = {
        "rule": rule.description,
        "registered": rule.registered,
        "track_record": record.as_dict() if record else None,
        "directions": [],
    }
    if record is None or not record.passed or figures["probe"]["method"] != rule.method:
        return out
    for pair in figures["pairs"]:
        inputs = rule_inputs(pair)
        out["directions"].append(
            {
                "source": pair["source"],
                "receiver": pair["receiver"],
                "inputs": asdict(inputs) if inputs else None,
                "verdict": rule.verdict(inputs),
            }
        )
    return out
