"""``reward.kind: code``: Python programs scored by the fraction of the row's tests they pass
(``reward.code.partial_credit: false``: 1 when all pass, else 0).

The program is the response's last fenced code block (an unclosed last fence runs to the end of
the response, as a length-truncated answer does), or the whole response when it has none. Tests
come in the problem row (``Problem.extra``) in either form code datasets use:

- **assert statements** (HumanEval/MBPP): ``tests`` (or ``test_list``, or HumanEval's one ``test``
  string defining ``check(candidate)``) with an optional ``entry_point`` and ``setup`` (or
  ``test_setup_code``). The tests run in a judge process of their own, calling the program's
  top-level functions through a pipe (``sandbox_entry``): arguments and results must be data.
- **stdin/stdout pairs** (APPS/CodeContests): ``tests`` as ``[{"input": ..., "output": ...}]``
  (or ``{"inputs": [...], "outputs": [...]}``, also inside verl's ``ground_truth``). Each test runs
  the program once with its input; stdout is compared here, outside the sandbox, line by line with
  trailing white space ignored, and the run must exit 0.

Every program runs in ``graftrl.verifiers.sandbox`` (never in this process); programs run in
parallel, one per ``reward.workers`` thread, and an identical (program, tests) pair is run once
(an LRU of verdicts, like the math verifier's). A test past ``reward.code.test_timeout_s`` fails as
``timeout`` and the program is restarted for the next test; ``program_timeout_s`` bounds a program's
tests together, and ``reward.deadline_s`` a whole call.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from graftrl.storage.data import Problem
from graftrl.verifiers.base import (
    CRASH,
    ERROR,
    MEMORY,
    NO_CODE,
    SYNTAX_ERROR,
    TIMEOUT,
    Verdict,
    VerifierBase,
    VerifierError,
    check_lengths,
)
from graftrl.verifiers.code_suite import (
    FAIL,
    PASS,
    CodeTests,
    TestResult,
    extract_program,
    same_output,
    summarise,
)
from graftrl.verifiers.sandbox import Isolation, Limits, Sandbox, exchange, json_lines
from graftrl.verifiers.sandbox_entry import SYNTAX_EXIT
from graftrl.verifiers.zygote import Zygotes

__all__ = ["CodeTests", "CodeVerifier", "extract_program", "same_output", "summarise"]


class _ForkServerFailures(threading.local):
    """This thread's program: fork-server failures, and whether its verdict came from one."""

    count = 0
    final = False


class CodeVerifier(VerifierBase):
    """Reward = fraction of the row's tests a response's program passes (or, without partial credit,
    1 when it passes all and else 0), run in the sandbox."""

    kind: ClassVar[str] = "code"

    def __init__(
        self,
        *,
        isolation: Isolation = "bwrap",
        limits: Limits | None = None,
        test_timeout_s: float = 4.0,
        program_timeout_s: float = 30.0,
        workers: int = 1,
        max_tests: int = 64,
        deadline_s: float | None = None,
        python: str | None = None,
        cache_size: int = 65_536,
        fork_server: bool = True,
        partial_credit: bool = True,
    ) -> None:
        self.sandbox = Sandbox(isolation, limits, python)
        self.zygotes = Zygotes(self.sandbox) if fork_server and self.sandbox.fork_server_ok() else None
        """Assert tests in each slot's fork servers (``graftrl.verifiers.zygote``); None: two
        sandboxes per program (``fork_server: false``, ``reward.sandbox: none``, or not root)."""
        self._zygote_failed = _ForkServerFailures()
        self.test_timeout_s = test_timeout_s
        self.program_timeout_s = program_timeout_s
        self.workers = workers
        self.max_tests = max_tests
        self.partial_credit = partial_credit
        self.deadline_s = deadline_s
        self._cache: OrderedDict[tuple[str, str], Verdict] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="graftrl-code")
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            (
                "answers",
                "no_code",
                "cache_hits",
                "programs",
                "tests",
                "timeouts",
                "crashes",
                "deadline_skips",
                "fork_server_failures",
            ),
            0,
        )
        self._seconds = 0.0

    @classmethod
    def from_config(cls, reward: Any) -> CodeVerifier:
        code = reward.code
        limits = Limits(code.cpu_s, code.memory_mb, code.processes, code.file_mb, code.output_kb << 10)
        return cls(
            isolation=reward.sandbox,
            limits=limits,
            test_timeout_s=code.test_timeout_s,
            program_timeout_s=code.program_timeout_s,
            workers=reward.workers,
            max_tests=code.max_tests,
            deadline_s=reward.deadline_s,
            python=code.python,
            fork_server=code.fork_server,
            partial_credit=code.partial_credit,
        )

    # ------------------------------------------------------------ the interface

    def check_problem(self, problem: Problem) -> str | None:
        try:
            CodeTests.from_row(problem.extra, self.max_tests)
        except ValueError as exc:
            return str(exc)
        return None

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        check_lengths("CodeVerifier.verify", responses, problems)
        started = time.perf_counter()
        due = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        verdicts: list[Verdict | None] = [None] * len(responses)
        todo: dict[tuple[str, str], list[int]] = {}
        suites: dict[tuple[str, str], CodeTests] = {}
        with self._lock:
            for i, (response, problem) in enumerate(zip(responses, problems, strict=True)):
                program = extract_program(response)
                if program is None:
                    self._stats["no_code"] += 1
                    verdicts[i] = Verdict.failed(NO_CODE, "no code found")
                    continue
                try:
                    suite = CodeTests.from_row(problem.extra, self.max_tests)
                except ValueError as exc:
                    verdicts[i] = Verdict.failed(ERROR, f"problem {problem.id!r}: {exc}")
                    continue
                key = (program, suite.key())
                cached = self._cache.get(key)
                if cached is not None or key in todo:
                    self._stats["cache_hits"] += 1
                if cached is not None:
                    self._cache.move_to_end(key)
                    verdicts[i] = cached
                else:
                    todo.setdefault(key, []).append(i)
                    suites[key] = suite
        futures = {key: self._pool.submit(self._judge, key[0], suites[key], due) for key in todo}
        for key, future in futures.items():
            verdict, cacheable = future.result()
            with self._lock:
                if cacheable:
                    self._cache[key] = verdict
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
            for i in todo[key]:
                verdicts[i] = verdict
        with self._lock:
            self._stats["answers"] += len(responses)
            self._seconds += time.perf_counter() - started
        return [v if v is not None else Verdict.failed(ERROR, "not verified") for v in verdicts]

    def start(self) -> None:
        """Run a known program through the sandbox: a broken sandbox fails here, in one line."""
        if self.sandbox.isolation == "none":
            warnings.warn(
                "reward.sandbox is none: model-written programs run WITHOUT isolation (network, files "
                "and environment of this machine are reachable); use it only for code you trust",
                stacklevel=2,
            )
        function = "def add(a, b):\n    return a + b\n"
        calls = CodeTests(False, ("assert add(1, 2) == 3", "assert add(2, 2) == 5"))
        script = "print(sum(map(int, input().split())))\n"
        slot = self.sandbox.take_slot()
        try:
            got = [r.outcome for r in self._run_calls(function, calls, slot, time.monotonic() + 60.0)[1]]
            got += [self._run_stdio_test(script, ("20 22\n", "42\n"), 0, slot, 60.0).outcome]
        finally:
            self.sandbox.give_slot(slot)
        if got != [PASS, FAIL, PASS]:
            raise VerifierError(
                f"reward.sandbox: the sandbox's self-check failed ({self._start_failure or got}); "
                + ("reward.code.fork_server: false runs two sandboxes per program; " if self.zygotes else "")
                + "bubblewrap needs user namespaces (or root); set reward.sandbox: none to run programs "
                "WITHOUT isolation"
            )

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, "cache_entries": len(self._cache), "seconds": self._seconds}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.zygotes is not None:
            self.zygotes.close()

    # ------------------------------------------------------------ one program

    _start_failure: str = ""

    def _judge(self, program: str, suite: CodeTests, due: float | None) -> tuple[Verdict, bool]:
        now = time.monotonic()
        if due is not None and now >= due:
            with self._lock:
                self._stats["deadline_skips"] += 1
            return Verdict.failed(
                TIMEOUT, "not run: the call's deadline (reward.deadline_s) had passed"
            ), False
        program_due = now + self.program_timeout_s
        if due is not None:
            program_due = min(program_due, due)
        slot = self.sandbox.take_slot()
        self._zygote_failed.count, self._zygote_failed.final = 0, False
        try:
            if suite.stdio:
                load, results = "ok", self._run_stdio(program, suite, slot, program_due)
            else:
                load, results = self._run_calls(program, suite, slot, program_due)
        finally:
            self.sandbox.give_slot(slot)
        with self._lock:
            self._stats["programs"] += 1
            self._stats["tests"] += len(results)
            self._stats["timeouts"] += sum(r.outcome == TIMEOUT for r in results)
            self._stats["crashes"] += sum(r.outcome == CRASH for r in results)
            self._stats["fork_server_failures"] += self._zygote_failed.count
        verdict = summarise(load, results, len(suite.tests), self.partial_credit)
        return verdict, not self._zygote_failed.final

    def _run_stdio(self, program: str, suite: CodeTests, slot: int, due: float) -> list[TestResult]:
        results: list[TestResult] = []
        for index, test in enumerate(suite.tests):
            left = due - time.monotonic()
            if left <= 0:
                break
            result = self._run_stdio_test(program, test, index, slot, min(self.test_timeout_s, left))
            results.append(result)
            if result.outcome == SYNTAX_ERROR:
                break
        return results

    def _run_stdio_test(
        self, program: str, test: tuple[str, str], index: int, slot: int, timeout_s: float
    ) -> TestResult:
        started = self.sandbox.start("run", {"program.py": program.encode()}, slot, stdin=subprocess.PIPE)
        try:
            out, err, timed_out, overflow = exchange(
                started, test[0].encode(), self.sandbox.limits.output_bytes, time.monotonic() + timeout_s
            )
        finally:
            started.kill()
        code = started.proc.returncode
        if timed_out:
            return TestResult(index, TIMEOUT, f"ran past {timeout_s:g} s")
        if overflow:
            return TestResult(index, CRASH, f"printed more than {self.sandbox.limits.output_bytes >> 10} KiB")
        if code in (-9, 128 + 9, -24, 128 + 24):  # SIGXCPU, then SIGKILL, of RLIMIT_CPU
            return TestResult(index, TIMEOUT, "CPU time limit")
        if code == SYNTAX_EXIT:
            return TestResult(index, SYNTAX_ERROR, err.decode("utf-8", "replace").strip()[-300:])
        if b"MemoryError" in err:
            return TestResult(index, MEMORY, "MemoryError")
        if code != 0:
            last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {code}"]
            if code == 1 and not err and self.sandbox.isolation == "bwrap":
                self._start_failure = "exit code 1 without output"
            return TestResult(index, CRASH, last[0][:300])
        if same_output(out.decode("utf-8", "replace"), test[1]):
            return TestResult(index, PASS)
        return TestResult(index, FAIL, f"wrong output {out[:80].decode('utf-8', 'replace')!r}")

    def _run_calls(
        self, program: str, suite: CodeTests, slot: int, due: float
    ) -> tuple[str, list[TestResult]]:
        """Assert tests through a program and a judge sandbox; a test that hangs or kills the
        program ends that pair, and a fresh one carries on from the next test."""
        results: list[TestResult] = []
        while len(results) < len(suite.tests) and time.monotonic() < due:
            load, batch = self._call_pair(program, suite, len(results), slot, due)
            if load != "ok":
                return load, batch
            results.extend(batch)
            if not batch or batch[-1].outcome not in (TIMEOUT, CRASH):
                break
        return "ok", results

    def _call_pair(
        self, program: str, suite: CodeTests, start: int, slot: int, due: float
    ) -> tuple[str, list[TestResult]]:
        for _ in range(2 if self.zygotes is not None else 0):  # a failed fork server: once more
            if time.monotonic() >= due:
                break
            running = self.zygotes.run(slot, program, suite.judge_dict(start), self.test_timeout_s, due)
            try:
                load, results = self._read_judge(running.results, suite, start, due)
            finally:
                confirmed = running.end()
            if confirmed:
                return load, results
            self._zygote_failed.count += 1
        if self.zygotes is not None:
            self._zygote_failed.final = True
            self._start_failure = self.zygotes.error() or "a fork server did not confirm its clean-up"
            return CRASH, [TestResult(start, CRASH, "the fork server failed")]
        to_program_r, to_program_w = os.pipe()
        to_judge_r, to_judge_w = os.pipe()
        serve = judge = None
        try:
            serve = self.sandbox.start(
                "serve", {"program.py": program.encode()}, slot,
                args=(str(to_program_r), str(to_judge_w)), pass_fds=(to_program_r, to_judge_w),
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            judge = self.sandbox.start(
                "judge", {"tests.json": json.dumps(suite.judge_dict(start)).encode()}, slot,
                args=(str(to_judge_r), str(to_program_w), repr(self.test_timeout_s)),
                pass_fds=(to_judge_r, to_program_w),
            )  # fmt: skip
        finally:
            for fd in (to_program_r, to_program_w, to_judge_r, to_judge_w):
                os.close(fd)
        try:
            assert judge.proc.stdout is not None
            load, results = self._read_judge(judge.proc.stdout.fileno(), suite, start, due)
            if load != "ok" and judge.proc.poll() is not None and judge.proc.returncode not in (0, None):
                self._start_failure = judge.stderr_line() or f"judge exit code {judge.proc.returncode}"
        finally:
            judge.kill()
            if serve is not None:
                serve.kill()
        return load, results

    def _read_judge(self, fd: int, suite: CodeTests, start: int, due: float) -> tuple[str, list[TestResult]]:
        """The load outcome and the test results from the judge's lines on ``fd``."""
        load, results = "crash", []
        for message in json_lines(fd, due):
            if "load" in message:
                load = str(message["load"])
                if load != "ok":
                    return load, [TestResult(start, load, str(message.get("detail", ""))[:300])]
            elif "test" in message:
                index, outcome = start + int(message["test"]), str(message["outcome"])
                results.append(TestResult(index, outcome, str(message.get("detail", ""))))
        ended = bool(results) and results[-1].outcome in (TIMEOUT, CRASH)  # the judge stops there
        if load == "ok" and not ended and len(results) < len(suite.tests) - start:
            left = "timeout" if time.monotonic() >= due else "crash"
            results.append(TestResult(start + len(results), left, "the judge stopped"))
        return load, results
