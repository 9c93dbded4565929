"""What every verifier is: responses and their problem rows in, one ``Verdict`` each out.

A verifier turns a response into a reward in [0, 1] and says why (``Verdict.reason``), with a
failure class that ``graftrl analyze`` and ``graftrl verify`` count. It never runs a response in
the calling process: math answers are parsed in killable worker processes, code runs in an OS
sandbox, a user's scorer in worker processes. One is built per run from the ``reward`` section
(``build_verifier``) and used by training, the probe, evaluation, stored and served peers, and TRL.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from graftrl.errors import UserError
from graftrl.storage.data import Problem


class VerifierError(UserError):
    """The verifier cannot work as configured (a scorer that does not load, a sandbox that cannot
    start); one line naming the setting and the fix, raised before any model loads."""


# Failure classes (``Verdict.failure``): one word each, counted by analyze and verify.
WRONG = "wrong"
"""An answer was found and is not the gold one (math, match, a scorer's 0)."""
NO_ANSWER = "no_answer"
"""No answer to compare: no box, no line, nothing after "Answer:"."""
TESTS_FAILED = "tests_failed"
"""Code: the program ran and failed at least one test (no timeout or crash decided it)."""
NO_CODE = "no_code"
"""Code: the response holds no program (empty, or an empty code block)."""
SYNTAX_ERROR = "syntax_error"
"""Code: the program does not compile."""
TIMEOUT = "timeout"
"""The answer, program or scorer ran past its time budget."""
MEMORY = "memory"
"""Code: the program ran out of its memory limit."""
CRASH = "crash"
"""Code: the program raised, exited or was killed on a test (other than timeout or memory)."""
ERROR = "error"
"""The verifier itself failed on this response (a scorer that raised, a sandbox that broke)."""
FAILURE_CLASSES = (WRONG, NO_ANSWER, TESTS_FAILED, NO_CODE, SYNTAX_ERROR, TIMEOUT, MEMORY, CRASH, ERROR)


@dataclass(frozen=True)
class Verdict:
    """One response's score and its reason."""

    reward: float
    """Math and match 0/1, code the fraction of tests passed (in [0, 1]), a scorer what it returned."""
    reason: str
    """For people: ``correct``, ``3 of 5 tests passed``, ``timeout on test 2``, ``no code found``."""
    failure: str | None = None
    """One of ``FAILURE_CLASSES`` when the response is not a full success, else None."""

    @classmethod
    def correct(cls, reward: float = 1.0, reason: str = "correct") -> Verdict:
        return cls(reward, reason, None)

    @classmethod
    def failed(cls, failure: str, reason: str, reward: float = 0.0) -> Verdict:
        return cls(reward, reason, failure)


@runtime_checkable
class Verifier(Protocol):
    """The interface of ``reward.kind``'s verifier (``graftrl.verifiers.VERIFIERS``)."""

    kind: ClassVar[str]

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        """One verdict per response; ``problems[i]`` is the row ``responses[i]`` answers (repeat a
        problem for each of its samples)."""
        ...

    def rewards(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """``[v.reward for v in verify(...)]``: what training uses (its failures are counted)."""
        ...

    def failure_counts(self) -> dict[str, int]:
        """Responses scored through ``rewards`` since construction, per failure class."""
        ...

    def check_problem(self, problem: Problem) -> str | None:
        """Why this verifier cannot use the row (naming the field and the fix), else None."""
        ...

    def start(self) -> None:
        """Start workers and run the start-up self-check (code: a tiny known program in the
        sandbox), so a broken set-up is found before step 0. Raises ``VerifierError``."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since construction (answers, cache hits, timeouts, ..., seconds)."""
        ...

    def close(self) -> None:
        """Stop workers; idempotent."""
        ...


class VerifierBase:
    """Shared plumbing: ``rewards`` from ``verify``, context manager, no row check."""

    kind: ClassVar[str] = ""

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        raise NotImplementedError

    def rewards(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        verdicts = self.verify(responses, problems)
        counts = self.__dict__.setdefault("_failure_counts", Counter())
        counts.update(v.failure for v in verdicts if v.failure is not None)
        return [v.reward for v in verdicts]

    def failure_counts(self) -> dict[str, int]:
        return dict(self.__dict__.get("_failure_counts", {}))

    def check_problem(self, problem: Problem) -> str | None:
        return None

    def start(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_lengths(name: str, responses: Sequence[Any], problems: Sequence[Any]) -> None:
    if len(responses) != len(problems):
        raise ValueError(
            f"{name}: got {len(responses)} responses but {len(problems)} problems "
            "(pass one problem per response, repeating it for each sample of a prompt)"
        )
