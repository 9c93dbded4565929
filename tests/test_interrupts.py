"""Ctrl-C stops a graftrl command even when Python swallowed the KeyboardInterrupt: a SIGINT whose
handler runs inside a finalizer is printed as "Exception ignored" and the code carries on (the faults
tier once saw a run stopped with SIGINT finish with exit code 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import SRC

from graftrl import interrupts


class _SignalsInFinalizer:
    """Sends SIGINT to this process from ``__del__``: Python runs the handler there and swallows
    the KeyboardInterrupt it raises."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # bytecode for the handler to run on
            pass


@pytest.fixture
def graftrl_sigint():
    previous = signal.getsignal(signal.SIGINT)
    interrupts.install()
    interrupts.clear()
    yield
    signal.signal(signal.SIGINT, previous)
    interrupts.clear()


def test_a_swallowed_interrupt_is_raised_at_the_next_check(graftrl_sigint, monkeypatch):
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: swallowed.append(info.exc_type))
    _SignalsInFinalizer()  # the interrupt arrives inside __del__ ...
    assert swallowed == [KeyboardInterrupt]  # ... where Python swallows it, and the code goes on
    # the loop's next safe point stops it
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_interrupted()


def test_an_interrupt_raises_where_it_arrives(graftrl_sigint):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):
            pass
    interrupts.clear()
    interrupts.raise_if_interrupted()  # cleared: a new run in this process starts clean


def test_the_library_leaves_a_users_sigint_alone():
    """Only graftrl's commands install the handler: importing the trainer does not."""
    script = (
        "import signal, graftrl.training.trainer, graftrl.integrations.trl; "
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
