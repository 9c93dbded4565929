"""TRL reward functions that score as ``graftrl train`` does: ``math_reward``, and any verifier of
``reward.kind`` (``verifier_reward``; ``code_reward``, ``match_reward``).

The reward of a completion is 1.0 iff math_verify judges the content of its last ``\\boxed{}``
equal to the row's gold ``answer`` (``reward.extraction: last_box``, the default of a graftrl
run), else 0.0: the 0/1 rewards that ``RecordingGRPOTrainer`` stores and ``GraftGRPOTrainer``
re-verifies. It needs no TRL import. Verification runs in graftrl's verifier worker processes
(``graftrl.models.rewards.shared_verifier``: a hanging answer costs a 0, never the run), which
start with ``spawn``, so a script that trains with it needs the ``if __name__ == "__main__":``
guard.

``verifier_reward(reward, **settings)`` turns the verifier of a ``reward`` section
(``graftrl.config.RewardConfig``, a dict of it, or keyword settings such as ``kind="code"``) into a
TRL reward function: each completion and its dataset row (TRL passes every column of the dataset
beside the completions: ``answer``, ``solution``, ``tests``, ``entry_point``, verl's
``data_source``, ``reward_model`` and ``extra_info``, ...) become a response and a ``Problem`` by the
rules of ``graftrl.storage.data_formats``, and the verifier scores them: code in graftrl's OS
sandbox (``reward.sandbox``), never in the trainer's process. The verifier is built and started
(its self-check) once per process and settings, on the first call, and closed at exit.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from graftrl.config.rewards import RewardConfig
from graftrl.integrations.trl._compat import TRLIntegrationError
from graftrl.models.rewards import shared_verifier

RewardFunction = Callable[..., list[float]]
"""TRL's reward function: ``(prompts, completions, **columns) -> one float per completion``."""

NOT_COLUMNS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
)
"""Keyword arguments TRL passes beside the dataset's columns."""


def completion_text(completion: Any, name: str = "math_reward") -> str:
    """The text of one TRL completion: a string, or a conversation's last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TRLIntegrationError(
        f"{name}: a completion is a {type(completion).__name__}; it takes text or a list of messages"
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


# --------------------------------------------------------------------------------------------
# Any verifier of ``reward.kind``
# --------------------------------------------------------------------------------------------

_verifiers: dict[str, Any] = {}
_verifiers_lock = threading.Lock()


def _reward_config(
    reward: RewardConfig | Mapping[str, Any] | None, settings: Mapping[str, Any]
) -> RewardConfig:
    """``reward`` with ``settings`` merged over it (sub-sections merged key by key), validated."""
    if isinstance(reward, RewardConfig):
        merged: dict[str, Any] = reward.model_dump(exclude_unset=True)
    elif isinstance(reward, Mapping):
        merged = dict(reward)
    elif reward is None:
        merged = {}
    else:
        raise TRLIntegrationError(
            f"verifier_reward: reward is a {type(reward).__name__}; give a RewardConfig, a dict of the "
            "reward section, or keyword settings such as kind='code'"
        )
    for key, value in settings.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    try:
        return RewardConfig.model_validate(merged)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise TRLIntegrationError(
            f"verifier_reward: reward.{where}: {first['msg']} (the fields are graftrl's `reward` section: "
            "graftrl config-reference)"
        ) from None


def shared_reward_verifier(reward: RewardConfig) -> Any:
    """The process's started verifier for these settings (``graftrl.verifiers.build_verifier``),
    built on first use and closed at exit."""
    key = reward.model_dump_json()
    with _verifiers_lock:
        verifier = _verifiers.get(key)
        if verifier is None:
            from graftrl.verifiers.registry import build_verifier

            verifier = build_verifier(reward)
            try:
                verifier.start()
            except BaseException:
                verifier.close()
                raise
            _verifiers[key] = verifier
    return verifier


@atexit.register
def _close_verifiers() -> None:
    for verifier in _verifiers.values():
        verifier.close()
    _verifiers.clear()


def _prompt_text(prompt: Any) -> str:
    """A row's prompt as one text: a string, or chat messages folded as graftrl's data files are
    (``fold_messages``), else their contents joined. Scoring does not depend on it (a user's scorer
    sees it)."""
    from graftrl.storage.data_formats import fold_messages

    if isinstance(prompt, str) and prompt.strip():
        return prompt
    if isinstance(prompt, list | tuple):
        try:
            return fold_messages(list(prompt))
        except ValueError:
            parts = [m.get("content") for m in prompt if isinstance(m, Mapping)]
            text = "\n\n".join(p for p in parts if isinstance(p, str) and p.strip())
            if text:
                return text
    return "(no prompt)"


def trl_problems(
    name: str, prompts: Sequence[Any] | None, count: int, columns: Mapping[str, Any]
) -> list[Any]:
    """One ``Problem`` per completion from TRL's per-row columns (lists as long as the batch),
    read as a data file's row is (``graftrl.storage.data_formats.row_to_problem``)."""
    from graftrl.storage.data import DataError
    from graftrl.storage.data_formats import row_to_problem

    if prompts is not None and len(prompts) != count:
        raise TRLIntegrationError(f"{name}: got {len(prompts)} prompts for {count} completions")
    per_row = {
        key: value
        for key, value in columns.items()
        if key not in NOT_COLUMNS and isinstance(value, list | tuple) and len(value) == count
    }
    problems = []
    for i in range(count):
        record = {key: value[i] for key, value in per_row.items()}
        if record.get("problem") is None:
            record.pop("problem", None)
            record["prompt"] = _prompt_text(prompts[i] if prompts is not None else record.get("prompt"))
        try:
            problems.append(row_to_problem(Path("dataset"), f"row {i} of the batch", i, record))
        except DataError as exc:
            raise TRLIntegrationError(f"{name}: {exc}") from None
    return problems


def verifier_reward(
    reward: RewardConfig | Mapping[str, Any] | None = None, **settings: Any
) -> RewardFunction:
    """A TRL reward function scoring with the verifier of ``reward`` (a ``RewardConfig``, or a dict
    of graftrl's ``reward`` section) and ``settings`` over it (``kind="code"``,
    ``code={"test_timeout_s": 2}``, ``sandbox="bwrap"``, ...).

    Pass it as ``reward_funcs=verifier_reward(kind="code")``; TRL logs it as ``rewards/<kind>_reward``.
    Each completion's row comes from the dataset's columns (code: ``tests`` and an optional
    ``entry_point``, or verl's ``reward_model.ground_truth``; match and math: ``answer`` or
    ``solution``; a scorer gets every column). Code rewards are the fraction of tests passed.
    The settings are checked here; the verifier starts on the first call (a sandbox that cannot
    start fails there, in one line).
    """
    config = _reward_config(reward, settings)
    name = f"{config.kind}_reward"

    def reward_function(
        prompts: Sequence[Any] | None = None, completions: Sequence[Any] | None = None, **columns: Any
    ) -> list[float]:
        if completions is None:
            raise TRLIntegrationError(f"{name}: no completions given (TRL passes completions=...)")
        texts = [completion_text(c, name) for c in completions]
        problems = trl_problems(name, prompts, len(texts), columns)
        verifier = shared_reward_verifier(config)
        for i, problem in enumerate(problems):
            message = verifier.check_problem(problem)
            if message:
                raise TRLIntegrationError(f"{name}: dataset row {i} of the batch: {message}")
        return [float(r) for r in verifier.rewards(texts, problems)]

    reward_function.__name__ = reward_function.__qualname__ = name
    reward_function.__doc__ = f"TRL reward function: graftrl's {config.kind} verifier (``verifier_reward``)."
    reward_function.reward_config = config  # type: ignore[attr-defined]
    return reward_function


code_reward = verifier_reward(kind="code")
"""The code verifier with its defaults: a program (the completion's last fenced block) against
the row's ``tests``, in graftrl's bubblewrap sandbox; the fraction of tests passed. Other settings:
``verifier_reward(kind="code", code={"test_timeout_s": 2}, workers=4)``."""

match_reward = verifier_reward(kind="match")
"""The match verifier with its defaults (the last ``\\boxed{}`` against ``answer`` and ``answers``,
normalised); ``verifier_reward(kind="match", match={"mode": "choice"})`` for multiple choice."""
