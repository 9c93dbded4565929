"""Training methods, one module each, on the shared protocol of ``base``.

The methods: ``grpo``, ``graft``, ``sgt``, ``hacpo``, ``luffy``, ``pooling``, ``hint`` (CoRe's rescue
round: the peer in the prompt); besides them
``loss_metrics`` (the metrics a loss logs: sums and counts) and ``receive`` (the receiver's side
of a transfer: likelihoods under both models and the weight).

Importing this package imports every module in it, so a method registers itself just by living
here (``methods/<name>.py`` with a ``@register_method`` class): nothing else names it.
"""

import importlib
import pkgutil

from graftrl.methods.base import (
    DEFAULT_METHOD,
    METHODS,
    ClippedSurrogate,
    ConfigSection,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    Method,
    PeerLikelihoods,
    RescuePhase,
    RescueTarget,
    RowOrigins,
    TrainGroup,
    TrainSettings,
    build_method,
    own_groups,
    register_method,
)

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "ClippedSurrogate",
    "ConfigSection",
    "ExchangePlan",
    "GroupOutcomes",
    "LossInputs",
    "Method",
    "PeerLikelihoods",
    "RescuePhase",
    "RescueTarget",
    "RowOrigins",
    "TrainGroup",
    "TrainSettings",
    "build_method",
    "own_groups",
    "register_method",
]
