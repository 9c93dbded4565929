"""``reward.kind`` -> the verifier class; the one function that builds a run's verifier
(``build_verifier``), the rule of when it starts (``start_verifier``) and a caller's verifier as
the interface (``as_verifier``)."""

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


def start_verifier(verifier: Verifier, kind: str) -> Verifier:
    """Start the run's verifier now (its workers and start-up self-check) unless ``kind`` is
    ``math``, so that a broken set-up (a sandbox that cannot start, a scorer that does not load) is
    refused in one line (``VerifierError``) before any model loads. Math's workers start with its
    first batch, as they always have: math_verify has no set-up to check, and starting them early
    would cost every trainer built and refused before a step (the tests' many) a second. A
    verifier that fails to start is closed."""
    if kind == "math":
        return verifier
    try:
        verifier.start()
    except BaseException:
        verifier.close()
        raise
    return verifier


def as_verifier(verifier: Any) -> Any:
    """A caller's verifier as the ``Verifier`` interface: one with ``rewards`` as it is; an object
    with the scorer interface of before (``score(responses, answers)``: a ``MathVerifier``, a
    test's fixed rewards) behind ``MathRewards``, which gives it each problem's gold answer; None
    stays None (the callee builds the run's own)."""
    if verifier is None or callable(getattr(verifier, "rewards", None)):
        return verifier
    if callable(getattr(verifier, "score", None)):
        from graftrl.verifiers.math import MathRewards

        return MathRewards(verifier)
    raise TypeError(
        f"{type(verifier).__name__} is not a verifier: it needs rewards(responses, problems) "
        "(graftrl.verifiers.Verifier) or score(responses, answers)"
    )
