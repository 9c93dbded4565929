"""Ctrl-C (SIGINT) in graftrl's commands: stop, even when Python swallowed the interrupt.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT's handler runs. If that
is inside a finalizer (a ``__del__`` or a weakref callback, which libraries run at any allocation),
Python prints "Exception ignored in ..." and carries on: a run told to stop would finish instead.
``install`` puts a handler that raises as Python's does and also records the interrupt; long loops
call ``raise_if_interrupted`` at safe points (the trainer, before each step and each checkpoint),
so a swallowed interrupt stops the run there. Without ``install`` (graftrl used as a library) the
check never fires: the user's process keeps its own SIGINT handling.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["clear", "install", "raise_if_interrupted"]

_requested = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT as above (main thread only: Python runs signal handlers there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def clear() -> None:
    """Forget an earlier interrupt (a new run in the same process starts clean)."""
    global _requested
    _requested = False


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if SIGINT arrived since ``clear``, whether or not it was swallowed."""
    if _requested:
        raise KeyboardInterrupt
