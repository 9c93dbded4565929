"""Training methods, one module each, on the shared protocol of ``base``."""

from graftrl.methods import graft, grpo, hacpo, luffy, pooling, sgt  # noqa: F401  (registers the methods)
from graftrl.methods.base import (
    METHODS,
    ClippedSurrogate,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    Method,
    TrainGroup,
    build_method,
    own_groups,
    register_method,
    replacement_plan,
)

__all__ = [
    "METHODS",
    "ClippedSurrogate",
    "ExchangePlan",
    "GroupOutcomes",
    "LossInputs",
    "Method",
    "TrainGroup",
    "build_method",
    "own_groups",
    "register_method",
    "replacement_plan",
]
