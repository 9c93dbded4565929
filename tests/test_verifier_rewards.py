"""graftrl's verifiers as TRL reward functions (`graftrl.integrations.trl.verifier_reward`,
`code_reward`, `match_reward`), called as TRL calls them: prompts, completions (plain or
conversational) and every dataset column as per-row lists, beside TRL's own keyword arguments.
No TRL needed (default tier). The hostile program runs in the bubblewrap sandbox (the default)."""

from __future__ import annotations

import json
import os

import pytest

from graftrl.config import RewardConfig
from graftrl.integrations.trl import (
    TRLIntegrationError,
    code_reward,
    match_reward,
    math_reward,
    verifier_reward,
)
from graftrl.integrations.trl.rewards import shared_reward_verifier

SECRET = "graftrl-trl-secret-93b2"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def trl_call(function, prompts, completions, **columns):
    """As GRPOTrainer calls a reward function: its own arguments beside the dataset's columns."""
    return function(
        prompts=prompts,
        completions=completions,
        completion_ids=[[1, 2, 3]] * len(completions),
        trainer_state=object(),
        **columns,
    )


def test_code_reward_scores_right_partial_and_hostile_programs(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFTRL_SECRET", SECRET)
    planted = tmp_path / "pwned"
    hostile = (
        "```python\nimport os\n"
        f"os.system('curl -s -m 2 http://example.com -o /dev/null; echo pwned > {planted}')\n"
        "print(os.environ.get('GRAFTRL_SECRET', 'no secret here'))\n```"
    )
    prompt = [{"role": "user", "content": "Write add(a, b)."}]
    sum_prompt = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "Echo it."}]
    completions = [
        chat("```python\ndef add(a, b):\n    return a + b\n```"),  # right: 3 of 3
        chat("```python\ndef add(a, b):\n    return abs(a) + b\n```"),  # partly right: 2 of 3
        chat(hostile),  # would print the secret, and leave a file, if it escaped
        chat("no code here\n```python\n```"),  # no code
    ]
    rewards = trl_call(
        code_reward,
        [prompt, prompt, sum_prompt, prompt],
        completions,
        tests=[ADD_TESTS, ADD_TESTS, [{"input": "", "output": SECRET}], ADD_TESTS],
        entry_point=["add", "add", None, "add"],
        data_source=["mbpp"] * 4,
    )
    assert rewards == pytest.approx([1.0, 2 / 3, 0.0, 0.0])
    assert not planted.exists() and not os.path.exists("/tmp/pwned")
    assert code_reward.__name__ == "code_reward"  # TRL logs rewards/code_reward

    # verl's code rows: tests as {"inputs", "outputs"} in reward_model.ground_truth (a JSON string)
    truth = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    rewards = trl_call(
        code_reward,
        ["Sum two ints."] * 2,
        ["print(sum(map(int, input().split())))", "print(1)"],
        reward_model=[{"style": "rule", "ground_truth": truth}] * 2,
        data_source=["codecontests"] * 2,
        extra_info=[{"index": 7}, {"index": 8}],
    )
    assert rewards == [1.0, 0.0]
    # one verifier per process and settings, built on the first call
    assert shared_reward_verifier(code_reward.reward_config) is shared_reward_verifier(
        RewardConfig(kind="code")
    )


def test_code_reward_settings_and_errors():
    tight = verifier_reward({"kind": "code"}, code={"test_timeout_s": 1.0}, workers=2)
    assert tight.__name__ == "code_reward" and tight.reward_config.code.test_timeout_s == 1.0
    slow = "```python\nimport time\ndef add(a, b):\n    time.sleep(20)\n```"
    assert tight(prompts=["p"], completions=[slow], tests=[ADD_TESTS[:1]]) == [0.0]
    with pytest.raises(TRLIntegrationError, match=r"row 0 of the batch: field 'tests' is missing"):
        code_reward(prompts=["p"], completions=["def add(a, b): return a + b"], answer=["3"])
    with pytest.raises(TRLIntegrationError, match=r"verifier_reward: reward\.code\.test_timeout_s"):
        verifier_reward(kind="code", code={"test_timeout_s": -1})
    with pytest.raises(TRLIntegrationError, match=r"code_reward: a completion is a int"):
        code_reward(prompts=["p"], completions=[3], tests=[ADD_TESTS])


def test_match_reward_and_choice():
    rewards = trl_call(
        match_reward,
        ["Capital of France?"] * 4,
        ["It is \\boxed{Paris}.", chat("\\boxed{ paris. }"), "\\boxed{London}", "Paris"],
        answer=["Paris", "Paris", "Paris", "Paris"],
    )
    assert rewards == [1.0, 1.0, 0.0, 0.0]  # the last has no box
    # several golds: the `answers` column
    assert match_reward(
        prompts=["p"], completions=["\\boxed{NYC}"], answer=["New York"], answers=[["NYC"]]
    ) == [1.0]
    choice = verifier_reward(kind="match", match={"mode": "choice", "extract": "whole"})
    assert choice.__name__ == "match_reward"
    got = choice(prompts=["q", "q"], completions=["The answer is (B).", "A"], solution=["B", "(B)"])
    assert got == [1.0, 0.0]
    with pytest.raises(
        TRLIntegrationError, match=r"match_reward: .*row 0 of the batch: missing field 'answer'"
    ):
        match_reward(prompts=["p"], completions=["\\boxed{1}"])


def test_math_reward_is_unchanged_and_math_is_the_default_kind():
    assert math_reward(["\\boxed{12}", "\\boxed{11}"], answer=["12", "12"]) == [1.0, 0.0]
    default = verifier_reward()
    assert default.__name__ == "math_reward" == math_reward.__name__
    assert default(prompts=["p", "p"], completions=["\\boxed{12}", "\\boxed{11}"], answer=["12", 12]) == [
        1.0,
        0.0,
    ]
