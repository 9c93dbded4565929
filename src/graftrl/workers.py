"""Worker processes that end with the process that started them.

graftrl trains cells and warm-starts models in spawned processes. A parent killed outright
(SIGTERM, SIGKILL, the OOM killer) runs no cleanup, and its workers would keep training
orphaned, writing into run folders that a restarted command then claims too. Each worker
therefore watches its parent and exits when it is gone; the cell it was training is unfinished
and is trained again on resume.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.context import BaseContext
from multiprocessing.managers import SyncManager

__all__ = ["exit_with_parent", "start_manager"]

PARENT_POLL_S = 1.0
"""How often a worker checks that its parent is alive (seconds)."""


def exit_with_parent(poll_s: float = PARENT_POLL_S) -> None:
    """Start a daemon thread that ends this process as soon as its parent has died (it is then
    re-parented, so ``os.getppid()`` changes). A ``ProcessPoolExecutor`` ``initializer``."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)  # no cleanup: nothing this worker holds may outlive the command

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def start_manager(context: BaseContext) -> SyncManager:
    """A started ``multiprocessing`` manager (for progress queues) whose server process also ends
    with this one; ``context.Manager()`` would leave it behind as an idle orphan."""
    manager = SyncManager(ctx=context)
    manager.start(initializer=exit_with_parent)
    return manager
