"""``math_reward``: a TRL reward function that scores as ``graftrl train`` does.

The reward of a completion is 1.0 iff math_verify judges the content of its last ``\\boxed{}``
equal to the row's gold ``answer`` (``reward.extraction: last_box``, the default of a graftrl
run), else 0.0: the 0/1 rewards that ``RecordingGRPOTrainer`` stores and ``GraftGRPOTrainer``
re-verifies. It needs no TRL import. Verification runs in graftrl's verifier worker processes
(``graftrl.models.rewards.shared_verifier``: a hanging answer costs a 0, never the run), which
start with ``spawn``, so a script that trains with it needs the ``if __name__ == "__main__":``
guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graftrl.integrations.trl._compat import TRLIntegrationError
from graftrl.models.rewards import shared_verifier


def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a string, or a conversation's last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TRLIntegrationError(
        f"math_reward: a completion is a {type(completion).__name__}; it takes text or a list of messages"
    )


def math_reward(
    completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float]:
    """TRL reward function: 1.0 where a completion's last ``\\boxed{}`` equals the row's ``answer``.

    Pass it as ``reward_funcs=math_reward``; TRL hands it the dataset's ``answer`` column (the gold
    answer of each prompt, e.g. ``"42"`` or ``"\\frac{1}{2}"``) beside the completions.
    """
    if answer is None:
        raise TRLIntegrationError(
            "math_reward: the dataset has no `answer` column; add one with each prompt's gold answer"
        )
    return shared_verifier().score([completion_text(c) for c in completions], [str(a) for a in answer])
