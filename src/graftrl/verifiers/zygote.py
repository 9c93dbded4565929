"""The code verifier's fork servers (``reward.code.fork_server``): one long-lived sandbox per
worker slot and role instead of two new sandboxes per program.

Per slot, a ``serve`` sandbox and a ``judge`` sandbox, each its own bubblewrap with the namespaces
and mounts of ``Sandbox.command``, whose first process is a *zygote* (``sandbox_entry.zygote``,
graftrl's own standard-library code, root inside the sandbox) that never runs a program itself.
Per program this module makes the two call pipes and the judge's result pipe, and sends the pipes
with the request over a unix socket: the program's text to the serve zygote only, the tests to the
judge zygote only. Each zygote forks a child that keeps only those pipes, takes a fresh IPC
namespace, applies ``confine`` (limits, then the slot's user, no capabilities; its CPU time starts
at 0) and runs the role. When the judge's stream ends or the program's deadline passes, ``end``
stops both: each zygote kills its child, then every process of the slot's user in its sandbox
(``kill(-1, SIGKILL)`` from a helper that the program's processes cannot signal), empties /tmp, and
confirms. A zygote that dies, does not confirm, or does not start is killed (its PID namespace takes
everything in it along) and started afresh for the slot's next program; the program it was serving
gets what a dead sandbox gives in the per-program mode (its missing results count as ``crash``),
and its verdict is not cached.

It needs graftrl to run as root (the slot's own user is what the clean-up kills by); otherwise the
verifier runs each program in sandboxes of its own, as with ``fork_server: false``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from graftrl.verifiers import sandbox_fork
from graftrl.verifiers.sandbox import Sandbox, Started
from graftrl.verifiers.sandbox_fork import receive_message, send_message

FORK_SOURCE = Path(sandbox_fork.__file__).read_text(encoding="utf-8")
"""The fork server's code, passed to ``sandbox_entry``'s ``zygote`` role."""
START_TIMEOUT_S = 30.0
"""How long a zygote may take to start (bubblewrap and one interpreter)."""
CLEANUP_TIMEOUT_S = 10.0
"""How long a zygote may take to confirm a program's clean-up before it is replaced."""


class Zygote:
    """One slot's fork server of one role (``serve`` or ``judge``), started on first use."""

    def __init__(self, sandbox: Sandbox, role: str, slot: int) -> None:
        self.sandbox, self.role, self.slot = sandbox, role, slot
        self.started: Started | None = None
        self.sock: socket.socket | None = None
        self.starts = 0
        self.error = ""

    def _spawn(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.started = self.sandbox.start(
                "zygote", {}, self.slot, args=(str(theirs.fileno()), self.role, FORK_SOURCE),
                pass_fds=(theirs.fileno(),), stdout=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        self.sock, self.starts = ours, self.starts + 1
        ours.settimeout(START_TIMEOUT_S)
        try:
            hello, fds = receive_message(ours)
        except (OSError, EOFError, ValueError):
            hello, fds = None, []
        if not (isinstance(hello, dict) and "ready" in hello and not fds):
            self.error = self.started.stderr_line() or f"the {self.role} fork server did not start"
            self.kill()
            return False
        return True

    def submit(self, request: dict, fds: tuple[int, ...]) -> bool:
        """Send a request with its pipes; a dead zygote is replaced once. False: no zygote took it."""
        for _ in range(2):
            if self.sock is None and not self._spawn():
                return False
            assert self.sock is not None
            try:
                self.sock.settimeout(CLEANUP_TIMEOUT_S)
                send_message(self.sock, request, fds)
                return True
            except OSError:
                self.kill()
        return False

    def stop(self) -> None:
        if self.sock is not None:
            try:
                send_message(self.sock, {"stop": True})
            except OSError:
                self.kill()

    def done(self) -> bool:
        """The zygote's confirmation that the program's processes and files are gone; without it
        (dead, silent, malformed) the zygote is killed, to be started afresh."""
        if self.sock is None:
            return False
        try:
            self.sock.settimeout(CLEANUP_TIMEOUT_S)
            reply, fds = receive_message(self.sock)
        except (OSError, EOFError, ValueError):
            reply, fds = None, []
        if reply == {"done": True} and not fds:
            return True
        for fd in fds:
            os.close(fd)
        self.kill()
        return False

    def kill(self) -> None:
        """End the sandbox: its PID namespace, and every process in it, dies with the zygote."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.started is not None:
            self.started.kill()
            self.started = None


@dataclass
class Running:
    """One program running in a slot's two zygotes; ``results`` reads the judge's JSON lines."""

    results: int
    zygotes: list[Zygote]
    """Those that took the request (both, unless one failed)."""

    def end(self) -> bool:
        """Stop the children and wait for the clean-ups; False when a zygote failed."""
        os.close(self.results)
        for zygote in self.zygotes:
            zygote.stop()
        confirmed = [zygote.done() for zygote in self.zygotes]
        return len(confirmed) == 2 and all(confirmed)


class Zygotes:
    """The verifier's zygotes, a (serve, judge) pair per slot."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._pairs: dict[int, tuple[Zygote, Zygote]] = {}
        self._lock = threading.Lock()

    def pair(self, slot: int) -> tuple[Zygote, Zygote]:
        with self._lock:
            if slot not in self._pairs:
                self._pairs[slot] = (Zygote(self.sandbox, "serve", slot), Zygote(self.sandbox, "judge", slot))
            return self._pairs[slot]

    def run(self, slot: int, program: str, spec: dict, test_timeout_s: float, due: float) -> Running:
        """Start ``program`` against the tests ``spec`` in ``slot``'s zygotes until ``due``."""
        serve, judge = self.pair(slot)
        to_program_r, to_program_w = os.pipe()
        to_judge_r, to_judge_w = os.pipe()
        results_r, results_w = os.pipe()
        deadline_s = max(0.0, due - time.monotonic()) + 1.0  # the zygotes' own backstop
        taken = []
        try:
            if serve.submit(
                {"role": "serve", "source": program, "deadline_s": deadline_s}, (to_program_r, to_judge_w)
            ):
                taken.append(serve)
                request = {"role": "judge", "spec": spec, "test_timeout_s": test_timeout_s}
                if judge.submit({**request, "deadline_s": deadline_s}, (to_judge_r, to_program_w, results_w)):
                    taken.append(judge)
        finally:
            for fd in (to_program_r, to_program_w, to_judge_r, to_judge_w, results_w):
                os.close(fd)
        return Running(results_r, taken)

    def starts(self) -> int:
        """Zygotes started so far (two per slot used, plus one per replacement)."""
        with self._lock:
            return sum(z.starts for pair in self._pairs.values() for z in pair)

    def error(self) -> str:
        with self._lock:
            return next((z.error for pair in self._pairs.values() for z in pair if z.error), "")

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                for zygote in pair:
                    zygote.kill()
            self._pairs.clear()
