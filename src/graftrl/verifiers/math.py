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

    @classmethod
    def from_config(cls, reward: Any) -> MathRewards:
        return cls(MathVerifier.from_config(reward))

    def rewards(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        check_lengths("MathRewards.rewards", responses, problems)
        return self.verifier.score(responses, [p.answer for p in problems])

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        verdicts = []
        for response, reward, problem in zip(
            responses, self.rewards(responses, problems), problems, strict=True
        ):
            if reward >= 1.0:
                verdicts.append(Verdict.correct())
                continue
            answer = extract_last_boxed(response) if self.verifier.extraction == "last_box" else response
            if answer is None or not answer.strip():
                verdicts.append(Verdict.failed(NO_ANSWER, "no answer found (no \\boxed{})"))
            else:
                verdicts.append(
                    Verdict.failed(WRONG, f"wrong: answered {answer[:60]!r}, gold {problem.answer!r}")
                )
        return verdicts

    def check_problem(self, problem: Problem) -> str | None:
        if not problem.answer.strip():
            return "field 'answer' is empty: reward.kind 'math' compares each response with a gold answer"
        return None

    def start(self) -> None:
        self.verifier.start()

    def stats(self) -> dict[str, float]:
        return self.verifier.stats()

    def close(self) -> None:
        self.verifier.close()
