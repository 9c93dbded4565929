"""The ``match`` verifier: every extraction, the exact, normalized and multiple-choice modes, several
golds, the row check, and a huge response that stays fast."""

from __future__ import annotations

import time

import numpy as np
import pytest

from graftrl.config.rewards import RewardConfig
from graftrl.storage.data import Problem
from graftrl.verifiers.base import ERROR, NO_ANSWER, WRONG, Verifier
from graftrl.verifiers.match import (
    MAX_CHARS,
    MatchVerifier,
    choice_letters,
    extract_answer,
    gold_answers,
    normalize,
)


def problem(answer: str = "", **extra: object) -> Problem:
    return Problem("q1", "question", answer, extra=extra)


@pytest.mark.parametrize(
    ("extract", "response", "answer"),
    [
        ("last_box", "so \\boxed{3} then \\boxed{ 42 } done", "42"),
        ("last_box", "nested \\boxed{\\text{Paris}}", "\\text{Paris}"),
        ("last_box", "first \\boxed{1} then cut \\boxed{4", None),  # a truncated last box is no answer
        ("last_box", "no box here", None),
        ("last_line", "work\nmore work\n  Paris  \n\n   \n", "Paris"),
        ("last_line", "  \n\n", None),
        ("answer_tag", "think <answer> Paris </answer> then Answer: Rome", "Paris"),
        ("answer_tag", "<ANSWER>Oslo</Answer>", "Oslo"),
        ("answer_tag", "<answer> </answer>", None),
        ("answer_tag", "Answer: 1\nfinal answer: Rome\nbye", "Rome"),
        ("answer_tag", "**Answer:** Lima\nthanks", "Lima"),
        ("answer_tag", "Answer:\n\n  **Oslo**", "Oslo"),
        ("answer_tag", "<answer>unclosed, Answer: Kyiv", "Kyiv"),
        ("answer_tag", "nothing tagged", None),
        ("whole", "  Paris \n", "Paris"),
        ("whole", "   ", None),
    ],
)
def test_extraction(extract: str, response: str, answer: str | None) -> None:
    assert extract_answer(response, extract) == answer


def test_normalize() -> None:
    assert normalize("  **Paris.** ") == "paris"
    assert normalize('"New \t York"!') == "new york"
    assert normalize("$x^2$") == "x^2"
    assert normalize("`ΣΤΑΣΙΣ`") == normalize("στασις") == "στασισ"  # casefold, not lower
    assert normalize("-5") == "-5" and normalize("(1, 2]") == "(1, 2]"  # signs and brackets are kept
    assert normalize("Washington D.C.") == normalize("washington d.c") == "washington d.c"


@pytest.mark.parametrize(
    ("mode", "response", "gold", "correct"),
    [
        ("exact", "\\boxed{Paris}", "Paris", True),
        ("exact", "\\boxed{ Paris }", " Paris", True),  # white space around both is stripped
        ("exact", "\\boxed{paris}", "Paris", False),
        ("exact", "\\boxed{Paris.}", "Paris", False),
        ("normalized", "\\boxed{paris.}", "Paris", True),
        ("normalized", "\\boxed{ 'New  York' }", "new york", True),
        ("normalized", "\\boxed{New Yorker}", "New York", False),
        ("normalized", "\\boxed{-5}", "5", False),
    ],
)
def test_exact_and_normalized(mode: str, response: str, gold: str, correct: bool) -> None:
    verdict = MatchVerifier(mode=mode).verify([response], [problem(gold)])[0]
    assert verdict.reward == float(correct)
    if correct:
        assert verdict.failure is None and verdict.reason == "correct"
    else:
        assert verdict.failure == WRONG and verdict.reason.startswith("wrong: answered '")


def test_reasons_and_stats() -> None:
    v = MatchVerifier()
    out = v.verify(["\\boxed{Rome}", "no box", "\\boxed{Paris}", "x"], [problem("Paris")] * 3 + [problem("")])
    assert [(x.reward, x.reason, x.failure) for x in out[:3]] == [
        (0.0, "wrong: answered 'Rome'", WRONG),
        (0.0, "no answer found", NO_ANSWER),
        (1.0, "correct", None),
    ]
    assert out[3].failure == ERROR and out[3].reason.startswith("field 'answer' is empty")
    stats = v.stats()
    assert (stats["answers"], stats["correct"], stats["wrong"], stats["no_answer"], stats["errors"]) == (
        4,
        1,
        1,
        1,
        1,
    )
    long = MatchVerifier().verify(["\\boxed{" + "x" * 500 + "}"], [problem("y")])[0]
    assert len(long.reason) < 100 and long.reason.endswith("...'")


def test_several_golds() -> None:
    row = problem("", answers=["Paris", "Paris, France"])
    assert gold_answers(row) == ["Paris", "Paris, France"]
    assert gold_answers(problem("Paris", answers=np.array(["paris", "Paris"]))) == ["Paris", "paris"]
    assert gold_answers(problem("4", answers="four")) == ["4", "four"]
    v = MatchVerifier(extract="whole")
    assert v.rewards(["paris, france.", "PARIS", "France"], [row] * 3) == [1.0, 1.0, 0.0]
    assert v.check_problem(row) is None


def test_check_problem() -> None:
    message = MatchVerifier().check_problem(problem("", answers=[]))
    assert message is not None and message.startswith("field 'answer' is empty")
    assert "\n" not in message
    assert MatchVerifier(mode="choice").check_problem(problem("(C)")) is None
    message = MatchVerifier(mode="choice").check_problem(problem("Paris"))
    assert message is not None and message.startswith("field 'answer' is not a choice letter: 'Paris'")
    assert "reward.match.mode" in message


@pytest.mark.parametrize(
    ("text", "letters"),
    [
        ("B", ["B"]),
        ("(B)", ["B"]),
        ("B)", ["B"]),
        ("B.", ["B"]),
        ("b", ["B"]),
        ("(b)", ["B"]),
        ("[B]", ["B"]),
        ("Answer: B", ["B"]),
        ("**Answer:** C", ["C"]),
        ("Final answer: A", ["A"]),
        ("the answer is B", ["B"]),
        ("The correct answer is option (C).", ["C"]),
        ("answer is A because it is larger", ["A"]),
        ("The answer is B, since C is wrong", ["B"]),
        ("\\boxed{B}", ["B"]),
        ("The answer is $\\boxed{\\text{C}}$.", ["C"]),
        ("B) Paris", ["B"]),
        ("B. Vitamin D", ["B"]),
        ("option D", ["D"]),
        ("I think B", ["B"]),
        ("I'd pick B", ["B"]),
        ("A", ["A"]),
        ("A or B", ["A", "B"]),
        ("either A or B", ["A", "B"]),
        ("A/B", ["A", "B"]),
        ("(A), (C)", ["A", "C"]),
        ("The answer is (B) or (C)", ["B", "C"]),
        ("answer: B and C", ["B", "C"]),
        ("A cat sat on the mat", []),
        ("no letter here", []),
        ("Let P be a point on the circle; then the long argument goes on and on", []),
    ],
)
def test_choice_letters(text: str, letters: list[str]) -> None:
    assert choice_letters(text) == letters


def test_choice_mode() -> None:
    v = MatchVerifier(mode="choice", extract="whole")
    responses = ["so the answer is B", "Answer: (b)", "A", "A or B", "I cannot tell", "\\boxed{B}"]
    out = v.verify(responses, [problem("(B)")] * len(responses))
    assert [x.reward for x in out] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert out[2].reason == "wrong: answered 'A'" and out[2].failure == WRONG
    assert out[3].reason == "wrong: answered several letters (A, B)" and out[3].failure == WRONG
    assert out[4].reason == "no answer found" and out[4].failure == NO_ANSWER
    # a choice read through an extraction: only the box counts under last_box
    boxed = MatchVerifier(mode="choice", extract="last_box")
    assert boxed.rewards(["A is tempting, but \\boxed{B}", "the answer is B"], [problem("B")] * 2) == [
        1.0,
        0.0,
    ]
    assert MatchVerifier(mode="choice").rewards(["\\boxed{C}"], [problem("", answers=["B", "C"])]) == [1.0]


def test_from_config_and_protocol() -> None:
    reward = RewardConfig(kind="match", match={"mode": "choice", "extract": "answer_tag"})
    v = MatchVerifier.from_config(reward)
    assert isinstance(v, Verifier) and v.kind == "match"
    assert (v.mode, v.extract) == ("choice", "answer_tag")
    assert v.rewards(["<answer>(D)</answer>"], [problem("D")]) == [1.0]
    with pytest.raises(ValueError, match="mode must be one of"):
        MatchVerifier(mode="fuzzy")
    with pytest.raises(ValueError, match="2 responses but 1 problems"):
        v.verify(["a", "b"], [problem("a")])


def test_huge_responses_are_fast() -> None:
    huge = [
        "(" * 2_000_000 + "answer is " * 200_000,
        "\\boxed{" * 300_000,
        "<answer>" * 300_000 + "Answer:" * 300_000,
        "A or " * 400_000,
        ("x " * 1_000_000) + "\\boxed{Paris}",
    ]
    for mode in ("exact", "normalized", "choice"):
        for extract in ("last_box", "last_line", "answer_tag", "whole"):
            t0 = time.perf_counter()
            out = MatchVerifier(mode=mode, extract=extract).verify(huge, [problem("B")] * len(huge))
            assert time.perf_counter() - t0 < 1.0, (mode, extract)
            assert all(x.reward == 0.0 for x in out)
    # the answer ends a response: the examined tail still holds it
    assert MatchVerifier().rewards([huge[-1]], [problem("paris")]) == [1.0]
    whole = MatchVerifier(mode="exact", extract="whole").verify(["B" * (MAX_CHARS + 1)], [problem("B")])[0]
    assert whole.failure == WRONG and whole.reason == "wrong: answered 32,769 characters"
    assert MatchVerifier(extract="whole").rewards(["B" + " " * MAX_CHARS], [problem("B")]) == [1.0]
