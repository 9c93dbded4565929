"""The ``function`` verifier: the user's own scorer (``reward.function.path``), run in killable
worker processes, never in the calling process.

The scorer is named ``path/to/score.py:fn`` (a file, loaded by path, its folder put on the
worker's ``sys.path``) or ``package.module:fn`` (imported). How it is called is read from its
parameters:

- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` (it
  has ``data_source`` and ``solution_str``) is called as verl calls it:
  ``fn(data_source=row["data_source"], solution_str=response, ground_truth=row["ground_truth"],
  extra_info=row["extra_info"])``, the ground truth falling back to ``reward_model.ground_truth``
  and then the row's ``answer``, and ``extra_info`` passed only when the function accepts it;
- any other is called ``fn(response, answer, row)``, ``row`` a plain dict of the problem (``id``,
  ``problem``, ``answer``, ``family`` and the row's other fields).

It may return a bool (1.0/0.0), a number, or a dict with ``score`` (verl's form; other keys are
ignored). Rewards outside [0, 1] are kept as they are (a scale of the user's); a response is a
success when its reward is at least ``reward.success_threshold``. A scorer that raises, returns
anything else (NaN or infinity included) or kills its worker scores 0 with failure ``error``; one
that runs past ``reward.function.timeout_s`` scores 0 with ``timeout``, and its worker is killed
and replaced. Identical (response, problem id) pairs within one call are scored once. The worker
design is the math verifier's (:mod:`graftrl.models.rewards`): spawned processes that die with
their parent, a per-call overall deadline (``reward.deadline_s``) that worker start-up is not charged
to. Scripts that build this verifier need the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import multiprocessing as mp
import numbers
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from graftrl.files import sha256_file
from graftrl.models.verify_worker import Worker, _die_with_parent, kill_workers
from graftrl.storage.data import Problem
from graftrl.verifiers.base import ERROR, TIMEOUT, WRONG, Verdict, VerifierBase, VerifierError, check_lengths

if TYPE_CHECKING:
    from graftrl.config.rewards import RewardConfig

__all__ = ["FunctionVerifier", "parse_scorer_path", "to_reward"]

READY, LOAD_FAILED = -1, -2
"""Indexes of a worker's start-up messages: loaded (with the signature style), or not (why)."""
_FORMS = "write 'path/to/score.py:compute_score' or 'package.module:function'"
_MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_scorer_path(path: str) -> tuple[str, str, bool]:
    """``(target, function, is_file)`` of ``reward.function.path``: an absolute file path or a module
    name. Raises ``VerifierError`` for a malformed one or a file that does not exist."""
    where, sep, name = str(path).strip().rpartition(":")
    if not sep or not where:
        raise VerifierError(f"reward.function.path: {path!r} names no function; {_FORMS}")
    if not name.isidentifier():
        raise VerifierError(f"reward.function.path: {name!r} in {path!r} is not a function name; {_FORMS}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        file = Path(where).expanduser().resolve()
        if not file.is_file():
            raise VerifierError(
                f"reward.function.path: no scorer file {file} (from {path!r}); give the path of an "
                "existing .py file, relative to the working folder or absolute"
            )
        return str(file), name, True
    if not _MODULE.fullmatch(where):
        raise VerifierError(f"reward.function.path: {where!r} in {path!r} is no module name; {_FORMS}")
    return where, name, False


# --------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------


class _LoadError(Exception):
    pass


def _load(target: str, name: str, is_file: bool) -> tuple[Callable[..., Any], str, bool]:
    """The scorer, its style (``verl`` or ``plain``) and whether it takes ``extra_info``."""
    shown = os.path.basename(target) if is_file else target
    try:
        if is_file:
            folder = os.path.dirname(target)
            if folder not in sys.path:
                sys.path.append(folder)
            module_name = "graftrl_scorer_" + re.sub(r"\W", "_", Path(target).stem)
            spec = importlib.util.spec_from_file_location(module_name, target)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[module_name] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
    except ModuleNotFoundError as e:
        if is_file:
            raise _LoadError(
                f"loading {shown} raised ModuleNotFoundError: {_one_line(e)}; fix the scorer"
            ) from e
        raise _LoadError(
            f"cannot import {target!r} ({_one_line(e)}); name a module this Python imports, or a file "
            "'path/to/score.py:function'"
        ) from e
    except BaseException as e:
        raise _LoadError(f"loading {shown} raised {type(e).__name__}: {_one_line(e)}; fix the scorer") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        what = "has no function" if fn is None else "has a non-callable"
        raise _LoadError(f"{shown} {what} {name!r} (its functions: {', '.join(found) or 'none'}); name one")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn, "plain", False
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    verl = "data_source" in params and "solution_str" in params
    extra_info = verl and ("extra_info" in params or takes_kwargs)
    try:
        if verl:
            keys = ("data_source", "solution_str", "ground_truth") + (("extra_info",) if extra_info else ())
            inspect.signature(fn).bind(**dict.fromkeys(keys))
        else:
            inspect.signature(fn).bind(None, None, None)
    except TypeError as e:
        raise _LoadError(
            f"{shown}:{name}{inspect.signature(fn)} cannot be called as a scorer ({_one_line(e)}); it "
            "takes (response, answer, row), or verl's (data_source, solution_str, ground_truth, "
            "extra_info=None)"
        ) from e
    return fn, "verl" if verl else "plain", extra_info


def to_reward(value: Any) -> float:
    """A scorer's return value as a reward: bool -> 1.0/0.0, a number -> float, a dict -> its
    ``score``. Raises ``ValueError`` (saying what it got) for anything else, NaN and infinity."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict without 'score' (keys: {', '.join(map(str, list(value)[:8]))})")
        value = value["score"]
    if not isinstance(value, str | bytes) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # numpy and torch scalars
        except (TypeError, ValueError) as e:
            raise ValueError(f"a {type(value).__name__} that is not one number") from e
    if isinstance(value, bool | numbers.Real):
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(repr(reward))
        return reward
    raise ValueError(f"{type(value).__name__} {_one_line(repr(value), 60)}")


def _score(fn: Callable[..., Any], style: str, extra_info: bool, response: str, row: dict) -> Any:
    if style == "plain":
        return fn(response, row["answer"], row)
    reward_model = row.get("reward_model")
    if "ground_truth" in row:
        truth = row["ground_truth"]
    elif isinstance(reward_model, dict) and "ground_truth" in reward_model:
        truth = reward_model["ground_truth"]
    else:
        truth = row["answer"]
    kwargs = {"data_source": row.get("data_source"), "solution_str": response, "ground_truth": truth}
    if extra_info:
        kwargs["extra_info"] = row.get("extra_info")
    return fn(**kwargs)


def worker_main(
    conn: Connection, target: str, name: str, is_file: bool, parent_pid: int, use_pdeathsig: bool
) -> None:
    """Worker loop: load the scorer, then score chunks of ``(index, response, row)``, one message
    back per response: ``(index, (True, reward))`` or ``(index, (False, why))``."""
    _die_with_parent(parent_pid, use_pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        fn, style, extra_info = _load(target, name, is_file)
    except _LoadError as e:
        conn.send((LOAD_FAILED, str(e)))
        return
    conn.send((READY, style))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:  # verify_worker.STOP
            return
        for index, response, row in chunk:
            try:
                value = _score(fn, style, extra_info, response, row)
            except BaseException as e:  # SystemExit too: a scorer's sys.exit() is its error
                conn.send((index, (False, f"scorer raised {type(e).__name__}: {_one_line(e)}")))
                continue
            try:
                conn.send((index, (True, to_reward(value))))
            except ValueError as e:
                why = f"scorer returned {e} (expected a bool, a number or a dict with 'score')"
                conn.send((index, (False, why)))


# --------------------------------------------------------------------------------------------
# The verifier
# --------------------------------------------------------------------------------------------


def _row(problem: Problem) -> dict[str, Any]:
    fields = dict(id=problem.id, problem=problem.problem, answer=problem.answer, family=problem.family)
    return {**problem.extra, **fields}


class FunctionVerifier(VerifierBase):
    """The user's scorer (module docstring) in ``workers`` killable processes.

    Args:
        path: ``reward.function.path``; checked here (form, file), loaded by ``start()``.
        timeout_s: budget of one scorer call; past it the response scores 0 (``timeout``) and its
            worker is replaced.
        workers: worker processes; responses are spread over them in chunks.
        deadline_s: overall budget of one ``verify`` call from the moment a worker is ready; what
            is not scored by then scores 0 (``timeout``). None = no overall deadline.
        success_threshold: a reward at or above it is a success (no failure class).
        startup_timeout_s: how long a worker may take to load the scorer.
    """

    kind: ClassVar[str] = "function"

    def __init__(
        self,
        path: str,
        *,
        timeout_s: float = 30.0,
        workers: int = 1,
        deadline_s: float | None = None,
        success_threshold: float = 1.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if timeout_s <= 0 or workers < 1 or (deadline_s is not None and deadline_s <= 0):
            raise ValueError(
                f"FunctionVerifier: need timeout_s > 0, workers >= 1 and deadline_s > 0 or None; got "
                f"{timeout_s}, {workers}, {deadline_s}"
            )
        self.path = path
        self.target, self.function, self.is_file = parse_scorer_path(path)
        self.timeout_s = float(timeout_s)
        self.num_workers = workers
        self.deadline_s = deadline_s
        self.success_threshold = success_threshold
        self.startup_timeout_s = startup_timeout_s
        self.signature: str | None = None
        """``verl`` or ``plain`` once a worker has loaded the scorer."""
        self._ctx = mp.get_context("spawn")
        self._workers: list[Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        keys = ("answers", "scored", "duplicates", "timeouts", "deadline_skips", "errors", "worker_restarts")
        self._stats = dict.fromkeys(keys, 0)
        self._seconds = 0.0
        self._finalizer = weakref.finalize(self, kill_workers, self._workers)

    @classmethod
    def from_config(cls, reward: RewardConfig) -> FunctionVerifier:
        """The verifier of a run's ``reward`` section (``reward.function``, ``workers``, ``deadline_s``)."""
        return cls(
            str(reward.function.path),
            timeout_s=reward.function.timeout_s,
            workers=reward.workers,
            deadline_s=reward.deadline_s,
            success_threshold=reward.success_threshold,
        )

    def file_digest(self) -> str | None:
        """SHA-256 of the scorer file's bytes (None for an import path): part of a compare cell's digest."""
        return sha256_file(Path(self.target))[0] if self.is_file else None

    def start(self) -> None:
        """Start the workers and load the scorer in them; ``VerifierError`` when it does not load."""
        with self._lock:
            self._check_open()
            self._run([], wait_ready=True)

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        check_lengths("FunctionVerifier.verify", responses, problems)
        with self._lock:
            self._check_open()
            t0 = time.perf_counter()
            slots: dict[tuple[str, str], list[int]] = {}
            items: list[tuple[str, dict[str, Any]]] = []
            for i, (response, problem) in enumerate(zip(responses, problems, strict=True)):
                key = (response, problem.id)
                if key not in slots:
                    slots[key] = []
                    items.append((response, _row(problem)))
                slots[key].append(i)
            self._stats["duplicates"] += len(responses) - len(items)
            deadline = None if self.deadline_s is None else t0 + self.deadline_s
            scored = self._run(items, deadline=deadline) if items else []
            verdicts: list[Verdict] = [Verdict.failed(ERROR, "not scored")] * len(responses)
            for indexes, verdict in zip(slots.values(), scored, strict=True):
                for i in indexes:
                    verdicts[i] = verdict
            self._stats["answers"] += len(responses)
            self._seconds += time.perf_counter() - t0
            return verdicts

    def stats(self) -> dict[str, float]:
        """Counters since construction: answers, scored (by a worker), duplicates (scored once in a
        call), timeouts, deadline_skips, errors, worker_restarts, and the seconds spent in verify()."""
        return {**self._stats, "seconds": self._seconds}

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    # ---------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("FunctionVerifier used after close(); create a new verifier")

    def _verdict(self, reward: float) -> Verdict:
        reason = "correct" if reward == 1.0 else f"scored {reward:g}"
        if reward >= self.success_threshold:
            return Verdict.correct(reward, reason)
        return Verdict.failed(WRONG, reason, reward=reward)

    def _spawn(self) -> Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        use_pdeathsig = threading.current_thread() is threading.main_thread()
        args = (child_conn, self.target, self.function, self.is_file, os.getpid(), use_pdeathsig)
        proc = self._ctx.Process(target=worker_main, args=args, name="graftrl-scorer", daemon=True)
        proc.start()
        child_conn.close()
        return Worker(proc=proc, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, w: Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()
        self._workers[self._workers.index(w)] = self._spawn()
        self._stats["worker_restarts"] += 1

    def _run(
        self, items: list[tuple[str, dict[str, Any]]], wait_ready: bool = False, deadline: float | None = None
    ) -> list[Verdict]:
        try:
            return self._dispatch(items, wait_ready, deadline)
        except BaseException:
            kill_workers(self._workers)  # interrupted or refused: no half-done work survives
            raise

    def _dispatch(
        self, items: list[tuple[str, dict[str, Any]]], wait_ready: bool, deadline: float | None
    ) -> list[Verdict]:
        budget = None if deadline is None else max(0.0, deadline - time.perf_counter())
        call_due = float("inf")
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())
        verdicts: list[Verdict | None] = [None] * len(items)
        pending: deque[int] = deque(range(len(items)))
        remaining = len(items)
        failed_starts = 0
        stats = self._stats

        def settle(index: int, verdict: Verdict) -> None:
            nonlocal remaining
            verdicts[index] = verdict
            remaining -= 1
            if verdict.failure == ERROR:
                stats["errors"] += 1

        def fail(w: Worker, verdict: Verdict | None) -> None:
            """The worker hung (``verdict``) or died: charge its current response, re-queue the rest."""
            nonlocal failed_starts
            if not w.ready:
                w.proc.join(timeout=1.0)
                failed_starts += 1
                if failed_starts >= 3:
                    raise VerifierError(
                        f"reward.function.path: the scorer's worker exited (code {w.proc.exitcode}) while "
                        f"loading {self.path!r}, 3 times; check that the scorer imports in a fresh "
                        "interpreter, and that the calling script has an `if __name__ == '__main__':` guard"
                    )
            if w.inflight:
                if verdict is None:
                    w.proc.join(timeout=1.0)
                    code = w.proc.exitcode
                    verdict = Verdict.failed(ERROR, f"scorer's worker died (exit code {code})")
                settle(w.inflight.popleft(), verdict)
                pending.extendleft(reversed(w.inflight))
                w.inflight.clear()
            self._replace(w)

        timeout_verdict = Verdict.failed(
            TIMEOUT, f"scorer ran past reward.function.timeout_s ({self.timeout_s:g} s)"
        )
        while remaining or (wait_ready and not all(w.ready for w in self._workers)):
            now = time.monotonic()
            if budget is not None and call_due == float("inf") and any(w.ready for w in self._workers):
                call_due = now + budget
            for w in list(self._workers):
                if w.ready and not w.inflight and pending:
                    size = max(1, min(16, -(-len(pending) // self.num_workers)))
                    chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                    w.inflight.extend(chunk)
                    w.deadline = now + self.timeout_s
                    try:
                        w.conn.send([(i, *items[i]) for i in chunk])
                    except Exception:
                        fail(w, None)  # died under us; charging one response guarantees progress

            def due(w: Worker) -> float:
                if not w.ready:
                    return w.started_at + self.startup_timeout_s
                return w.deadline if w.inflight else float("inf")

            next_due = min([due(w) for w in self._workers] + ([call_due] if remaining else []))
            timeout = None if next_due == float("inf") else max(0.0, next_due - time.monotonic())
            by_conn = {w.conn: w for w in self._workers}
            for conn in wait(list(by_conn), timeout=timeout):
                w = by_conn[conn]
                try:
                    while conn.poll():
                        index, message = conn.recv()
                        if index == LOAD_FAILED:
                            raise VerifierError(f"reward.function.path: {message}")
                        if index == READY:
                            w.ready, self.signature, failed_starts = True, message, 0
                            continue
                        if not w.inflight or w.inflight[0] != index:
                            raise RuntimeError(
                                f"FunctionVerifier: internal error, worker answered item {index}"
                            )
                        w.inflight.popleft()
                        w.deadline = time.monotonic() + self.timeout_s
                        stats["scored"] += 1
                        ok, value = message
                        settle(index, self._verdict(value) if ok else Verdict.failed(ERROR, value))
                except (EOFError, OSError):
                    fail(w, None)  # the worker died (os._exit, a crash, the OOM killer)

            now = time.monotonic()
            for w in list(self._workers):
                if not w.ready and now > w.started_at + self.startup_timeout_s:
                    raise VerifierError(
                        f"reward.function.path: loading {self.path!r} took more than "
                        f"{self.startup_timeout_s:g} s; make the scorer module quick to import"
                    )
                if w.inflight and now > w.deadline:
                    stats["timeouts"] += 1
                    fail(w, timeout_verdict)
            if remaining and now > call_due:
                for w in list(self._workers):  # busy workers are replaced: the next call starts clean
                    if w.inflight:
                        w.inflight.clear()
                        self._replace(w)
                skipped = Verdict.failed(
                    TIMEOUT, f"not scored within reward.deadline_s ({self.deadline_s:g} s)"
                )
                for index, verdict in enumerate(verdicts):
                    if verdict is None:
                        verdicts[index] = skipped
                        stats["deadline_skips"] += 1
                remaining = 0
        return [v if v is not None else Verdict.failed(ERROR, "not scored") for v in verdicts]
