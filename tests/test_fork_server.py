"""The code verifier's fork servers (``reward.code.fork_server``): the same verdicts as two
sandboxes per program, a dead or silent fork server replaced without harm to the next program,
and the mode off where its clean-up cannot hold (no root, no bubblewrap). Its hostile cases are in
test_sandbox_hostile.py, which runs every case in both modes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from graftrl.config.rewards import RewardConfig
from graftrl.storage.data import Problem
from graftrl.verifiers import zygote as zygote_module
from graftrl.verifiers.base import CRASH
from graftrl.verifiers.code import CodeVerifier

ADD = Problem(
    "add",
    "x",
    extra={
        "tests": [
            "assert add(1, 2) == 3",
            "assert add(2, 2) == 4",
            "assert add(-1, 1) == 0",
            "assert add(5, 0) == 5",
        ]
    },
)
RIGHT = "def add(a, b):\n    return a + b"


def _verifier(fork_server: bool, **kw) -> CodeVerifier:
    v = CodeVerifier(fork_server=fork_server, workers=2, test_timeout_s=1.0, program_timeout_s=6.0, **kw)
    v.start()
    return v


def test_both_modes_give_the_same_rewards_and_failure_classes():
    programs = [
        RIGHT,
        "```python\ndef add(a, b):\n    return a * b\n```",  # wrong but for one test
        "def add(a, b):\n    return a + b if a > 1 else 0",  # partly right
        "def add(a, b):\n    return a - b",
        "import time\ndef add(a, b):\n    time.sleep(3)\n    return a + b",  # every test past its timeout
        "import time\ndef add(a, b):\n    time.sleep(0.9 if a == 2 else 0)\n    return a + b",  # slow, in time
        "def add(a, b):\n    raise ValueError(a)",
        "import os\ndef add(a, b):\n    if a == 2:\n        os._exit(1)\n    return a + b",  # crashes mid-way
        "import sys\nsys.exit(3)",
        "def add(a, b) return a + b",
        "x = bytearray(10**9)\ndef add(a, b):\n    return a + b",
        "def add(a, b):\n    while True:\n        pass",
        "def add(a, b):\n    return object()",  # not data
        "def sub(a, b):\n    return a - b",  # no add
    ]
    got = {}
    for mode in (True, False):
        v = _verifier(mode)
        assert (v.zygotes is not None) == mode
        got[mode] = [(x.reward, x.failure) for x in v.verify(programs, [ADD] * len(programs))]
        v.close()
    assert got[True] == got[False]
    assert got[True][:4] == [
        (1.0, None),
        (0.25, "tests_failed"),
        (0.75, "tests_failed"),
        (0.25, "tests_failed"),
    ]


def test_a_dead_fork_server_is_replaced_and_the_next_program_scores():
    v = _verifier(True)
    try:
        assert v.rewards([RIGHT + "  # 1"], [ADD]) == [1.0]
        for zygote in v.zygotes.pair(63):  # start()'s slot, and every single-program call's
            assert zygote.started is not None
            zygote.started.proc.kill()
            zygote.started.proc.wait()
        assert v.rewards([RIGHT + "  # 2"], [ADD]) == [1.0]
        assert v.zygotes.starts() == 4
    finally:
        v.close()


def _zygote_of(pid: int) -> int:
    """The fork server under a bubblewrap process (bwrap, its PID namespace's init, the zygote)."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if Path(f"/proc/{child}/comm").read_text().startswith("python"):
            return int(child)
        found = _zygote_of(int(child))
        if found:
            return found
    return 0


def test_a_silent_fork_server_is_replaced_and_its_program_run_again(monkeypatch):
    monkeypatch.setattr(zygote_module, "CLEANUP_TIMEOUT_S", 1.0)
    v = _verifier(True)
    try:
        assert v.rewards([RIGHT + "  # 1"], [ADD]) == [1.0]
        serve, _ = v.zygotes.pair(63)
        pid = _zygote_of(serve.started.proc.pid)
        assert pid > 1
        os.kill(pid, signal.SIGSTOP)
        assert v.rewards([RIGHT + "  # 2"], [ADD]) == [1.0]  # run again in fresh sandboxes
        assert v.stats()["fork_server_failures"] == 1 and v.zygotes.starts() == 3
    finally:
        v.close()


def test_a_fork_server_failing_twice_costs_its_program_a_crash_not_cached(monkeypatch):
    v = _verifier(True)
    try:
        monkeypatch.setattr(zygote_module.Zygote, "done", lambda self: self.kill() or False)
        verdict = v.verify([RIGHT + "  # 3"], [ADD])[0]
        assert verdict.reward == 0.0 and verdict.failure == CRASH, verdict
        assert v.stats()["fork_server_failures"] == 2 and v.stats()["cache_entries"] == 0  # not cached
        monkeypatch.undo()
        assert v.rewards([RIGHT + "  # 3"], [ADD]) == [1.0]
    finally:
        v.close()


def test_the_mode_is_off_without_root_or_bubblewrap(monkeypatch):
    assert CodeVerifier(isolation="none").zygotes is None
    assert CodeVerifier(fork_server=False).zygotes is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert CodeVerifier().zygotes is None
    assert RewardConfig(kind="code", code={"fork_server": False}).code.fork_server is False


@pytest.mark.parametrize("fork_server", [True, False])
def test_stdin_stdout_tests_run_as_before(fork_server):
    v = _verifier(fork_server)
    problem = Problem("sq", "x", extra={"tests": [{"input": "3\n", "output": "9\n"}]})
    assert v.rewards(["print(int(input()) ** 2)", "print(3)"], [problem] * 2) == [1.0, 0.0]
    v.close()
