"""Verifiable 0/1 rewards for math answers.

The reward of a response is 1.0 iff ``math_verify`` judges its answer equal to the gold answer.
What counts as the answer is a choice (``extraction``): ``last_box`` (default) takes the content
of the last ``\\boxed{...}``/``\\fbox{...}``, as verl's DAPO scorer does; ``math_verify`` lets
math_verify extract from the whole response (every box, "final answer is", the last LaTeX or
number). Golds are parsed by ``parse_gold`` (math_verify's own parsing, ``$...$`` for bare LaTeX). ``math_verify.parse`` can hang or blow up on pathological model
output (sympy on huge expressions), and its own timeout only works in a process's main thread,
so verification runs in worker processes that the parent kills and replaces when an answer
exceeds its time budget: a bad answer costs one 0.0 reward, never the training run.

RL rollouts repeat answers a lot (a group of 8-16 samples per prompt, mostly the same few
answers), so the parent de-duplicates each batch and keeps an LRU cache of verdicts per
(gold, extracted) pair; only new pairs travel to the workers, in chunks.

Worker processes use the ``spawn`` start method by default (safe next to torch threads), which
re-imports the caller's ``__main__`` module in each worker: scripts need the usual
``if __name__ == "__main__":`` guard. The workers' own loop is :mod:`graftrl.models.verify_worker`;
:mod:`graftrl.models.worker_pool` feeds them, times them out and replaces them.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from graftrl.models.answers import EXTRACTIONS, Extraction, extract_last_boxed, fast_verdict, gold_parse_text
from graftrl.models.verify_worker import CORRECT, ERROR, SKIPPED, WRONG, worker_main
from graftrl.models.worker_pool import Unanswered, Worker, WorkerPool, kill_workers

__all__ = ["MathVerifier", "extract_last_boxed", "gold_parse_text", "shared_verifier", "verify_answer"]


class MathVerifier:
    """Score responses against gold answers with math_verify, in killable worker processes.

    Args:
        timeout_s: budget per answer; an answer still running after it scores 0.0 and its
            worker is killed and replaced (worker start-up time is not charged to it).
        workers: worker processes; answers are spread over them in chunks.
        cache_size: LRU entries of (gold, extracted) -> verdict kept in this process.
        short_circuit: decide without math_verify when the extracted answer and the gold are both
            plain integers (compare values) or the same decimal. math_verify agrees (see
            ``fast_verdict``), so this only skips work; turn it off to send every answer to the
            workers. Only with ``extraction="last_box"``.
        deadline_s: overall budget of one ``score`` call (counted from when a worker is ready,
            so worker start-up is not charged to it); answers not verified by then score 0.0
            (counted as ``deadline_skips``, not cached) and busy workers are replaced, so a flood
            of hanging answers cannot stall a training step. None = no overall deadline.
        extraction: ``last_box`` (the last ``\\boxed{}``/``\\fbox{}``, verl's DAPO rule) or
            ``math_verify`` (math_verify's own extraction over the whole response).
        start_method: ``spawn`` (default) or ``forkserver``; never ``fork``, which is unsafe
            once torch has started its thread pools.
        startup_timeout_s: how long a worker may take to import math_verify and report ready.

    Timed-out and failed pairs are cached as 0.0 too: they are deterministic, and re-verifying
    a hanging answer would cost another timeout and worker restart. Calls from several threads
    are serialised by a lock; do not share one verifier across processes.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        workers: int = 1,
        *,
        cache_size: int = 262_144,
        short_circuit: bool = True,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        deadline_s: float | None = None,
        extraction: Extraction = "last_box",
        _test_faults: dict[str, str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"MathVerifier: timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"MathVerifier: workers must be >= 1, got {workers}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"MathVerifier: start_method must be 'spawn' or 'forkserver', got {start_method!r} "
                "('fork' is unsafe next to torch threads)"
            )
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"MathVerifier: deadline_s must be > 0 or None, got {deadline_s}")
        if extraction not in EXTRACTIONS:
            raise ValueError(f"MathVerifier: extraction must be one of {EXTRACTIONS}, got {extraction!r}")
        self.timeout_s = float(timeout_s)
        self.deadline_s = deadline_s
        self.extraction: Extraction = extraction
        self.num_workers = workers
        self.cache_size = cache_size
        self.short_circuit = short_circuit
        self.startup_timeout_s = startup_timeout_s
        self._cache: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._stats = dict.fromkeys(
            (
                "answers",
                "no_answer",
                "cache_hits",
                "short_circuits",
                "verified",
                "timeouts",
                "deadline_skips",
                "errors",
                "worker_restarts",
            ),
            0,
        )
        self._seconds = 0.0
        self._pool = _MathPool(
            worker_args=(dict(_test_faults or {}),),
            num_workers=workers,
            timeout_s=self.timeout_s,
            startup_timeout_s=startup_timeout_s,
            stats=self._stats,
            start_method=start_method,
        )
        self._workers = self._pool.workers  # the live list, which the finalizer empties
        self._finalizer = weakref.finalize(self, kill_workers, self._workers)

    @classmethod
    def from_config(cls, reward: Any) -> MathVerifier:
        """A verifier for a run's ``reward:`` section (graftrl.config.RewardConfig)."""
        return cls(
            timeout_s=reward.timeout_s,
            workers=reward.workers,
            deadline_s=reward.deadline_s,
            extraction=reward.extraction,
        )

    # ---------------------------------------------------------------- public API

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Return 1.0/0.0 per response: does its answer (``extraction``) equal the gold answer?"""
        if len(responses) != len(answers):
            raise ValueError(
                f"MathVerifier.score: got {len(responses)} responses but {len(answers)} answers "
                "(pass one gold answer per response, repeating it for each sample of a prompt)"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier.score called after close(); create a new verifier")
            t0 = time.perf_counter()
            rewards = [0.0] * len(responses)
            todo: dict[tuple[str, str], list[int]] = {}
            cache = self._cache
            stats = self._stats
            last_box = self.extraction == "last_box"
            for i, (response, gold) in enumerate(zip(responses, answers, strict=True)):
                extracted = extract_last_boxed(response) if last_box else response
                if extracted is None or not extracted.strip():
                    stats["no_answer"] += 1
                    continue
                key = (str(gold), extracted)
                hit = cache.get(key)
                if hit is not None:
                    cache.move_to_end(key)
                    stats["cache_hits"] += 1
                    rewards[i] = hit
                elif key in todo:
                    stats["cache_hits"] += 1  # repeated within this batch: verified once
                    todo[key].append(i)
                elif (
                    last_box and self.short_circuit and (fast := fast_verdict(key[0], extracted)) is not None
                ):
                    stats["short_circuits"] += 1
                    rewards[i] = fast
                    self._remember(key, fast)
                else:
                    todo[key] = [i]
            if todo:
                keys = list(todo)
                verdicts = self._verify_many(
                    keys, deadline=None if self.deadline_s is None else t0 + self.deadline_s
                )
                for key, verdict in zip(keys, verdicts, strict=True):
                    value = 1.0 if verdict == CORRECT else 0.0
                    if verdict != SKIPPED:  # never tried: a later call may verify it
                        self._remember(key, value)
                    for i in todo[key]:
                        rewards[i] = value
            stats["answers"] += len(responses)
            self._seconds += time.perf_counter() - t0
            return rewards

    def stats(self) -> dict[str, float]:
        """Counters since construction: answers, no_answer, cache_hits, short_circuits, verified
        (answered by a worker), timeouts (per answer), deadline_skips (answers cut by a call's
        overall deadline), errors, worker_restarts; plus cache_entries and the wall-clock seconds
        spent in score()."""
        out: dict[str, float] = dict(self._stats)
        out["cache_entries"] = len(self._cache)
        out["seconds"] = self._seconds
        return out

    def start(self) -> None:
        """Start the workers now and wait until they are ready (else the first score() does).

        Worker start-up (a fresh interpreter importing math_verify and sympy) takes about a
        second; call this before a timed loop so the first batch does not pay for it.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier.start called after close(); create a new verifier")
            self._verify_many([], wait_ready=True)

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes (empty until the first verification)."""
        return self._pool.worker_pids

    def close(self) -> None:
        """Stop the worker processes; idempotent. The verifier cannot score afterwards."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _remember(self, key: tuple[str, str], value: float) -> None:
        self._cache[key] = value
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _verify_many(
        self, items: list[tuple[str, str]], wait_ready: bool = False, deadline: float | None = None
    ) -> list[int]:
        """Verify unique (gold, extracted) pairs on the workers; returns one verdict code each.

        ``deadline`` (a ``time.perf_counter`` instant): pairs not settled by then get ``SKIPPED``.
        """
        return self._pool.run([(*item, self.extraction) for item in items], wait_ready, deadline)


class _MathPool(WorkerPool[int]):
    """The math workers' verdicts are their codes; an answer its worker died on is an ``ERROR``,
    one that timed out ``WRONG`` (cached: a hanging answer is no right answer), one skipped at the
    call's deadline ``SKIPPED`` (not cached)."""

    target = staticmethod(worker_main)
    process_name = "graftrl-math-verify"
    owner = "MathVerifier"
    max_chunk = 32
    answered_key = "verified"

    def answer(self, message: int) -> int:
        return message

    def is_error(self, verdict: int) -> bool:
        return verdict == ERROR

    def unanswered(self, why: Unanswered, w: Worker | None) -> int:
        return {"timed out": WRONG, "skipped": SKIPPED}.get(why, ERROR)

    def refusal(self, w: Worker) -> BaseException:
        return RuntimeError(
            f"MathVerifier: worker process failed to start 3 times (last exit code "
            f"{w.proc.exitcode}); check that math_verify imports in a fresh interpreter "
            "and that the calling script has an `if __name__ == '__main__':` guard"
        )


# --------------------------------------------------------------------------------------------
# One-off convenience
# --------------------------------------------------------------------------------------------

_shared: dict[float, MathVerifier] = {}
_shared_lock = threading.Lock()


def shared_verifier(timeout_s: float = 5.0) -> MathVerifier:
    """The process's verifier for this per-answer timeout, started lazily and closed at exit.

    For scripts, notebooks and reward functions of other trainers (``graftrl.integrations.trl.
    math_reward``); graftrl's own training loops own a ``MathVerifier``.
    """
    with _shared_lock:
        verifier = _shared.get(timeout_s)
        if verifier is None:
            verifier = _shared[timeout_s] = MathVerifier(timeout_s=timeout_s)
    return verifier


def verify_answer(response: str, answer: str, timeout_s: float = 5.0) -> float:
    """Score one response (1.0/0.0) with the shared verifier of this timeout.

    Convenient for scripts and notebooks; training loops should own a ``MathVerifier`` and
    call ``score`` on whole batches.
    """
    return shared_verifier(timeout_s).score([response], [answer])[0]


@atexit.register
def _close_shared() -> None:
    for verifier in _shared.values():
        verifier.close()
    _shared.clear()
