"""Killable worker processes fed chunks of items, with per-item and per-call deadlines: the pool
that both process-based verifiers share, math_verify's (:mod:`graftrl.models.rewards`) and the
user's scorer's (:mod:`graftrl.verifiers.function`).

The parent sends a ready worker a chunk of ``(index, *item)`` tuples; the worker answers with one
``(index, message)`` per item, in order, so the parent always knows which item is in progress
(negative indexes are start-up messages: ``READY``, or a kind's own failure). An item still
running after ``timeout_s`` costs its worker, which is killed and replaced, its other items
re-queued; so does a worker that dies; three failed starts in a row refuse the call. A call's
overall deadline, counted from the moment a worker is ready (start-up is never charged), settles
whatever is left as skipped. A kind of worker subclasses ``WorkerPool`` to say what its answers
and its verdicts are; the worker's own loop calls ``die_with_parent`` first and reads its work
from ``received_chunks``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, ClassVar, Generic, Literal, TypeVar

__all__ = [
    "READY",
    "STOP",
    "Unanswered",
    "Worker",
    "WorkerPool",
    "die_with_parent",
    "kill_workers",
    "received_chunks",
]

READY = -1  # index of a worker's "started" message
STOP = None  # sentinel asking a worker to exit
FAILED_STARTS = 3  # failed starts in a row that refuse a call (a worker that cannot start at all)

V = TypeVar("V")  # a kind's verdict


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Make this worker exit when the process that started it dies, even by SIGKILL.

    On Linux the kernel sends SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG); it is tied to
    the *thread* that started the worker, so it is only set when that was the main thread. A
    daemon thread polling ``os.getppid()`` covers the rest (other threads, other systems, and a
    parent that died before prctl ran).
    """
    if use_pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="graftrl-parent-watchdog", daemon=True).start()


def received_chunks(conn: Connection) -> Iterator[list[tuple[Any, ...]]]:
    """The chunks a worker's parent sends it, until ``STOP`` or a closed pipe (the parent gone)."""
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is STOP:
            return
        yield chunk


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


@dataclass
class Worker:
    proc: Any  # multiprocessing process (BaseProcess subclass of the chosen context)
    conn: Connection
    started_at: float
    ready: bool = False
    inflight: deque[int] = field(default_factory=deque)
    deadline: float = float("inf")


def kill_workers(workers: list[Worker]) -> None:
    """Stop workers politely, then forcefully; used by close() and at garbage collection."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):  # already dead or closed
            w.conn.send(STOP)
    for w in workers:
        w.proc.join(timeout=1.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=1.0)
        w.conn.close()
    workers.clear()


Unanswered = Literal["died", "timed out", "skipped", "unsettled"]
"""Why no worker answered an item (``WorkerPool.unanswered``)."""


@dataclass(kw_only=True, eq=False)
class WorkerPool(ABC, Generic[V]):
    """``num_workers`` killable processes running ``target``, started lazily; ``run`` settles items
    on them, one verdict ``V`` each.

    A kind of worker says what its answers and failures are worth (the abstract methods) and
    may refuse a call on a start-up message (``started``) or a slow start (``startup_timed_out``).
    """

    # What a kind of worker sets on its class.
    target: ClassVar[Callable[..., None]]
    """The worker's loop (a ``staticmethod``), called ``(conn, *worker_args, parent_pid, use_pdeathsig)``."""
    process_name: ClassVar[str]
    owner: ClassVar[str]
    """The class that internal errors name (``MathVerifier``)."""
    max_chunk: ClassVar[int]
    """The most items one message carries (fewer when items per worker are fewer)."""
    answered_key: ClassVar[str]
    """The counter of items a worker answered."""
    send_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError, ValueError)
    """What sending a chunk raises when its worker is gone: one item is charged, the worker replaced."""

    # What each pool is given.
    worker_args: tuple[Any, ...]
    num_workers: int
    timeout_s: float
    """Budget per item, from when its worker took it up (start-up is not charged)."""
    startup_timeout_s: float
    """How long a worker may take to report ``READY``."""
    stats: dict[str, int]
    """The owner's counters, updated in place: ``answered_key``, ``timeouts``, ``deadline_skips``,
    ``errors`` and ``worker_restarts``."""
    start_method: str = "spawn"
    """``spawn`` or ``forkserver``, never ``fork`` (unsafe next to torch threads)."""
    workers: list[Worker] = field(default_factory=list, init=False)
    """The live workers, changed in place only: an owner's finalizer may hold this list."""

    def __post_init__(self) -> None:
        self._context = mp.get_context(self.start_method)  # an unknown method fails here, not mid-run

    @abstractmethod
    def answer(self, message: Any) -> V:
        """The verdict of a worker's answer to one item."""

    @abstractmethod
    def is_error(self, verdict: V) -> bool:
        """Whether ``verdict`` is the verifier's own failure (counted as ``errors``)."""

    @abstractmethod
    def unanswered(self, why: Unanswered, w: Worker | None) -> V:
        """The verdict of an item no worker answered: ``w`` ``died`` on it or it ``timed out`` on
        ``w``, it was ``skipped`` at the call's deadline, or the loop left it ``unsettled`` (never,
        barring a bug); ``w`` is None for the last two."""

    @abstractmethod
    def refusal(self, w: Worker) -> BaseException:
        """The error that refuses a call once ``FAILED_STARTS`` workers in a row failed to start
        (``w`` the last one)."""

    def started(self, index: int, message: Any) -> None:
        """A start-up message (``index`` < 0): raise when it says the worker cannot start."""

    def startup_timed_out(self, w: Worker) -> None:
        """``w`` is not ready after ``startup_timeout_s``: raise to refuse the call, else it counts
        as a failed start and is replaced."""

    # ---------------------------------------------------------------- the pool

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def run(
        self, items: Sequence[tuple[Any, ...]], wait_ready: bool = False, deadline: float | None = None
    ) -> list[V]:
        """One verdict per item, ``items[i]`` sent as ``(i, *items[i])``. ``wait_ready``: also wait
        until every worker is ready; ``deadline`` (a ``time.perf_counter`` instant): items not
        settled by then are ``unanswered("skipped")``."""
        try:
            return self._dispatch(items, wait_ready, deadline)
        except BaseException:
            # Interrupted mid-batch (Ctrl-C, a refusal): workers may still hold work and unread
            # answers, so discard them all rather than mix them into a later call.
            kill_workers(self.workers)
            raise

    def spawn(self) -> Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        # The worker dies with this process: its parent pid (spawn) and whether prctl's parent-death
        # signal applies (it follows the starting thread, so only from the main thread).
        spawned = self._context.get_start_method() == "spawn"
        proc = self._context.Process(
            target=self.target,
            args=(
                child_conn,
                *self.worker_args,
                os.getpid() if spawned else None,
                spawned and threading.current_thread() is threading.main_thread(),
            ),
            name=self.process_name,
            daemon=True,
        )
        proc.start()
        child_conn.close()
        return Worker(proc=proc, conn=parent_conn, started_at=time.monotonic())

    def replace(self, w: Worker) -> None:
        """Kill ``w`` (hung or dead) and put a fresh worker in its slot."""
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()
        self.workers[self.workers.index(w)] = self.spawn()
        self.stats["worker_restarts"] += 1

    def _dispatch(
        self, items: Sequence[tuple[Any, ...]], wait_ready: bool, deadline: float | None
    ) -> list[V]:
        # The call's budget runs on the monotonic clock the per-item deadlines use, from the moment a
        # worker is ready: like per-item timeouts, worker start-up is not charged to it.
        budget = None if deadline is None else max(0.0, deadline - time.perf_counter())
        call_due = float("inf")
        while len(self.workers) < self.num_workers:  # lazy start, all workers in parallel
            self.workers.append(self.spawn())
        verdicts: list[V | None] = [None] * len(items)
        pending: deque[int] = deque(range(len(items)))
        remaining = len(items)
        failed_starts = 0
        stats = self.stats

        def settle(index: int, verdict: V) -> None:
            nonlocal remaining
            verdicts[index] = verdict
            remaining -= 1
            if self.is_error(verdict):
                stats["errors"] += 1

        def fail(w: Worker, why: Unanswered) -> None:
            """The worker ``died`` or ``timed out``: charge its current item, re-queue the rest."""
            nonlocal failed_starts
            if not w.ready:
                failed_starts += 1
                if failed_starts >= FAILED_STARTS:
                    raise self.refusal(w)
            if w.inflight:
                settle(w.inflight.popleft(), self.unanswered(why, w))
                pending.extendleft(reversed(w.inflight))
                w.inflight.clear()
            self.replace(w)

        while remaining or (wait_ready and not all(w.ready for w in self.workers)):
            now = time.monotonic()
            if budget is not None and call_due == float("inf") and any(w.ready for w in self.workers):
                call_due = now + budget
            for w in list(self.workers):
                if w.ready and not w.inflight and pending:
                    size = max(1, min(self.max_chunk, -(-len(pending) // self.num_workers)))
                    chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                    w.inflight.extend(chunk)
                    w.deadline = now + self.timeout_s
                    try:
                        w.conn.send([(i, *items[i]) for i in chunk])
                    except self.send_errors:
                        fail(w, "died")  # died under us; charging one item guarantees progress

            def due(w: Worker) -> float:
                if not w.ready:
                    return w.started_at + self.startup_timeout_s
                return w.deadline if w.inflight else float("inf")

            next_due = min([due(w) for w in self.workers] + ([call_due] if remaining else []))
            timeout = None if next_due == float("inf") else max(0.0, next_due - time.monotonic())
            by_conn = {w.conn: w for w in self.workers}
            for conn in wait(list(by_conn), timeout=timeout):
                w = by_conn[conn]
                try:
                    while conn.poll():
                        index, message = conn.recv()
                        if index < 0:
                            self.started(index, message)
                            w.ready = True
                            failed_starts = 0
                            continue
                        if not w.inflight or w.inflight[0] != index:
                            raise RuntimeError(
                                f"{self.owner}: internal error, worker answered item {index} "
                                f"while {list(w.inflight)[:3]} were in flight"
                            )
                        w.inflight.popleft()
                        w.deadline = time.monotonic() + self.timeout_s
                        stats[self.answered_key] += 1
                        settle(index, self.answer(message))
                except (EOFError, OSError):
                    fail(w, "died")  # the worker died (a crash, os._exit, the OOM killer) on its current item

            now = time.monotonic()
            for w in list(self.workers):
                if not w.ready and now > w.started_at + self.startup_timeout_s:
                    self.startup_timed_out(w)
                    fail(w, "died")  # its start failed: no item is charged
                elif w.inflight and now > w.deadline:
                    stats["timeouts"] += 1
                    fail(w, "timed out")
            if remaining and now > call_due:
                # Out of time for this call: whatever is unsettled is skipped; workers still busy on
                # it are replaced so the next call starts clean.
                for w in list(self.workers):
                    if w.inflight:
                        w.inflight.clear()
                        self.replace(w)
                skipped = self.unanswered("skipped", None)
                for index, verdict in enumerate(verdicts):
                    if verdict is None:
                        verdicts[index] = skipped
                        stats["deadline_skips"] += 1
                remaining = 0
        return [self.unanswered("unsettled", None) if v is None else v for v in verdicts]
