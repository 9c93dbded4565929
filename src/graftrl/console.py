"""Terminal output shared by the layers: the one progress bar of training and evaluation."""

from __future__ import annotations

from rich.errors import LiveError
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(enabled: bool, status: bool = False) -> Progress:
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
    progress = Progress(*columns, disable=not enabled)
    try:
        progress.start()
    except LiveError:
        progress = Progress(*columns, disable=True)
        progress.start()
    return progress
