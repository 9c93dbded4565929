"""Fault injection for issue 40 (``pytest -m faults``): a real ``kill -9`` in the middle of an
import, and a Ray actor whose process is killed mid-run. An interrupted import leaves a store every
reader refuses, and rerunning the same command ends in the store an uninterrupted import writes,
byte for byte; a dead actor is one paragraph naming the policy and the cause, its report in the
run's error log, and the resume it names continues the run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, SRC

from graftrl.storage.store import StoreError, TrajectoryStore, TrajectoryWriter
from graftrl.storage.store_manifest import PENDING

pytestmark = pytest.mark.faults


def env() -> dict[str, str]:
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GRAFTRL_THREADS")}
    return {
        **os.environ,
        **threads,
        "PYTHONPATH": str(SRC),
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
    }


def graftrl(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "graftrl.cli", *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ----- kill -9 in the middle of an import -----------------------------------------------------------

STEPS = 100


@pytest.fixture(scope="module")
def import_setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(trajectories file, the store before the import, the store after an uninterrupted import)."""
    root = tmp_path_factory.mktemp("import")
    rows = [
        {
            "prompt_id": f"p{p}",
            "response": f"{step} {p} {i} " + "x" * 40,
            "reward": i % 2,
            "step": step,
            "token_logprobs": [-0.5, -0.25],
        }
        for step in range(STEPS)
        for p in range(2)
        for i in range(2)
    ]
    file = root / "peer.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = root / "before"
    other = [{**row, "source": "other"} for row in rows if row["step"] < 3]
    (root / "other.jsonl").write_text("".join(json.dumps(row) + "\n" for row in other))
    proc = graftrl("import-trajectories", str(root / "other.jsonl"), "--store", str(before))
    assert proc.wait(timeout=300) == 0, proc.stdout.read() if proc.stdout else ""
    reference = root / "reference"
    shutil.copytree(before, reference)
    proc = graftrl("import-trajectories", str(file), "--store", str(reference), "--source", "peer")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return file, before, reference


@pytest.mark.parametrize("seed", range(3))
def test_kill_9_mid_import_then_the_same_command_finishes_it_identically(import_setup, tmp_path, seed):
    file, before, reference = import_setup
    store = tmp_path / "store"
    shutil.copytree(before, store)
    held = len(list(store.glob("step_*.parquet")))
    target = held + random.Random(seed).randint(1, STEPS - 5)
    proc = graftrl("import-trajectories", str(file), "--store", str(store), "--source", "peer")
    deadline = time.monotonic() + 300
    while len(list(store.glob("step_*.parquet"))) < target and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = json.loads((store / "manifest.json").read_text())
    assert PENDING in manifest, f"the kill came after the import finished (seed {seed})"
    print(f"seed {seed}: killed with {len(manifest['files'])} of {STEPS} steps listed")
    # Every reader refuses the partial store, in one line naming the command that finishes it.
    with pytest.raises(StoreError, match=r"did not finish \(graftrl import-trajectories .*peer\.jsonl"):
        TrajectoryStore(store)
    with pytest.raises(StoreError, match="did not finish"):
        TrajectoryWriter(store)  # a run recording into it too
    proc = graftrl("import-trajectories", str(file), "--store", str(store), "--source", "peer")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert digest(store) == digest(reference)
    assert TrajectoryStore(store).verify().ok


# ----- a Ray actor killed mid-run ------------------------------------------------------------------

KILL_AN_ACTOR = """
import os, signal, sys
from graftrl.training.trainer import Trainer

original = Trainer.step


def step(self, step):
    metrics = original(self, step)
    if step == 0:  # after the first step: the actor of the second policy dies
        actor = self.backend.actors[1]
        pid = self.backend.ray.get(actor.__ray_call__.remote(lambda worker: os.getpid()))
        os.kill(pid, signal.SIGKILL)
    return metrics


Trainer.step = step
from graftrl.cli import app

if __name__ == "__main__":
    app(sys.argv[1:])
"""


def test_a_killed_ray_actor_is_one_paragraph_and_the_named_resume_continues(tiny_checkpoints, tmp_path):
    config = {
        "method": "graft",
        "seed": 3,
        "backend": "ray",
        "ray": {"num_cpus": 2},
        "policies": [
            {"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(tiny_checkpoints["gpt2"])},
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "train": {"steps": 2, "batch_prompts": 2, "minibatch_prompts": 2},
        "checkpoint": {"every": 1},
        "logging": {"progress": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "kill_an_actor.py").write_text(KILL_AN_ACTOR)
    run = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "kill_an_actor.py"),
            "train",
            str(tmp_path / "run.yaml"),
            "--out",
            str(run),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    paragraph = errors[0]
    assert paragraph.startswith("error: policy 'gpt2' (Ray actor) failed during `"), paragraph
    assert "died without an error of its own: killed by a signal" in paragraph, paragraph
    assert f"the full report is in {run / 'errors.log'}" in paragraph, paragraph
    resume = f"graftrl train {run / 'config.yaml'} --out {run} --resume"
    assert resume in paragraph, paragraph
    assert "The actor died unexpectedly" in (run / "errors.log").read_text()  # Ray's own report
    # The resume the paragraph names continues the run to its end.
    proc = graftrl("train", str(run / "config.yaml"), "--out", str(run), "--resume")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [0, 1]
