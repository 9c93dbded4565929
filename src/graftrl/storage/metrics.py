"""Metrics sinks: ``metrics.jsonl`` always; TensorBoard and W&B when asked.

The keys and their meaning are declared once (``graftrl.storage.log_keys.METRIC_KEYS``, and each method's
loss metrics, which the trainer hands in): TensorBoard
gets them as a text table (its TEXT tab), W&B each scalar's declared summary (``define_metric``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graftrl.storage.log_keys import METRIC_KEYS, LogKey, find_key, keys_markdown
from graftrl.storage.rundir import RunDir, append_jsonl


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends one JSON object per (step, model) to ``metrics.jsonl``; mirrors scalars elsewhere."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "graftrl",
        config: dict[str, Any] | None = None,
        keys: Sequence[LogKey] = METRIC_KEYS,
    ) -> None:
        """``keys``: the declared metrics keys (the trainer passes ``training.log_schema.metric_keys``,
        which adds each method's loss metrics)."""
        run = RunDir(run_dir)
        self.keys = tuple(keys)
        self.path = run.metrics
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # pragma: no cover - depends on the extra
                raise RuntimeError("logging.tensorboard needs `pip install -e '.[tensorboard]'`") from error
            self._tb = SummaryWriter(str(run.tensorboard))
            self._tb.add_text("graftrl/metric_keys", keys_markdown(self.keys), 0)
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError as error:  # pragma: no cover - depends on the extra
                raise RuntimeError("logging.wandb needs `pip install -e '.[wandb]'`") from error
            self._wandb = wandb_module.init(project=wandb_project, dir=str(run.root), config=config)
        self._wandb_defined: set[str] = set()

    def log(self, row: dict[str, Any]) -> None:
        row = {key: _clean(value) for key, value in row.items()}
        append_jsonl(self.path, row)
        scalars = {k: v for k, v in row.items() if isinstance(v, int | float) and k not in ("step",)}
        model = row.get("model", "")
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"{model}/{key}", value, row["step"])
        if self._wandb is not None:
            for key in scalars:
                self._define_wandb_summary(f"{model}/{key}", key)
            self._wandb.log({f"{model}/{k}": v for k, v in scalars.items()}, step=row["step"])

    def _define_wandb_summary(self, name: str, key: str) -> None:
        """The declared summary of a W&B scalar (by its exact name: the last value is W&B's default)."""
        if name in self._wandb_defined:
            return
        self._wandb_defined.add(name)
        declared = find_key(key, self.keys)
        if declared is not None and declared.summary != "last":
            self._wandb.define_metric(name, summary=declared.summary)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
