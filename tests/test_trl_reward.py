"""`graftrl.integrations.trl.math_reward` without TRL (default tier): the rewards `graftrl train`
gives, for TRL's plain and conversational completions, with a one-line error for a missing column."""

from __future__ import annotations

import pytest

from graftrl.integrations.trl import TRLIntegrationError, math_reward
from graftrl.models.rewards import MathVerifier, shared_verifier


def test_math_reward_scores_as_graftrl_train():
    completions = [
        "so the sum is \\boxed{12}.",
        "\\boxed{11} no wait \\boxed{13}",  # the last box counts
        "twelve",  # no box: 0
        "\\boxed{\\frac{2}{4}}",
        "\\boxed{0.5}",
    ]
    answers = ["12", "11", "12", "\\frac{1}{2}", "1/2"]
    rewards = math_reward(completions, answer=answers, prompts=["p"] * 5)
    with MathVerifier() as verifier:
        assert rewards == verifier.score(completions, answers) == [1.0, 0.0, 0.0, 1.0, 1.0]
    # TRL hands conversational completions as message lists: the last message's content counts
    chat = [[{"role": "assistant", "content": "\\boxed{7}"}], [{"role": "assistant", "content": "8"}]]
    assert math_reward(chat, answer=[7, "7"]) == [1.0, 0.0]
    assert math_reward.__name__ == "math_reward"  # TRL logs rewards/<name>
    assert shared_verifier() is shared_verifier(5.0)  # one verifier per process, not one per batch


def test_math_reward_needs_an_answer_column():
    with pytest.raises(TRLIntegrationError, match="no `answer` column"):
        math_reward(["\\boxed{1}"], solution=["1"])
    with pytest.raises(TRLIntegrationError, match="takes text or a list of messages"):
        math_reward([42], answer=["42"])
