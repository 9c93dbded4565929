"""The typer app every command registers on: its error boundary, the console it prints to, the
``--threads`` callback and the options several commands share."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from graftrl.cli.errors import (
    TRACEBACK_ENV,
    USER_ERROR_EXIT_CODE,
    environment_error,
    one_line,
    raised_by_graftrl,
)
from graftrl.embedded.task import TASKS
from graftrl.errors import UserError
from graftrl.machine import available_cpus, contention_note, torch_threads, tune_allocator

console = Console()


class ErrorBoundary(TyperGroup):
    """The CLI's one error boundary: every command runs inside it.

    An anticipated error (any ``graftrl.errors.UserError``, raised where the problem is found, or a
    ``FileNotFoundError`` graftrl raised itself with a message, i.e. without an errno) becomes one
    red line naming the thing and the fix, exit code 2. So does an error of the machine (an
    ``OSError`` with an errno: disk full, permissions, a read-only or vanished path; a
    ``MemoryError``), with the usual fix (``GRAFTRL_TRACEBACK=1`` shows its traceback). Anything
    else is a bug and keeps its traceback.
    """

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (UserError, FileNotFoundError, OSError, MemoryError) as error:
            if isinstance(error, (OSError, MemoryError)) and not raised_by_graftrl(error):
                # The machine's answer to a file or resource (disk full, permissions, a read-only
                # or vanished path, memory): the user's environment, not graftrl's logic.
                if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
                    raise
                console.print(f"[red]error:[/red] {escape(environment_error(error))}", soft_wrap=True)
                raise typer.Exit(USER_ERROR_EXIT_CODE) from None
            # A Ray actor's error arrives wrapped (RayTaskError, also an instance of its cause's
            # class) with the remote traceback in its text: print the cause's own message.
            cause = getattr(error, "cause", None)
            message = one_line(cause if isinstance(cause, UserError) else error)
            console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
            raise typer.Exit(USER_ERROR_EXIT_CODE) from None


def out_folder(value: Path | None) -> Path | None:
    """``--out`` names a folder (new or existing): refuse a path that is an existing file."""
    if value is not None and value.exists() and not value.is_dir():
        raise UserError(
            f"--out {value}: is a file, not a folder; give a folder path (a new one is created, an "
            "existing folder is used)"
        )
    return value


app = typer.Typer(
    cls=ErrorBoundary,
    add_completion=False,
    no_args_is_help=True,
    help="Cross-model trajectory exchange for RLVR.",
)

TASK_HELP = "Embedded task: " + "; ".join(f"{t.name} = {t.description}" for t in TASKS.values()) + "."


def check_task(name: str) -> None:
    """An unknown --task ends with one line naming the known tasks."""
    if name not in TASKS:
        raise UserError(f"--task {name!r} is not an embedded task; known: {', '.join(TASKS)}")


_TORCH_COMMANDS = frozenset(
    {"train", "probe", "demo", "compare", "sweep", "eval", "import-trajectories", "embedded"}
)
"""Subcommands that run models, so their torch thread count matters."""

_thread_notes: list[str] = []
"""The contention hint of this invocation, printed by the command once its inputs check out."""


@app.callback()
def _setup(
    ctx: typer.Context,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            envvar="GRAFTRL_THREADS",
            help="torch intra-op threads of this process (default: one per CPU it may use). Give each "
            "of several graftrl processes sharing the machine cores / processes (e.g. 1): torch's "
            "threads spin when cores are shared, which can make a run several times slower. Ray "
            "actors and FSDP ranks set their own (resources.num_cpus, 1).",
        ),
    ] = None,
) -> None:
    """graftrl shows its own progress; silence per-file load/save bars of transformers (here and in
    the workers a command spawns)."""
    from graftrl.console import quiet_transformers
    from graftrl.interrupts import install

    quiet_transformers()
    install()  # Ctrl-C stops a run even when a finalizer swallowed the KeyboardInterrupt
    if ctx.invoked_subcommand not in _TORCH_COMMANDS:
        return
    tune_allocator()  # for every later allocation here, and in the workers the command starts
    import torch

    cpus = available_cpus()
    # The default never raises torch's own count (already lowered, e.g. by OMP_NUM_THREADS or a test).
    chosen = torch_threads(cpus, requested=threads)
    if threads is None:
        chosen = min(chosen, torch.get_num_threads())
    torch.set_num_threads(chosen)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    note = None if threads is not None else contention_note(chosen, cpus, load)
    _thread_notes[:] = [note] if note else []


def thread_note() -> None:
    """Print the contention hint of ``_setup`` (once the command has passed its input checks)."""
    while _thread_notes:
        console.print(f"[yellow]note:[/yellow] {escape(_thread_notes.pop())}", soft_wrap=True)


REUSE_HELP = (
    "A compare or sweep output folder (repeatable) whose finished cells stand in for this run's: a "
    "cell with the same digest (the same models, data, config and evaluation, under any variant "
    "name) is copied, logs and marker, instead of trained."
)
JOBS_HELP = (
    "Cells trained side by side, each in its own process with an equal share of this process's torch "
    "threads (on 2 cores, 2 jobs of 1 thread beat 1 job of 2 threads: the models are tiny)."
)
# The options demo, compare and sweep share, declared once.
CacheOption = Annotated[Path | None, typer.Option(help="Where warm-started models are cached.")]
TaskOption = Annotated[str, typer.Option(help=TASK_HELP)]
StepsOption = Annotated[int | None, typer.Option(min=1, help="Override train.steps for every cell.")]
QuickOption = Annotated[bool, typer.Option(help="Smoke-test sizes (the demo's --quick).")]
JobsOption = Annotated[int, typer.Option(min=1, help=JOBS_HELP)]
ReuseOption = Annotated[list[Path] | None, typer.Option(help=REUSE_HELP)]


def main() -> None:  # pragma: no cover - console entry
    app(sys.argv[1:])
