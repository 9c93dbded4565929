"""Terminal output shared by the layers: the one progress bar of training and evaluation, the
one-line warnings, and the quiet mode of graftrl's own processes (its commands and the workers
they spawn)."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.errors import LiveError
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""Set in a graftrl command's process and so inherited by the workers it spawns (compare cells,
warm-starts, ranks): transformers and huggingface_hub read it when they are imported and then
draw no per-file bars ("Loading weights", "Writing model shards")."""


def quiet_transformers() -> None:
    """For graftrl's own processes only, never a user's: no per-file progress bars from
    transformers here, nor in the workers spawned from here. (Its one known false alarm, the
    dropped attention mask, is silenced where it arises: ``models.rollout``.)"""
    os.environ.update(QUIET_ENV)
    if "transformers" in sys.modules:  # imported before this call: its bars were on at import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def warn(message: str) -> None:
    """One ``warning:`` line on stderr (stdout carries the progress bars and the command's output):
    something was damaged or skipped and graftrl went on without it."""
    from rich.markup import escape

    Console(stderr=True).print(
        f"[yellow]warning:[/yellow] {escape(message)}", highlight=False, soft_wrap=True
    )


def progress_bar(enabled: bool, status: bool = False, console: Console | None = None) -> Progress:
    """A started rich progress bar: description, bar, done/total, elapsed, remaining and, with
    ``status``, a free-text ``status`` field per task. Disabled when ``enabled`` is false or when
    another live display is already active (older rich cannot nest them). Stop it when done."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    if status:
        columns.append(TextColumn("{task.fields[status]}"))
    progress = Progress(*columns, disable=not enabled, console=console)
    try:
        progress.start()
    except LiveError:
        progress = Progress(*columns, disable=True, console=console)
        progress.start()
    return progress


class TaskBars:
    """One live bar per named task (a model warm-starting, a cell training), created on its
    first update; for work that reports from other processes, drained by the caller."""

    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        self.progress = progress_bar(enabled, status=True, console=console)
        self.tasks: dict[str, int] = {}

    def update(self, name: str, completed: int, total: int, status: str = "") -> None:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=total, status=status)
        self.progress.update(self.tasks[name], completed=completed, total=total, status=status)

    def close(self) -> None:
        self.progress.stop()
