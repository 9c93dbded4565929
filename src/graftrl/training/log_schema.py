"""Every key a run's metrics.jsonl may hold: the trainer's own (``storage.log_keys.METRIC_KEYS``),
the plan diagnostics each registered method declares (``Method.plan_keys``) and its loss metrics
(``Method.loss_metrics``), so a method module declares its measurements where it computes them
and ``graftrl metrics-reference``, the sinks and the undeclared-key guard of the tests all see
them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from graftrl.methods import METHODS, Method
from graftrl.methods.loss_metrics import LossMetric, PlanKey
from graftrl.storage.log_keys import METRIC_KEYS, LogKey


def _method_keys(
    kind: str, declarations: Callable[[type[Method]], Iterable[LossMetric | PlanKey]]
) -> tuple[LogKey, ...]:
    """One key per declaration of the registered methods, in registration order; its group names
    the methods that log it (``<kind>: graft, luffy``). A key two methods declare must be the
    same declaration."""
    declared: dict[str, LossMetric | PlanKey] = {}
    methods: dict[str, list[str]] = {}
    for name, method in METHODS.items():
        for entry in declarations(method):
            key = entry.key if isinstance(entry, LossMetric) else entry.name
            first = declared.setdefault(key, entry)
            if first != entry:
                raise ValueError(
                    f"{kind} metric {key!r} is declared twice, differently (method {name!r} and "
                    f"{methods[key][0]!r}): share one declaration"
                )
            methods.setdefault(key, []).append(name)
    everyone = len(METHODS)
    return tuple(
        LogKey(
            key,
            entry.meaning,
            entry.unit,
            f"{kind}: every method"
            if len(methods[key]) == everyone
            else f"{kind}: " + ", ".join(methods[key]),
        )
        for key, entry in declared.items()
    )


def plan_metric_keys() -> tuple[LogKey, ...]:
    """One key per plan diagnostic of the registered methods (``Method.plan_keys``)."""
    return _method_keys("plan", lambda method: method.plan_keys)


def loss_metric_keys() -> tuple[LogKey, ...]:
    """One key per loss metric of the registered methods (``Method.loss_metrics``)."""
    return _method_keys("loss", lambda method: method.loss_metrics)


def metric_keys() -> tuple[LogKey, ...]:
    """Every declared key of a metrics.jsonl row."""
    return METRIC_KEYS + plan_metric_keys() + loss_metric_keys()
