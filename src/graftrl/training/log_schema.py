"""Every key a run's metrics.jsonl may hold: the trainer's own (``storage.log_keys.METRIC_KEYS``)
and the loss metrics each registered method declares (``Method.loss_metrics``), so a method
module declares its measurements where it computes them and ``graftrl metrics-reference``, the
sinks and the undeclared-key guard of the tests all see them."""

from __future__ import annotations

from graftrl.methods import METHODS
from graftrl.methods.loss_metrics import LossMetric
from graftrl.storage.log_keys import METRIC_KEYS, LogKey


def loss_metric_keys() -> tuple[LogKey, ...]:
    """One key per loss metric of the registered methods, in registration order; its group names
    the methods whose loss logs it. A key two methods declare must be the same declaration."""
    declared: dict[str, LossMetric] = {}
    methods: dict[str, list[str]] = {}
    for name, method in METHODS.items():
        for metric in method.loss_metrics:
            first = declared.setdefault(metric.key, metric)
            if first != metric:
                raise ValueError(
                    f"loss metric {metric.key!r} is declared twice, differently (method {name!r} and "
                    f"{methods[metric.key][0]!r}): share one LossMetric"
                )
            methods.setdefault(metric.key, []).append(name)
    everyone = len(methods) and len(METHODS)
    return tuple(
        LogKey(
            metric.key,
            metric.meaning,
            metric.unit,
            "loss: every method" if len(methods[key]) == everyone else "loss: " + ", ".join(methods[key]),
        )
        for key, metric in declared.items()
    )


def metric_keys() -> tuple[LogKey, ...]:
    """Every declared key of a metrics.jsonl row."""
    return METRIC_KEYS + loss_metric_keys()
