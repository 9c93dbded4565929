"""A policy's worker process that died or failed, reported as one short paragraph.

A run's policies may live in other processes: Ray actors (``backend: ray``) and the rank
processes of a data-parallel policy (``parallel.data > 1``). When one of them dies (a signal, the
kernel's out-of-memory killer, a crash) or raises an error that is not an anticipated one, the
trainer stops with ``WorkerFailure``: one paragraph naming the policy (and rank), the cause (the
signal, out of memory, or the exception's type and message) and how to resume; the full
traceback, when there is one, goes to the run folder's error log (``RunDir.errors_log``), not to
the terminal. The checkpoints are untouched by the failure, so ``--resume`` continues exactly.
"""

from __future__ import annotations

import importlib
import re
import signal
import time
from pathlib import Path
from typing import Any

from graftrl.errors import UserError, is_out_of_memory
from graftrl.storage.rundir import RunDir


class WorkerFailure(UserError):
    """A policy's worker (Ray actor or data-parallel rank) died or failed: one paragraph."""


def exit_cause(code: int | None) -> str:
    """A process's exit code in words: the signal that killed it, or the code it exited with."""
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = (
            " (the kernel's out-of-memory killer sends it, as does kill -9)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"killed by {name}{hint}"
    return f"it exited with code {code}"


def worker_failure(
    run_dir: str | Path,
    who: str,
    during: str,
    cause: str,
    details: str = "",
    kind: type[WorkerFailure] = WorkerFailure,
) -> WorkerFailure:
    """The paragraph for ``who`` (``policy 'a'``, ``policy 'a', rank 1``) failing during the call
    ``during``; ``details`` (a traceback, the worker's own report) is appended to the run's error
    log, which the paragraph names."""
    files = RunDir(run_dir)
    log = files.errors_log
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as handle:
            handle.write(f"===== {stamp}: {who} failed during `{during}`: {cause}\n{details.rstrip()}\n\n")
        where = f"the full report is in {log}"
    except OSError as error:  # an unwritable run folder must not hide the failure itself
        where = f"its report could not be written to {log} ({error.strerror})"
    config = files.config if files.config.is_file() else Path("CONFIG")
    remedy = files.resume_remedy()
    if remedy == "--resume":
        remedy = f"resume with `graftrl train {config} --out {files.root} --resume`"
    return kind(
        f"{who} failed during `{during}`: {cause}. The run stopped; {where}. The checkpoints written so "
        f"far are intact: {remedy}"
    )


def exception_cause(error: BaseException) -> str:
    """``Type: first line of the message``, marked when it is running out of memory."""
    text = (str(error).strip().splitlines() or [""])[0][:300]
    described = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return f"out of memory ({described})" if is_out_of_memory(error) else described


_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure)): (.*)$")


def _anticipated(path: str, message: str) -> UserError | None:
    """The graftrl UserError named ``path`` (``graftrl.errors.ModelError``) with ``message``, else None."""
    module, _, name = path.rpartition(".")
    if not module.startswith("graftrl"):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, UserError):
            return cls(message)
    except Exception:  # not importable or not constructible from a message: a plain UserError
        return UserError(message)
    return None


def ray_cause(error: BaseException) -> tuple[str, str, UserError | None]:
    """(the cause in words, the full report, the anticipated error to raise instead, if any) of an
    error ``ray.get`` raised for an actor's call: the actor's own exception (RayTaskError and its
    ``cause``), its death (ActorDiedError: a signal, the OOM killer, a crash, or an exception in
    its constructor) or Ray's memory monitor. Duck-typed: Ray is optional."""
    text = str(error)
    cause: Any = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return exception_cause(cause), text, cause if isinstance(cause, UserError) else None
    if type(error).__name__ == "OutOfMemoryError" or "low on memory" in text:
        return "out of memory (Ray's memory monitor stopped the worker)", text, None
    if getattr(error, "_actor_init_failed", False) or "creation task" in text:
        raised = [m for line in text.splitlines() if (m := _RAISED.match(line.strip()))]
        if raised:
            path, message = raised[-1].group(1), raised[-1].group(2)
            return f"{path.rpartition('.')[2]}: {message}", text, _anticipated(path, message)
        return "its constructor raised (see the report)", text, None
    pid = re.search(r"\bpid[:=] ?(\d+)", text)
    return (
        f"its process{f' (pid {pid.group(1)})' if pid else ''} died without an error of its own: killed by a "
        "signal (the kernel's out-of-memory killer sends SIGKILL, as does kill -9) or crashed",
        text,
        None,
    )
