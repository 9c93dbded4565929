"""What the code verifier judges, apart from running it: the program of a response, a row's tests
in either form (``CodeTests``), a test's result, and the verdict those results make (``summarise``).

Pure functions, no process is started here (``graftrl.verifiers.code`` runs the programs in the
sandbox); they are the pieces a trainer of one's own can reuse to read code rows and score results.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from graftrl.verifiers.base import CRASH, MEMORY, SYNTAX_ERROR, TESTS_FAILED, TIMEOUT, Verdict

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)

PASS, FAIL = "pass", "fail"
"""A test's outcomes besides ``timeout``, ``crash`` and ``memory`` (the failure classes)."""


def extract_program(response: str) -> str | None:
    """The last fenced code block, else the whole response; None when that is blank."""
    blocks = _FENCE.findall(response)
    program = blocks[-1] if blocks else response
    return program if program.strip() else None


@dataclass(frozen=True)
class CodeTests:
    """A problem's tests, in one of the two forms."""

    stdio: bool
    """True: stdin/stdout pairs; False: assert statements."""
    tests: tuple[Any, ...]
    """Assert-statement strings, or (input, output) pairs."""
    entry_point: str | None = None
    setup: str | None = None

    @classmethod
    def from_row(cls, extra: Mapping[str, Any], max_tests: int | None = None) -> CodeTests:
        """The suite of a row; ValueError naming the field when there is none usable."""
        raw = next(
            (extra[k] for k in ("tests", "test_list", "test") if extra.get(k) not in (None, "", [])), None
        )
        if raw is None:
            raw = _tests_in_ground_truth(extra.get("ground_truth"))
        if raw is None:
            raise ValueError(
                "field 'tests' is missing: reward.kind 'code' needs a list of assert statements or "
                "of {input, output} pairs (or a HumanEval 'test' with 'entry_point')"
            )
        if isinstance(raw, str):
            raw = [raw]
        if isinstance(raw, Mapping) and "inputs" in raw and "outputs" in raw:
            raw = [{"input": i, "output": o} for i, o in zip(raw["inputs"], raw["outputs"], strict=False)]
        if not isinstance(raw, list) or not raw:
            raise ValueError(
                "field 'tests' must be a non-empty list of assert statements or {input, output} pairs"
            )
        entry = extra.get("entry_point")
        setup = extra.get("setup") or extra.get("test_setup_code") or None
        if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            raise ValueError(f"field 'entry_point' must be a function name, got {entry!r}")
        if setup is not None and not isinstance(setup, str):
            raise ValueError("field 'setup' must be a string of Python statements")
        if all(isinstance(t, str) for t in raw):
            for index, test in enumerate(raw):
                try:
                    compile(test, f"test {index}", "exec")
                except SyntaxError as exc:
                    raise ValueError(f"field 'tests'[{index}] is not valid Python ({exc.msg})") from None
            tests: tuple[Any, ...] = tuple(raw)
            stdio = False
        elif all(isinstance(t, Mapping) and "input" in t and "output" in t for t in raw):
            tests = tuple((_text(t["input"]), _text(t["output"])) for t in raw)
            stdio = True
        else:
            raise ValueError(
                "field 'tests' mixes forms: use only assert strings, or only {input, output} pairs"
            )
        return cls(stdio, tests[:max_tests] if max_tests else tests, entry, setup)

    def key(self) -> str:
        return json.dumps([self.stdio, list(self.tests), self.entry_point, self.setup])

    def judge_dict(self, start: int) -> dict[str, Any]:
        """What the judge runs: the tests from ``start`` on, the entry point and the setup."""
        return {"tests": list(self.tests[start:]), "entry_point": self.entry_point, "setup": self.setup}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _tests_in_ground_truth(ground_truth: Any) -> Any:
    """verl's code rows keep {"inputs", "outputs"} (or a JSON string of it) in ``ground_truth``."""
    if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError:
            return None
    if isinstance(ground_truth, Mapping) and "inputs" in ground_truth and "outputs" in ground_truth:
        return ground_truth
    return None


@dataclass(frozen=True)
class TestResult:
    index: int
    outcome: str
    """``pass``, ``fail``, ``timeout``, ``crash`` or ``memory``."""
    detail: str = ""


def same_output(got: str, expected: str) -> bool:
    """Line by line, trailing white space and trailing blank lines ignored."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def summarise(load: str, results: Sequence[TestResult], total: int, partial_credit: bool = True) -> Verdict:
    """The verdict of a program from its load outcome and its tests' results; a program that fails
    some tests scores the fraction it passed, or 0 without ``partial_credit``."""
    if load != "ok":
        detail = results[0].detail if results else ""
        failure = {SYNTAX_ERROR: SYNTAX_ERROR, MEMORY: MEMORY, TIMEOUT: TIMEOUT}.get(load, CRASH)
        words = {
            SYNTAX_ERROR: "syntax error",
            MEMORY: "out of memory while loading",
            TIMEOUT: "timeout while loading",
        }
        return Verdict.failed(failure, f"{words.get(load, 'crash while loading')}: {detail}".rstrip(": "))
    if results and results[0].outcome == SYNTAX_ERROR:
        return Verdict.failed(SYNTAX_ERROR, f"syntax error: {results[0].detail}".rstrip(": "))
    passed = sum(r.outcome == PASS for r in results)
    if passed == total:
        return Verdict.correct(1.0, f"{total} of {total} tests passed")
    outcomes = {r.outcome for r in results}
    failure = next((c for c in (TIMEOUT, MEMORY, CRASH) if c in outcomes), TESTS_FAILED)
    if len(results) < total and failure == TESTS_FAILED:
        failure = TIMEOUT  # the program's time ran out before every test ran
    first = next((r for r in results if r.outcome != PASS), None)
    where = (
        f"; test {first.index}: {first.outcome}" + (f" ({first.detail})" if first.detail else "")
        if first
        else ""
    )
    if len(results) < total:
        where += f"; {total - len(results)} not run (reward.code.program_timeout_s)"
    reward = passed / total if partial_credit else 0.0
    return Verdict.failed(failure, f"{passed} of {total} tests passed{where}", reward)
