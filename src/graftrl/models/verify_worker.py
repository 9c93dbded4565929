"""The math verifier's worker process: the loop that parses and verifies answers and the verdict
codes it streams back.

:class:`graftrl.models.rewards.MathVerifier` starts, feeds, times out and replaces these workers
through its :class:`graftrl.models.worker_pool.WorkerPool`; nothing here runs in the parent.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from graftrl.models.answers import gold_parse_text
from graftrl.models.worker_pool import READY, die_with_parent, received_chunks

# Verdict codes sent back by workers (small ints keep the per-answer messages tiny).
WRONG, CORRECT, ERROR = 0, 1, 2
SKIPPED = 3  # not verified before the call's overall deadline: scores 0, never cached


# --------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------


def worker_main(
    conn: Connection, faults: dict[str, str], parent_pid: int | None = None, use_pdeathsig: bool = False
) -> None:
    """Worker loop: receive chunks of ``(index, gold, text, extraction)``, stream back one verdict each.

    ``text`` is the extracted answer (``last_box``) or the whole response (``math_verify``).
    One small message per answer (not per chunk) tells the parent exactly which answer is in
    progress, so on a timeout it knows which one hung and can re-queue the rest.
    ``faults`` is a test hook mapping an extracted answer to ``hang``/``crash``/``raise``.
    """
    die_with_parent(os.getppid() if parent_pid is None else parent_pid, use_pdeathsig)
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
    for chunk in received_chunks(conn):
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
