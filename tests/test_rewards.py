"""Tests for ``graftrl.models.rewards``: boxed-answer extraction and the worker-backed MathVerifier.

The verifier tests run real math_verify in real worker processes; the fault tests use the
private ``_test_faults`` hook, which makes a worker hang, crash or raise on a chosen answer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from graftrl.models.rewards import MathVerifier, extract_last_boxed, verify_answer
from graftrl.storage.data import load_problems

# ------------------------------------------------------------------ extract_last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"The answer is \boxed{42}.", "42"),
        (r"first \boxed{3}, corrected: \boxed{4}", "4"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the group
        (r"\boxed { 7 }", " 7 "),
        (r"so $\boxed 5$", "5"),
        (r"so \boxed 12.", "12"),
        (r"\fbox{-3}", "-3"),
        (r"\boxed{1} and then \fbox{2}", "2"),
        (r"\boxed{}", ""),
        (r"\boxedfoo{1} but \boxed{2} \boxedbar{3}", "2"),  # other command names are skipped
        ("no answer here", None),
        ("", None),
        (r"\boxed{1} then truncated \boxed{\frac{1}{2}", None),  # last box unbalanced
        (r"\boxed", None),
    ],
)
def test_extract_last_boxed(text: str, expected: str | None) -> None:
    assert extract_last_boxed(text) == expected


_plain = st.text(alphabet=st.characters(blacklist_characters="{}\\$", blacklist_categories=("Cs",)))


@settings(max_examples=100, deadline=None)
@given(prefix=_plain, content=_plain, suffix=_plain, depth=st.integers(0, 3))
def test_extract_last_boxed_roundtrips_nested_content(
    prefix: str, content: str, suffix: str, depth: int
) -> None:
    inner = "{" * depth + content + "}" * depth
    text = prefix + r"\boxed{0} " + prefix + r"\boxed{" + inner + "}" + suffix
    assert extract_last_boxed(text) == inner


# ------------------------------------------------------------------ MathVerifier (shared workers)


@pytest.fixture(scope="module")
def verifier() -> Iterator[MathVerifier]:
    """One worker, no short-circuit: every pair below really goes through math_verify."""
    with MathVerifier(timeout_s=10.0, short_circuit=False) as v:
        yield v


EQUIVALENT = [
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\frac{6}{8}}", "3/4"),
    (r"\boxed{\sqrt{12}}", r"2\sqrt{3}"),
    (r"\boxed{-5}", "-5"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{3, 2}", "2, 3"),
    (r"\boxed{x = 7}", "7"),
]
WRONG = [
    (r"\boxed{0.4}", r"\frac{1}{2}"),
    (r"\boxed{5}", "-5"),
    (r"\boxed{\frac{3}{5}}", "3/4"),
    (r"\boxed{3\sqrt{2}}", r"2\sqrt{3}"),
]


def test_equivalent_forms_score_one_and_wrong_answers_zero(verifier: MathVerifier) -> None:
    responses = [f"Reasoning... so the answer is {box}." for box, _ in EQUIVALENT + WRONG]
    golds = [gold for _, gold in EQUIVALENT + WRONG]
    assert verifier.score(responses, golds) == [1.0] * len(EQUIVALENT) + [0.0] * len(WRONG)


def test_last_boxed_answer_wins(verifier: MathVerifier) -> None:
    response = r"I first thought \boxed{\frac{1}{3}} but it is \boxed{\frac{1}{2}}."
    assert verifier.score([response, response], [r"\frac{1}{2}", r"\frac{1}{3}"]) == [1.0, 0.0]


def test_missing_or_empty_box_scores_zero_without_a_worker(verifier: MathVerifier) -> None:
    before = verifier.stats()
    rewards = verifier.score(["the answer is 57", r"\boxed{}", r"\boxed{57"], ["57", "57", "57"])
    after = verifier.stats()
    assert rewards == [0.0, 0.0, 0.0]
    assert after["no_answer"] - before["no_answer"] == 3
    assert after["verified"] == before["verified"]


def test_cache_hits_are_counted_and_skip_the_workers(verifier: MathVerifier) -> None:
    responses = [r"\boxed{0.25}", r"\boxed{\frac{2}{8}}", r"\boxed{0.3}"] * 4  # repeats in-batch
    golds = [r"\frac{1}{4}"] * len(responses)
    s0 = verifier.stats()
    first = verifier.score(responses, golds)
    s1 = verifier.stats()
    second = verifier.score(responses, golds)
    s2 = verifier.stats()
    assert first == second == [1.0, 1.0, 0.0] * 4
    assert s1["verified"] - s0["verified"] == 3  # three distinct (gold, answer) pairs
    assert s1["cache_hits"] - s0["cache_hits"] == 9
    assert s2["verified"] == s1["verified"]
    assert s2["cache_hits"] - s1["cache_hits"] == 12


def test_fixture_answers_verify_against_themselves_and_boxed_variants(verifier: MathVerifier) -> None:
    """Identical strings pass math_verify (the documented basis of the short-circuit)."""
    problems = load_problems(FIXTURES / "math_small.jsonl")
    responses = [f"Step by step... \\boxed{{{p.answer}}}" for p in problems]
    assert verifier.score(responses, [p.answer for p in problems]) == [1.0] * len(problems)


def test_fast_path_agrees_with_math_verify(verifier: MathVerifier) -> None:
    """The short-circuit (exact match, integer comparison) gives math_verify's verdicts."""
    pairs = [
        ("57", "57"),
        ("007", "7"),
        ("-0", "0"),
        ("12", "-12"),
        ("1000001", "1000000"),
        (r"\frac{3}{4}", r"\frac{3}{4}"),
        (r"2  \sqrt{3}", r"2 \sqrt{3}"),
        ("123456789012345678901", "123456789012345678901"),
    ]
    responses = [rf"\boxed{{{pred}}}" for _, pred in pairs]
    golds = [gold for gold, _ in pairs]
    with MathVerifier() as fast:
        fast_rewards = fast.score(responses, golds)
        assert fast.stats()["short_circuits"] == len(pairs)
        assert fast.worker_pids == []  # never needed a worker
    assert fast_rewards == verifier.score(responses, golds)


def test_score_rejects_mismatched_lengths(verifier: MathVerifier) -> None:
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        verifier.score([r"\boxed{1}", r"\boxed{2}"], ["1"])


def test_verify_answer_one_off() -> None:
    assert verify_answer(r"so \boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert verify_answer(r"so \boxed{0.6}", r"\frac{1}{2}") == 0.0
    assert verify_answer("no box", "1") == 0.0


# ------------------------------------------------------------------ faults: hang, crash, raise

FAULTS = {"HANG": "hang", "CRASH": "crash", "BOOM": "raise"}
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def faulty() -> Iterator[MathVerifier]:
    with MathVerifier(timeout_s=TIMEOUT_S, _test_faults=FAULTS) as v:
        v.start()
        yield v


def test_hang_scores_zero_after_timeout_and_worker_is_replaced(faulty: MathVerifier) -> None:
    pids_before = faulty.worker_pids
    s0 = faulty.stats()
    t0 = time.perf_counter()
    assert faulty.score([r"\boxed{HANG}"], ["1"]) == [0.0]
    elapsed = time.perf_counter() - t0
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.5
    s1 = faulty.stats()
    assert s1["timeouts"] - s0["timeouts"] == 1
    assert s1["worker_restarts"] - s0["worker_restarts"] == 1
    assert faulty.worker_pids != pids_before
    # The replacement worker serves the next batch.
    assert faulty.score([r"\boxed{0.5}"], [r"\frac{1}{2}"]) == [1.0]


def test_hang_mid_batch_only_costs_that_answer(faulty: MathVerifier) -> None:
    responses = [r"\boxed{\frac{4}{8}}", r"\boxed{HANG}", r"\boxed{0.2}", r"\boxed{\frac{1}{5}}"]
    golds = ["0.5", "2", "1/5", "0.25"]
    s0 = faulty.stats()
    assert faulty.score(responses, golds) == [1.0, 0.0, 1.0, 0.0]
    assert faulty.stats()["timeouts"] - s0["timeouts"] == 1
    # The timed-out pair is cached as 0.0: scoring it again costs no second timeout.
    t0 = time.perf_counter()
    assert faulty.score([r"\boxed{HANG}"], ["2"]) == [0.0]
    assert time.perf_counter() - t0 < 0.1


def test_worker_crash_and_exception_count_as_errors(faulty: MathVerifier) -> None:
    s0 = faulty.stats()
    responses = [r"\boxed{CRASH}", r"\boxed{\frac{9}{3}}", r"\boxed{BOOM}", r"\boxed{0.5}"]
    assert faulty.score(responses, ["1", "3", "1", "1/2"]) == [0.0, 1.0, 0.0, 1.0]
    s1 = faulty.stats()
    assert s1["errors"] - s0["errors"] == 2
    assert s1["worker_restarts"] - s0["worker_restarts"] == 1  # only the crash kills a worker


# ------------------------------------------------------------------ lifecycle


def test_workers_start_lazily_and_close_stops_them() -> None:
    v = MathVerifier(workers=2)
    assert v.worker_pids == []
    assert v.score([r"\boxed{2/4}", r"\boxed{0.3}"], ["0.5", "0.5"]) == [1.0, 0.0]
    procs = [w.proc for w in v._workers]
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    v.close()
    v.close()  # idempotent
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="after close"):
        v.score([r"\boxed{1}"], ["1"])


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"workers": 0}, {"start_method": "fork"}])
def test_invalid_settings_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="MathVerifier"):
        MathVerifier(**kwargs)  # type: ignore[arg-type]
