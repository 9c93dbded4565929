"""Metrics sinks: JSONL always; TensorBoard and W&B when asked."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from graftrl.files import atomic_write


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
        truncate_jsonl(self.path, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def discarded_path(path: Path) -> Path:
    """Where ``truncate_jsonl`` keeps the lines it removes (``metrics.discarded.jsonl``)."""
    return path.with_name(f"{path.stem}.discarded{path.suffix}")


def truncate_jsonl(path: Path, step: int) -> tuple[int, int]:
    """Keep the rows of steps <= ``step`` in a JSONL log (on resume); returns (rows moved, bad lines).

    Later rows, and lines that are not JSON objects (a torn last line left by a kill), move to
    ``<name>.discarded.jsonl`` rather than being lost. Rows without a step are kept. The log is
    rewritten atomically, so a kill during the truncation leaves the old or the new file.
    """
    if not path.exists():
        return 0, 0
    raw = path.read_bytes()
    kept, discarded, bad = [], [], 0
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            bad += 1
            discarded.append(line)
        elif isinstance(row.get("step", -1), int | float) and row.get("step", -1) <= step:
            kept.append(line)
        else:
            discarded.append(line)
    if discarded:
        with discarded_path(path).open("a") as handle:
            handle.write("\n".join(discarded) + "\n")
    if discarded or (raw and not raw.endswith(b"\n")):
        atomic_write(path, "".join(line + "\n" for line in kept).encode())
    return len(discarded) - bad, bad


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``; a torn last line (a run killed mid-write) is skipped."""
    lines = [line for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines) - 1:
                raise
    return rows
