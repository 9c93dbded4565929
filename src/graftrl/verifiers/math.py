"""``reward.kind: math``: today's verifier (math_verify in killable worker processes,
``graftrl.models.rewards.MathVerifier``) behind the ``Verifier`` interface, unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from graftrl.models.answers import extract_last_boxed
from graftrl.models.rewards import MathVerifier
from graftrl.storage.data import Problem
from graftrl.verifiers.base import NO_ANSWER, WRONG, Verdict, VerifierBase, check_lengths


class MathRewards(VerifierBase):
    """0/1 rewards from math_verify: is the response's answer (``reward.extraction``) the gold one?"""

    kind: ClassVar[str] = "math"

    def __init__(self, verifier: MathVerifier) -> None:
        self.verifier = verifier
        """The wrapped scorer: a ``MathVerifier``, or any object with its ``score(responses,
        answers)`` (``registry.as_verifier``: a caller's own, such as a test's fixed rewards)."""

    @classmethod
    def from_config(cls, reward: Any) -> MathRewards:
        return cls(MathVerifier.from_config(reward))

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        check_lengths("MathRewards.verify", responses, problems)
        scores = self.verifier.score(responses, [p.answer for p in problems])
        verdicts = []
        for response, reward, problem in zip(responses, scores, problems, strict=True):
            if reward >= 1.0:
                verdicts.append(Verdict.correct(reward))
                continue
            last_box = getattr(self.verifier, "extraction", "last_box") == "last_box"
            answer = extract_last_boxed(response) if last_box else response
            if answer is None or not answer.strip():
                verdicts.append(Verdict.failed(NO_ANSWER, "no answer found (no \\boxed{})", reward))
            else:
                verdicts.append(
                    Verdict.failed(WRONG, f"wrong: answered {answer[:60]!r}, gold {problem.answer!r}", reward)
                )
        return verdicts

    def check_problem(self, problem: Problem) -> str | None:
        if not problem.answer.strip():
            return "field 'answer' is empty: reward.kind 'math' compares each response with a gold answer"
        return None

    def start(self) -> None:
        if callable(start := getattr(self.verifier, "start", None)):
            start()

    def stats(self) -> dict[str, float]:
        stats = getattr(self.verifier, "stats", None)
        return dict(stats()) if callable(stats) else {}

    def close(self) -> None:
        if callable(close := getattr(self.verifier, "close", None)):
            close()

    @property
    def num_workers(self) -> int | None:
        """Worker processes (an evaluation report's ``verification.workers``)."""
        return getattr(self.verifier, "num_workers", None)

    @property
    def timeout_s(self) -> float | None:
        """Per-answer timeout (an evaluation report's ``verification.timeout_s``)."""
        return getattr(self.verifier, "timeout_s", None)
