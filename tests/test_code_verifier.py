"""The code verifier: what a program is, the two test forms, agreement with a plain reference run,
the cache, the deadlines, and the one-line refusal when the sandbox cannot start."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from graftrl.config.rewards import RewardConfig
from graftrl.storage.data import Problem
from graftrl.verifiers import sandbox as sandbox_module
from graftrl.verifiers.base import NO_CODE, SYNTAX_ERROR, TESTS_FAILED, TIMEOUT, VerifierError
from graftrl.verifiers.code import CodeTests, CodeVerifier, extract_program, same_output
from graftrl.verifiers.registry import build_verifier
from graftrl.verifiers.sandbox_entry import decode, encode


@pytest.fixture(scope="module")
def verifier():
    v = CodeVerifier(workers=2, test_timeout_s=1.5, program_timeout_s=10.0)
    v.start()
    yield v
    v.close()


def test_the_program_is_the_last_fenced_block_or_the_whole_response():
    assert extract_program("text\n```python\na = 1\n```\nmore\n```\nb = 2\n```\n") == "b = 2\n"
    assert extract_program("```py\nx = 1\n") == "x = 1\n"  # cut at the length limit: to the end
    assert extract_program("def f():\n    return 1") == "def f():\n    return 1"
    assert extract_program("```python\n\n```") is None
    assert extract_program("   ") is None


def test_the_two_test_forms_and_their_fields():
    calls = CodeTests.from_row({"tests": ["assert f(1) == 2"], "entry_point": "f", "setup": "import math"})
    assert not calls.stdio and calls.tests == ("assert f(1) == 2",) and calls.setup == "import math"
    apps = CodeTests.from_row({"tests": {"inputs": ["1\n", "2\n"], "outputs": ["2\n", "4\n"]}})
    assert apps.stdio and apps.tests == (("1\n", "2\n"), ("2\n", "4\n"))
    verl = CodeTests.from_row({"ground_truth": '{"inputs": ["3"], "outputs": ["9"]}'})
    assert verl.stdio and verl.tests == (("3", "9"),)
    assert CodeTests.from_row({"test_list": ["assert g() == 1", "assert g() != 2"]}, max_tests=1).tests == (
        "assert g() == 1",
    )
    for row, field in (
        ({}, "'tests'"),
        ({"tests": ["assert ("]}, "'tests'[0]"),
        ({"tests": ["x"], "entry_point": "a b"}, "'entry_point'"),
    ):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            CodeTests.from_row(row)


def test_check_problem_names_the_field(verifier):
    assert verifier.check_problem(Problem("p", "x", extra={"tests": ["assert True"]})) is None
    assert "field 'tests' is missing" in verifier.check_problem(Problem("p", "x", answer="3"))


def test_data_crosses_only_as_data():
    value = [1, 2.5, float("inf"), (1, "a"), {1: {2, 3}}, frozenset({4}), b"\x00", None, True, 3 + 4j]
    assert decode(encode(value)) == value
    for bad in (object(), lambda: 1, type("L", (list,), {})()):
        with pytest.raises(TypeError):
            encode(bad)
    always_equal = type("I", (int,), {"__eq__": lambda self, other: True, "__hash__": int.__hash__})(3)
    assert (
        type(decode(encode(always_equal))) is int and decode(encode(always_equal)) != 4
    )  # its value, not its __eq__
    for hostile in ({"l": "x"}, {"x": 1}, {"f": "1e999"}, {"d": [[1]]}):
        with pytest.raises(ValueError):
            decode(hostile)


def test_output_comparison_ignores_trailing_white_space_only():
    assert same_output("1 2 \n3\n\n", "1 2\n3")
    assert same_output("a\r\nb\r\n", "a\nb\n")
    assert not same_output("1\n2\n", "1 2\n")
    assert not same_output(" 1\n", "1\n")


PROGRAMS = {
    "right": "def f(x):\n    return x * x\n\nimport sys\nif __name__ == '__main__':\n    print(f(int(sys.stdin.read())))\n",
    "wrong": "def f(x):\n    return x + x\n\nimport sys\nif __name__ == '__main__':\n    print(f(int(sys.stdin.read())))\n",
    "partly": "def f(x):\n    return x * x if x < 3 else 0\n\nimport sys\nif __name__ == '__main__':\n    print(f(int(sys.stdin.read())))\n",
    "slow": "import time\ndef f(x):\n    if x == 2:\n        time.sleep(60)\n    return x * x\n\nimport sys\nif __name__ == '__main__':\n    print(f(int(sys.stdin.read())))\n",
    "crashing": "def f(x):\n    if x == 3:\n        raise ValueError('three')\n    return x * x\n\nimport sys\nif __name__ == '__main__':\n    print(f(int(sys.stdin.read())))\n",
}
INPUTS = (1, 2, 3, 4)


def reference_fraction(program: str, stdio: bool) -> float:
    """The same tests run plainly (no sandbox, trusted programs only), one process per test."""
    passed = 0
    for x in INPUTS:
        try:
            if stdio:
                run = subprocess.run(
                    [sys.executable, "-c", program],
                    input=f"{x}\n",
                    capture_output=True,
                    text=True,
                    timeout=1.5,
                )
                passed += run.returncode == 0 and run.stdout.strip() == str(x * x)
            else:
                script = (
                    "import sys\nns = {'__name__': 'solution'}\nexec(sys.argv[1], ns)\nexec(sys.argv[2], ns)"
                )
                test = f"assert f({x}) == {x * x}"
                run = subprocess.run(
                    [sys.executable, "-c", script, program, test], capture_output=True, timeout=1.5
                )
                passed += run.returncode == 0
        except subprocess.TimeoutExpired:
            pass
    return passed / len(INPUTS)


@pytest.mark.parametrize("stdio", [False, True], ids=["asserts", "stdio"])
def test_agrees_with_a_plain_reference_run(verifier, stdio):
    if stdio:
        problem = Problem(
            "sq", "x", extra={"tests": [{"input": f"{x}\n", "output": f"{x * x}\n"} for x in INPUTS]}
        )
    else:
        problem = Problem("sq", "x", extra={"tests": [f"assert f({x}) == {x * x}" for x in INPUTS]})
    names = list(PROGRAMS)
    verdicts = verifier.verify([PROGRAMS[n] for n in names], [problem] * len(names))
    got = {n: v.reward for n, v in zip(names, verdicts, strict=True)}
    assert got == {n: reference_fraction(PROGRAMS[n], stdio) for n in names}
    assert got == {"right": 1.0, "wrong": 0.25, "partly": 0.5, "slow": 0.75, "crashing": 0.75}
    failures = {n: v.failure for n, v in zip(names, verdicts, strict=True)}
    assert failures["right"] is None and failures["wrong"] == TESTS_FAILED and failures["slow"] == TIMEOUT


def test_without_partial_credit_a_program_scores_all_or_nothing():
    """`reward.code.partial_credit: false`: the same programs as the reference run score 1 or 0,
    with the same failure classes and the count of passed tests still in the reason."""
    reward = RewardConfig(kind="code", workers=2, code={"test_timeout_s": 1.5, "partial_credit": False})
    verifier = build_verifier(reward)
    verifier.start()
    problem = Problem("sq", "x", extra={"tests": [f"assert f({x}) == {x * x}" for x in INPUTS]})
    names = list(PROGRAMS)
    try:
        verdicts = verifier.verify([PROGRAMS[n] for n in names], [problem] * len(names))
    finally:
        verifier.close()
    got = {n: v.reward for n, v in zip(names, verdicts, strict=True)}
    assert got == {"right": 1.0, "wrong": 0.0, "partly": 0.0, "slow": 0.0, "crashing": 0.0}
    by_name = dict(zip(names, verdicts, strict=True))
    assert by_name["slow"].failure == TIMEOUT and "3 of 4 tests passed" in by_name["slow"].reason
    assert by_name["partly"].failure == TESTS_FAILED and "2 of 4 tests passed" in by_name["partly"].reason


def test_humaneval_and_mbpp_rows(verifier):
    humaneval = Problem(
        "he", "x",
        extra={"test": "def check(candidate):\n    assert candidate([1, 2]) == [2, 1]\n    assert candidate([]) == []\n",
               "entry_point": "rev"},
    )  # fmt: skip
    mbpp = Problem("mbpp", "x", extra={"test_list": ["assert rev([3]) == [3]", "assert rev((1, 2)) == [2, 1]"],
                                      "test_setup_code": "import math"})  # fmt: skip
    program = "```python\ndef rev(xs):\n    return list(xs)[::-1]\n```"
    wrong_name = "def reverse(xs):\n    return list(xs)[::-1]"
    v = verifier.verify([program, program, wrong_name], [humaneval, mbpp, humaneval])
    assert [x.reward for x in v] == [1.0, 1.0, 0.0]
    assert "defines no function 'rev'" in v[2].reason


def test_exceptions_cross_as_their_builtin_type(verifier):
    problem = Problem("raise", "x", extra={"tests": [
        "try:\n    f(-1)\n    raise AssertionError('no error')\nexcept ValueError:\n    pass",
        "assert f(2) == 4",
    ]})  # fmt: skip
    program = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x * x"
    assert verifier.rewards([program], [problem]) == [1.0]


def test_identical_pairs_run_once(verifier):
    problem = Problem("cache", "x", extra={"tests": ["assert g() == 7"]})
    before = verifier.stats()
    rewards = verifier.rewards(["def g():\n    return 7"] * 6 + ["def g(): return 8"], [problem] * 7)
    after = verifier.stats()
    assert rewards == [1.0] * 6 + [0.0]
    assert after["programs"] - before["programs"] == 2
    assert after["cache_hits"] - before["cache_hits"] == 5
    assert verifier.rewards(["def g():\n    return 7"], [problem]) == [1.0]
    assert verifier.stats()["programs"] == after["programs"]  # the verdict was kept


def test_no_code_and_syntax_errors(verifier):
    problem = Problem("p", "x", extra={"tests": ["assert h() == 1"]})
    v = verifier.verify(["", "def h(:\n  pass", "```\n```"], [problem] * 3)
    assert [x.failure for x in v] == [NO_CODE, SYNTAX_ERROR, NO_CODE]


def test_the_calls_deadline_bounds_a_flood_of_slow_programs():
    v = CodeVerifier(workers=1, test_timeout_s=5.0, program_timeout_s=5.0, deadline_s=1.5)
    problem = Problem("slow", "x", extra={"tests": ["assert f() == 1"]})
    started = time.monotonic()
    verdicts = v.verify(
        [f"import time\ndef f():\n    time.sleep(30)  # {i}" for i in range(6)], [problem] * 6
    )
    v.close()
    assert time.monotonic() - started < 5.0
    assert all(x.reward == 0.0 and x.failure == TIMEOUT for x in verdicts)
    assert v.stats()["deadline_skips"] >= 4


def test_a_missing_sandbox_is_refused_in_one_line_naming_the_setting(monkeypatch):
    monkeypatch.setattr(sandbox_module, "bwrap_executable", lambda: None)
    with pytest.raises(VerifierError, match=r"reward\.sandbox: none"):
        build_verifier(RewardConfig(kind="code"))


def test_a_broken_sandbox_fails_the_start_up_check(monkeypatch):
    v = CodeVerifier()
    monkeypatch.setattr(v.sandbox, "bwrap", "/bin/false")
    with pytest.raises(VerifierError, match=r"self-check failed.*reward\.sandbox: none"):
        v.start()
    v.close()


def test_no_isolation_warns_on_every_start():
    v = CodeVerifier(isolation="none")
    for _ in range(2):
        with pytest.warns(UserWarning, match="WITHOUT isolation"):
            v.start()
    assert v.rewards(
        ["def f():\n    return 2"], [Problem("p", "x", extra={"tests": ["assert f() == 2"]})]
    ) == [1.0]
    v.close()
