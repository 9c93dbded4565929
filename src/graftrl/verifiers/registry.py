"""``reward.kind`` -> the verifier class, and the one function that builds a run's verifier."""

from __future__ import annotations

import importlib
from typing import Any

from graftrl.verifiers.base import Verifier

VERIFIERS: dict[str, str] = {
    "math": "graftrl.verifiers.math:MathRewards",
    "match": "graftrl.verifiers.match:MatchVerifier",
    "function": "graftrl.verifiers.function:FunctionVerifier",
    "code": "graftrl.verifiers.code:CodeVerifier",
}
"""Kind -> ``module:Class``, imported on use (a math run never imports the sandbox)."""


def verifier_class(kind: str) -> Any:
    if kind not in VERIFIERS:
        raise ValueError(f"reward.kind: unknown verifier {kind!r}; choose one of {sorted(VERIFIERS)}")
    module, name = VERIFIERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def build_verifier(reward: Any) -> Verifier:
    """The verifier of a run's ``reward`` section (``graftrl.config.RewardConfig``), not started:
    call ``start()`` before any model loads so that a broken set-up fails first."""
    return verifier_class(reward.kind).from_config(reward)
