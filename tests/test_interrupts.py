"""Ctrl-C stops a graftrl command even when Python swallowed the KeyboardInterrupt: a SIGINT whose
handler runs inside a finalizer is printed as "Exception ignored" and the code carries on (the faults
tier once saw a run stopped with SIGINT finish with exit code 0)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

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


def test_without_install_the_check_never_fires():
    # graftrl used as a library: the process's own SIGINT handling, and no flag
    interrupts.clear()
    interrupts.raise_if_interrupted()
    assert signal.getsignal(signal.SIGINT) is not interrupts._on_sigint
