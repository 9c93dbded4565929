"""compare's cells under faults and on a Ray cluster (``pytest -m faults``, ``pytest -m slow``).

Every matrix is `graftrl compare --base` in a subprocess on the real Qwen2 / Llama pair
(``conftest.build_qwen2_llama_pair``), 2 variants x 2 seeds with a checkpoint after every step:

- kill -9 of the whole command mid-matrix, then a rerun: the finished cells are reused, the
  interrupted one continues from its last checkpoint, and every result, log and report number
  equals an uninterrupted control's;
- ``--launcher ray`` on a local Ray (1 CPU per cell on 2 cores), one cell's process killed -9
  mid-training: Ray retries it from its checkpoint, and the report equals the local launcher's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import SRC, comparable_metrics, write_sums
from test_compare_base import base_config, matrix_file

from graftrl.experiments.cells import CLOCK, MEASURED_FIELDS
from graftrl.storage.checkpoint import list_checkpoints
from graftrl.storage.rundir import checkpoint_step

MEASURED = MEASURED_FIELDS


def graftrl(*args: str) -> subprocess.Popen:
    """The CLI in its own process group (a kill -9 takes its workers too), one torch thread."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GRAFTRL_THREADS")})
    return subprocess.Popen(
        [sys.executable, "-m", "graftrl.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the matrix ended before the kill:\n{proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the kill point"
        time.sleep(0.05)


def mid_training(run: Path) -> bool:
    """A checkpoint of the cell is on disk and it is not its last (4 steps)."""
    steps = [checkpoint_step(folder) for folder in list_checkpoints(run / "checkpoints")]
    return bool(steps) and max(steps) < 4


def outcome(out: Path) -> dict:
    """Everything a matrix leaves that must not depend on interruptions or launchers: each cell's
    marker (measurements aside), metrics (timings aside), samples and compatibility logs."""
    cells = {}
    for run in sorted((out / "runs").iterdir()):
        done = json.loads((run / "done.json").read_text())
        rows = [{k: v for k, v in row.items() if k not in MEASURED} for row in done.pop("rows")]
        logs = {
            name: (run / name).read_text()
            for name in ("samples.jsonl", "compatibility.jsonl")
            if (run / name).exists()
        }
        cells[run.name] = {
            "done": {k: v for k, v in done.items() if k not in MEASURED},
            "rows": rows,
            "metrics": comparable_metrics(run) if (run / "metrics.jsonl").exists() else [],
            "logs": logs,
        }
    return cells


@pytest.fixture(scope="module")
def matrix(qwen2_llama_pair, tmp_path_factory) -> tuple[Path, list[str]]:
    """(root, the compare arguments but --out): 4 steps per cell, 1 CPU per cell under Ray."""
    root = tmp_path_factory.mktemp("matrix")
    resources = {"num_cpus": 0.5}
    base = base_config(qwen2_llama_pair, root, steps=4)
    config = yaml.safe_load(base.read_text())
    for policy in config["policies"]:
        policy["resources"] = resources
    base.write_text(yaml.safe_dump(config))
    bench = write_sums(root / "bench.jsonl", 6, 1, "b")
    args = ["compare", "--base", str(base), "--matrix", str(matrix_file(root)), "--seeds", "2"]
    return root, [*args, "--bench", f"sums={bench}", "--eval-samples", "4"]


@pytest.fixture(scope="module")
def control(matrix) -> Path:
    """The uninterrupted matrix, one cell after the other here."""
    root, args = matrix
    finish(graftrl(*args, "--out", str(root / "control")))
    return root / "control"


@pytest.mark.faults
def test_a_kill_9_mid_matrix_then_a_rerun_equals_the_uninterrupted_control(matrix, control):
    root, args = matrix
    out = root / "killed"
    proc = graftrl(*args, "--out", str(out))
    first, second = out / "runs" / "grpo-seed0", out / "runs" / "graft-seed0"
    # the kill lands in the second cell, after a checkpoint, with the first cell finished
    wait_for(lambda: (first / "done.json").exists() and mid_training(second), proc)
    kill_group(proc)
    assert not (second / "done.json").exists() and not (out / "runs" / "grpo-seed1").exists()
    rerun = finish(graftrl(*args, "--out", str(out)))
    assert "grpo seed 0: finished earlier, skipped" in rerun
    assert "graft seed 0: continuing from its last checkpoint" in rerun
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["ran"]) == ["graft-seed0", "graft-seed1", "grpo-seed1"]
    assert outcome(out) == outcome(control)
    # the resumed cell's compute is one run's: its clock continues from its checkpoint's step
    clock = [json.loads(line) for line in (second / CLOCK).read_text().splitlines()]
    assert sorted({row["step"] for row in clock}) == [0, 1, 2, 3] and clock[-1]["step"] == 3


def without_measurements(out: Path) -> None:
    """Zero each cell's wall-clock, CPU and step seconds (measurements of the launcher's machine)."""
    for marker in (out / "runs").glob("*/done.json"):
        done = json.loads(marker.read_text())
        done["rows"] = [{**row, "wall_s": 0.0} for row in done["rows"]]
        done.update({k: 0.0 for k in MEASURED_FIELDS if k in done})
        marker.write_text(json.dumps(done, indent=2))


@pytest.mark.slow
def test_the_ray_launcher_retries_a_killed_cell_and_gives_the_local_launchers_report(
    matrix, control, tmp_path
):
    import shutil

    root, args = matrix
    out = root / "ray"
    proc = graftrl(*args, "--out", str(out), "--launcher", "ray", "--tries", "2")
    victim = out / "runs" / "graft-seed1"
    wait_for(lambda: mid_training(victim), proc)
    holder = (victim / "run.lock").read_text().split()[1]  # "pid <pid> on <host>, since ..."
    os.kill(int(holder), signal.SIGKILL)  # the cell's Ray worker, mid-training
    assert not (victim / "done.json").exists()
    log = finish(proc)  # no cell failed: it would end with exit code 2
    assert "5 cells on Ray" in log  # and the warm-start evaluation
    assert "graft seed 1: continuing from its last checkpoint" in log  # the retry, in a new worker
    assert outcome(out) == outcome(control)

    # the same cells make the same report, whichever launcher ran them
    reports = {}
    for name, folder in (("local", control), ("ray", out)):
        copy = tmp_path / name
        shutil.copytree(folder, copy)
        without_measurements(copy)
        finish(graftrl(*args, "--out", str(tmp_path / "report"), "--report-only", "--reuse", str(copy)))
        report = tmp_path / "report"
        text = (report / "report.md").read_text().replace(str(copy), "COPY")
        reports[name] = {
            "report.md": [line for line in text.splitlines() if not line.startswith("Total wall-clock")],
            **{f: (report / f).read_bytes() for f in ("results.csv", "pass_at_1.png", "training_curves.png")},
        }
        shutil.rmtree(report)
    assert reports["ray"] == reports["local"]
