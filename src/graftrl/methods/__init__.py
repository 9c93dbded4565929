"""Training methods, one module each, on the shared protocol of ``base``."""

from graftrl.methods import graft, grpo  # noqa: F401  (registers the methods)
from graftrl.methods.base import METHODS, ExchangePlan, GroupOutcomes, Method, build_method, register_method

__all__ = ["METHODS", "ExchangePlan", "GroupOutcomes", "Method", "build_method", "register_method"]
