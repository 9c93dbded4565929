"""Verifier accounting and lifetime (issue 12, items 4 and 6): an overall deadline per call, per-step
counts of timeouts and worker restarts in metrics.jsonl, and workers that die with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import make_config

from graftrl.config import config_from_dict
from graftrl.models.rewards import MathVerifier
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer


def test_an_overall_deadline_caps_a_flood_of_hanging_answers():
    hangs = [f"{i}+x" for i in range(6)]
    with MathVerifier(timeout_s=30.0, deadline_s=1.5, _test_faults=dict.fromkeys(hangs, "hang")) as verifier:
        verifier.start()
        start = time.monotonic()
        rewards = verifier.score([rf"\boxed{{{h}}}" for h in hangs], ["7"] * len(hangs))
        elapsed = time.monotonic() - start
        stats = verifier.stats()
        assert rewards == [0.0] * len(hangs)
        assert elapsed < 10.0  # not 6 x 30 s of per-answer timeouts
        assert stats["deadline_skips"] == len(hangs) and stats["timeouts"] == 0
        assert stats["worker_restarts"] == 1  # the busy worker was replaced
        assert stats["cache_entries"] == 0  # answers never tried are not cached as wrong
        # The pool still works after the deadline.
        assert verifier.score([r"\boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]


def test_deadline_is_a_reward_field_and_reaches_the_verifier():
    config = config_from_dict(
        {
            "policies": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
            "data": {"train": "x.jsonl"},
            "reward": {"deadline_s": 12.5, "extraction": "math_verify"},
        }
    )
    verifier = MathVerifier.from_config(config.reward)
    assert (verifier.deadline_s, verifier.extraction) == (12.5, "math_verify")
    verifier.close()


class CountingRewards:
    """Scores everything 0/1 alternately and reports one timeout and one restart per call."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, responses, answers):
        self.calls += 1
        return [float(i % 2) for i in range(len(responses))]

    def stats(self):
        return {"timeouts": self.calls, "deadline_skips": 2 * self.calls, "worker_restarts": self.calls}

    def close(self):
        pass


def test_step_metrics_count_verifier_timeouts_and_restarts(tiny_checkpoints, tmp_path):
    config = config_from_dict(make_config(tiny_checkpoints, "grpo"))
    trainer = Trainer(config, tmp_path / "run", verifier=CountingRewards())
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4  # two steps x two models
    # Each policy scores once per step: one timeout + two deadline skips, one restart per call.
    assert all(row["verifier_timeouts"] == 3 and row["verifier_restarts"] == 1 for row in rows)
    assert all(row["nonfinite_skips"] == 0 for row in rows)


PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from graftrl.models.rewards import MathVerifier

    def work(verifier):
        verifier.start()
        print(" ".join(map(str, verifier.worker_pids)), flush=True)
        # Both workers busy on an answer that never finishes (as sympy on a hostile answer): they
        # do not read their pipe, so only the parent-death signal or the watchdog can stop them.
        verifier.score([r"\\boxed{h1}", r"\\boxed{h2}"], ["1", "1"])

    def main():
        verifier = MathVerifier(workers=2, timeout_s=600, _test_faults={"h1": "hang", "h2": "hang"})
        if sys.argv[1] == "thread":  # started from another thread: only the watchdog applies
            threading.Thread(target=work, args=(verifier,), daemon=True).start()
            time.sleep(600)
        else:
            work(verifier)

    if __name__ == "__main__":
        main()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; it only waits for its (new) parent to reap it.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.faults
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_verifier_workers_die_with_a_killed_parent(tmp_path, started_from):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen(
        [sys.executable, str(script), started_from], stdout=subprocess.PIPE, text=True, env=env
    )
    pids: list[int] = []
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids), line
        time.sleep(1.0)  # the hanging answers reach the workers
        os.kill(parent.pid, signal.SIGKILL)  # no atexit, no finalizers: only the kernel and the watchdog
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), f"orphaned verifier workers {pids}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in pids:  # never leave an orphan behind, even when the test fails
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
