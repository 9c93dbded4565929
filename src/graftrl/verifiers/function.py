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
and replaced. Identical (response, problem id) pairs within one call are scored once. The workers
are a :class:`graftrl.models.worker_pool.WorkerPool`, as the math verifier's are: spawned processes
that die with their parent, a per-call overall deadline (``reward.deadline_s``) that worker start-up
is not charged to. Scripts that build this verifier need the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from graftrl.files import sha256_file
from graftrl.models.worker_pool import (
    READY,
    Unanswered,
    Worker,
    WorkerPool,
    die_with_parent,
    kill_workers,
    received_chunks,
)
from graftrl.storage.data import Problem
from graftrl.verifiers.base import ERROR, TIMEOUT, WRONG, Verdict, VerifierBase, VerifierError, check_lengths

if TYPE_CHECKING:
    from graftrl.config.rewards import RewardConfig

__all__ = ["FunctionVerifier", "parse_scorer_path", "to_reward"]

LOAD_FAILED = -2
"""Index of a worker's start-up message saying why the scorer did not load (else ``READY``, with
the signature style)."""
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
    die_with_parent(parent_pid, use_pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        fn, style, extra_info = _load(target, name, is_file)
    except _LoadError as e:
        conn.send((LOAD_FAILED, str(e)))
        return
    conn.send((READY, style))
    for chunk in received_chunks(conn):
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
        self._lock = threading.Lock()
        self._closed = False
        keys = ("answers", "scored", "duplicates", "timeouts", "deadline_skips", "errors", "worker_restarts")
        self._stats = dict.fromkeys(keys, 0)
        self._seconds = 0.0
        self._pool = _ScorerPool(
            worker_args=(self.target, self.function, self.is_file),
            num_workers=workers,
            timeout_s=self.timeout_s,
            startup_timeout_s=startup_timeout_s,
            stats=self._stats,
            path=path,
            deadline_s=deadline_s,
            success_threshold=success_threshold,
        )
        self._workers = self._pool.workers  # the live list, which the finalizer empties
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

    @property
    def signature(self) -> str | None:
        """``verl`` or ``plain`` once a worker has loaded the scorer."""
        return self._pool.signature

    def start(self) -> None:
        """Start the workers and load the scorer in them; ``VerifierError`` when it does not load."""
        with self._lock:
            self._check_open()
            self._pool.run([], wait_ready=True)

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
            scored = self._pool.run(items, deadline=deadline) if items else []
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
        return self._pool.worker_pids

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    # ---------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("FunctionVerifier used after close(); create a new verifier")


@dataclass(kw_only=True, eq=False)
class _ScorerPool(WorkerPool[Verdict]):
    """The scorer's workers (``worker_main``). A scorer that does not load, or loads too slowly,
    refuses the call at once (``VerifierError``): another worker would not load it either."""

    target = staticmethod(worker_main)
    process_name = "graftrl-scorer"
    owner = "FunctionVerifier"
    max_chunk = 16
    answered_key = "scored"
    # Any failed send (a dead worker, a row that does not pickle) charges one response.
    send_errors = (Exception,)

    path: str
    deadline_s: float | None
    success_threshold: float
    signature: str | None = field(default=None, init=False)  # what READY said: FunctionVerifier.signature

    def started(self, index: int, message: Any) -> None:
        if index == LOAD_FAILED:
            raise VerifierError(f"reward.function.path: {message}")
        self.signature = message

    def startup_timed_out(self, w: Worker) -> None:
        raise VerifierError(
            f"reward.function.path: loading {self.path!r} took more than "
            f"{self.startup_timeout_s:g} s; make the scorer module quick to import"
        )

    def answer(self, message: tuple[bool, Any]) -> Verdict:
        ok, value = message
        if not ok:
            return Verdict.failed(ERROR, value)
        reason = "correct" if value == 1.0 else f"scored {value:g}"
        if value >= self.success_threshold:
            return Verdict.correct(value, reason)
        return Verdict.failed(WRONG, reason, reward=value)

    def is_error(self, verdict: Verdict) -> bool:
        return verdict.failure == ERROR

    def unanswered(self, why: Unanswered, w: Worker | None) -> Verdict:
        if why == "died" and w is not None:
            w.proc.join(timeout=1.0)  # for its exit code
            return Verdict.failed(ERROR, f"scorer's worker died (exit code {w.proc.exitcode})")
        if why == "timed out":
            return Verdict.failed(
                TIMEOUT, f"scorer ran past reward.function.timeout_s ({self.timeout_s:g} s)"
            )
        if why == "skipped":
            return Verdict.failed(TIMEOUT, f"not scored within reward.deadline_s ({self.deadline_s:g} s)")
        return Verdict.failed(ERROR, "not scored")

    def refusal(self, w: Worker) -> BaseException:
        w.proc.join(timeout=1.0)  # for its exit code
        return VerifierError(
            f"reward.function.path: the scorer's worker exited (code {w.proc.exitcode}) while "
            f"loading {self.path!r}, 3 times; check that the scorer imports in a fresh "
            "interpreter, and that the calling script has an `if __name__ == '__main__':` guard"
        )
