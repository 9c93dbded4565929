"""Reading a run's logs for reports: every row checked against its log's declared keys
(``graftrl.storage.log_keys``), a damaged line skipped with one warning naming ``file:line``.

A run's JSONL logs are append-only files another tool, an editor or a disk may damage: a line of
bytes that are not UTF-8, truncated JSON, a string where a number belongs, a null model. ``graftrl
analyze`` and the reports (compare, sweep, demo, mastery) read them through here, so such a line
costs a warning, never a traceback, and the rest of the run is still reported. (A torn last line,
the trace of a run killed mid-append, is skipped with a note instead.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from graftrl.console import warn
from graftrl.core.advantages import SUCCESS_THRESHOLD
from graftrl.errors import UserError
from graftrl.storage.log_keys import logs, row_checker
from graftrl.storage.rundir import RunDir, read_jsonl
from graftrl.training.log_schema import metric_keys

_PER_RESPONSE = RunDir(Path()).compatibility.name
"""The log that holds one list per key (a value per transferred response)."""


def read_log(
    path: Path, on_torn: Callable[[str], None] | None = None, on_bad: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The valid rows of a run log (metrics, samples, compatibility or validation, by file name);
    each damaged line is skipped and reported to ``on_bad`` (default: a warning line)."""
    check = row_checker(logs(metric_keys()).get(path.name, ()), per_response=path.name == _PER_RESPONSE)
    return read_jsonl(path, on_torn, check=check, on_bad=on_bad or warn)


def read_run_metrics(
    run_dir: str | Path, on_bad: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The valid rows of a run's metrics.jsonl (``read_log``)."""
    return read_log(RunDir(run_dir).metrics, on_bad=on_bad)


def success_threshold_of(config: Mapping[str, Any]) -> float:
    """A run's ``reward.success_threshold`` from its config.yaml read as a mapping (what its counts
    took as a success); the default (1.0) when the config says nothing or holds no number there."""
    reward = config.get("reward")
    value = reward.get("success_threshold") if isinstance(reward, Mapping) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return SUCCESS_THRESHOLD


def run_success_threshold(run_dir: str | Path) -> float:
    """A run folder's ``reward.success_threshold`` (``success_threshold_of`` its config.yaml); the
    default when config.yaml is missing or unreadable."""
    try:
        loaded = yaml.safe_load(RunDir(run_dir).config.read_bytes().decode("utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return SUCCESS_THRESHOLD
    return success_threshold_of(loaded) if isinstance(loaded, dict) else SUCCESS_THRESHOLD


def run_train_file(run_dir: str | Path) -> str:
    """The training data a run read (its config.yaml's ``data.train``)."""
    path = RunDir(run_dir).config
    try:
        return str(yaml.safe_load(path.read_bytes().decode("utf-8"))["data"]["train"])
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError) as error:
        raise UserError(
            f"{path}: cannot read data.train ({type(error).__name__}); restore the file"
        ) from None
