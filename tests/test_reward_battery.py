"""graftrl's reward against math_verify called directly, on a hand-written battery of cases
(tests/fixtures/reward_battery.jsonl: integers, decimals and decimal commas, fractions, radicals,
percent, degrees, intervals, sets, tuples, text, units, matrices, unparseable strings, no box,
several boxes, a "final answer" line after the box, truncated boxes, \\fbox, \\boxedfoo, ...).

Every disagreement is listed below with its reason; any other one fails the test, and so does a
listed one that disappears (update the list and docs/robustness.md together).
"""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES
from math_verify import parse, verify

from graftrl.models.rewards import MathVerifier, gold_parse_text

BATTERY = [json.loads(line) for line in (FIXTURES / "reward_battery.jsonl").read_text().splitlines()]

# reward.extraction: last_box (verl's DAPO rule) differs from math_verify's own extraction by design.
LAST_BOX_DIFFERS = {
    "no_box-48": "no box: last_box scores 0; math_verify reads the last number",
    "no_box-49": "no box: math_verify reads $x = 57$",
    "no_box-50": "no box: math_verify reads the last LaTeX",
    "several_boxes-51": "the last box decides (56 then 57 scores 1); math_verify reads both boxes as a set",
    "several_boxes-53": "the last box {2} alone; math_verify reads the boxes 1 and 2 as the set {1, 2}",
    "final_answer_after_box-55": "the box decides; math_verify prefers the 'final answer is' line",
    "truncated_box-58": "a truncated last box scores 0, never an earlier box; math_verify reads the earlier one",
    "truncated_box-59": "a truncated box scores 0; math_verify reads the partial box",
    "fbox-60": "\\fbox counts as a box (MATH's rule); math_verify ignores it",
    "boxedfoo-62": "\\boxedfoo is another command, skipped; math_verify reads it as a box",
}


def direct(gold: str, response: str) -> float:
    """math_verify called directly: parse both with its defaults, then verify."""
    parsed_gold = parse(gold, parsing_timeout=None)
    return 1.0 if verify(parsed_gold, parse(response, parsing_timeout=None), timeout_seconds=None) else 0.0


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    return {case["id"]: direct(case["gold"], case["response"]) for case in BATTERY}


def test_the_battery_covers_the_listed_categories():
    categories = {case["category"] for case in BATTERY}
    assert len(BATTERY) >= 60 and len(categories) >= 25
    assert {"several_boxes", "truncated_box", "fbox", "boxedfoo", "unparseable", "no_box"} <= categories
    assert set(LAST_BOX_DIFFERS) <= {case["id"] for case in BATTERY}


@pytest.mark.parametrize("short_circuit", [True, False])
@pytest.mark.parametrize(("extraction", "documented"), [("last_box", LAST_BOX_DIFFERS), ("math_verify", {})])
def test_disagreements_with_math_verify_are_exactly_the_documented_ones(
    reference, extraction, documented, short_circuit
):
    with MathVerifier(extraction=extraction, short_circuit=short_circuit) as verifier:
        rewards = verifier.score([c["response"] for c in BATTERY], [c["gold"] for c in BATTERY])
    differs = {
        c["id"]: (reference[c["id"]], r)
        for c, r in zip(BATTERY, rewards, strict=True)
        if r != reference[c["id"]]
    }
    assert set(differs) == set(documented), differs


def test_identical_unparseable_strings_score_like_math_verify():
    """The identical-string shortcut no longer scores `\\$`, `\\ldots`, `\\text{}` 1."""
    pairs = [("\\$", "\\$"), ("\\ldots", "\\ldots"), ("\\text{}", "\\text{}"), ("1,22", "1,22")]
    with MathVerifier() as verifier:
        rewards = verifier.score([f"\\boxed{{{pred}}}" for _, pred in pairs], [gold for gold, _ in pairs])
    assert rewards == [direct(gold, f"\\boxed{{{pred}}}") for gold, pred in pairs] == [0.0] * 4


@pytest.mark.parametrize(
    ("gold", "parsed_as"),
    [
        ("57", "57"),
        ("1,22", "1,22"),  # a plain number: math_verify's own reading, the decimal 1.22
        ("7,425,000", "7,425,000"),
        ("$\\frac{3}{4}$", "$\\frac{3}{4}$"),
        ("\\boxed{5}", "\\boxed{5}"),
        ("\\frac{3}{4}", "$\\frac{3}{4}$"),  # bare LaTeX: plain parse would keep only its last number
        ("(1, 2]", "$(1, 2]$"),
        ("2\\sqrt{3}", "$2\\sqrt{3}$"),
        ("1, 2", "$1, 2$"),
    ],
)
def test_gold_parsing(gold, parsed_as):
    assert gold_parse_text(gold) == parsed_as


def test_bare_dataset_golds_score_like_their_delimited_form():
    cases = [
        ("\\frac{3}{4}", "\\boxed{0.75}"),
        ("(1, 2]", "\\boxed{(1, 2]}"),
        ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}"),
        ("2\\sqrt{3}", "\\boxed{2}"),
        ("1, 2", "\\boxed{2, 1}"),
        ("1,22", "\\boxed{1.22}"),
        ("x^2+1", "\\boxed{1+x^2}"),
    ]
    with MathVerifier() as verifier:
        rewards = verifier.score([r for _, r in cases], [g for g, _ in cases])
    assert rewards == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
