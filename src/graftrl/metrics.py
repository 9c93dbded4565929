"""Metrics sinks: JSONL always; TensorBoard and W&B when asked."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # pragma: no cover - depends on the extra
                raise RuntimeError("logging.tensorboard needs `pip install graftrl[tensorboard]`") from error
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError as error:  # pragma: no cover - depends on the extra
                raise RuntimeError("logging.wandb needs `pip install graftrl[wandb]`") from error
            self._wandb = wandb_module.init(project=wandb_project, dir=str(run_dir), config=config)

    def log(self, row: dict[str, Any]) -> None:
        row = {key: _clean(value) for key, value in row.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, int | float) and k not in ("step",)}
        model = row.get("model", "")
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"{model}/{key}", value, row["step"])
        if self._wandb is not None:
            self._wandb.log({f"{model}/{k}": v for k, v in scalars.items()}, step=row["step"])

    def truncate_after(self, step: int) -> None:
        """Keep rows up to ``step`` (resume); later rows move to metrics.discarded.jsonl, not lost."""
        if not self.path.exists():
            return
        kept, discarded = [], []
        for line in self.path.read_text().splitlines():
            (kept if json.loads(line).get("step", -1) <= step else discarded).append(line)
        if discarded:
            with (self.path.parent / "metrics.discarded.jsonl").open("a") as handle:
                handle.write("\n".join(discarded) + "\n")
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
