"""Spawned workers end with the process that started them (graftrl.workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PARENT = textwrap.dedent(
    """
    import sys, time
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp
    from graftrl.workers import exit_with_parent

    def work():
        import os
        print(os.getpid(), flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=exit_with_parent)
        pool.submit(work)
        time.sleep(120)
    """
)

MANAGER_PARENT = textwrap.dedent(
    """
    import time
    import multiprocessing as mp
    from graftrl.workers import start_manager

    if __name__ == "__main__":
        manager = start_manager(mp.get_context("spawn"))
        print(manager._process.pid, flush=True)
        time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("parent_script", [PARENT, MANAGER_PARENT], ids=["pool worker", "manager"])
def test_a_worker_exits_when_its_parent_is_killed_outright(tmp_path, parent_script):
    script = tmp_path / "parent.py"
    script.write_text(parent_script)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.send_signal(signal.SIGKILL)  # no cleanup runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()
