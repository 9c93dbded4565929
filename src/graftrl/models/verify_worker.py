"""The math verifier's worker processes: the loop that parses and verifies answers, the verdict
codes it streams back, and how a worker dies with its parent.

:class:`graftrl.models.rewards.MathVerifier` starts, feeds, times out and replaces these workers;
nothing here runs in the parent except the ``Worker`` record and ``kill_workers``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from graftrl.models.answers import gold_parse_text

# Verdict codes sent back by workers (small ints keep the per-answer messages tiny).
WRONG, CORRECT, ERROR = 0, 1, 2
SKIPPED = 3  # not verified before the call's overall deadline: scores 0, never cached
READY = -1  # index of the "worker started" message
STOP = None  # sentinel asking a worker to exit


# --------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
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


def worker_main(
    conn: Connection, faults: dict[str, str], parent_pid: int | None = None, use_pdeathsig: bool = False
) -> None:
    """Worker loop: receive chunks of ``(index, gold, text, extraction)``, stream back one verdict each.

    ``text`` is the extracted answer (``last_box``) or the whole response (``math_verify``).
    One small message per answer (not per chunk) tells the parent exactly which answer is in
    progress, so on a timeout it knows which one hung and can re-queue the rest.
    ``faults`` is a test hook mapping an extracted answer to ``hang``/``crash``/``raise``.
    """
    _die_with_parent(os.getppid() if parent_pid is None else parent_pid, use_pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import math_verify.grader
    import math_verify.parser
    from math_verify import parse, verify

    # The parent enforces timeouts by killing this process; math_verify's signal-based timeouts
    # are disabled (integer seconds, main-thread only), so silence its one-time warning.
    for mod in (math_verify.parser, math_verify.grader):
        if hasattr(mod, "TIMEOUT_WARNING_SHOWN"):
            mod.TIMEOUT_WARNING_SHOWN = True

    gold_cache: dict[str, Any] = {}

    def check(gold: str, text: str, extraction: str = "last_box") -> int:
        parsed_gold = gold_cache.get(gold)
        if parsed_gold is None:
            if len(gold_cache) >= 10_000:
                gold_cache.clear()
            parsed_gold = gold_cache[gold] = parse(gold_parse_text(gold), parsing_timeout=None)
        pred_text = text if extraction == "math_verify" else "\\boxed{" + text + "}"
        pred = parse(pred_text, parsing_timeout=None)
        return CORRECT if verify(parsed_gold, pred, timeout_seconds=None) else WRONG

    # Warm up sympy's and latex2sympy's lazy imports before reporting ready, so the first real
    # answers are not charged for them.
    for warm in ("1", "-\\frac{3}{4}", "0.5", "2\\sqrt{3}", "x^2+1", "(1, 2]", "\\{1, 2\\}", "\\text{B}"):
        check(warm, warm)
    gold_cache.clear()
    conn.send((READY, os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is STOP:
            return
        for index, gold, extracted, extraction in chunk:
            fault = faults.get(extracted)
            if fault == "hang":
                time.sleep(3600)
            elif fault == "crash":
                os._exit(3)
            try:
                if fault == "raise":
                    raise RuntimeError("injected verification error")
                verdict = check(gold, extracted, extraction)
            except Exception:
                verdict = ERROR
            conn.send((index, verdict))


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
