"""Fault injection (``pytest -m faults``): real kill -9, damaged checkpoints, concurrent runs.

Every run is ``graftrl train`` on the two tiny models with the real verifier, a checkpoint after
every step (keep_last 2) and the store recording. Each case must end in an identical recovery
(the same checkpoint files, store and logs, byte for byte, as an uninterrupted run; metrics
equal but for time/memory figures) or a one-line refusal that names the file or key and leaves
every file as it was. Kills and resumes run in subprocesses; the damage matrix calls the CLI in
this process (same code path, without a second of interpreter start-up per case).
"""

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
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, SRC, comparable_metrics, flip_byte, truncate
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.storage.checkpoint import list_checkpoints, write_manifest
from graftrl.storage.rundir import RunDir

pytestmark = pytest.mark.faults

STEPS = 4
# Measurements and bookkeeping, not results: excluded from the byte-for-byte comparison.
NOT_COMPARED = ("run.lock", "metrics.jsonl")
NOT_COMPARED_DIRS = ("checkpoints/damaged/", "store/discarded/")


def env() -> dict[str, str]:
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**os.environ, **threads, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}


def start(*args: str) -> subprocess.Popen:
    """`graftrl train ...` in its own process group (so leftovers can be cleaned up after a kill)."""
    return subprocess.Popen(
        [sys.executable, "-m", "graftrl.cli", "train", *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def sha256_tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.name not in NOT_COMPARED
        and not p.name.endswith(".discarded.jsonl")
        and not p.relative_to(root).as_posix().startswith(NOT_COMPARED_DIRS)
    }


def outcome(run: Path) -> tuple[dict[str, str], list[dict]]:
    """Everything a run leaves that must not depend on interruptions."""
    return sha256_tree(run), comparable_metrics(run)


def one_line_error(output: str) -> str:
    # `note:` lines (e.g. how a batch remainder is trained) are advice printed before the run
    # starts, not part of the refusal.
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert "Traceback" not in output
    return lines[0]


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path, float]:
    """(config file, uninterrupted run, its wall time)."""
    root = tmp_path_factory.mktemp("faults")
    config = {
        "method": "graft",
        "seed": 5,
        "policies": [
            {"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(tiny_checkpoints["gpt2"])},
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl")},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "train": {"steps": STEPS, "batch_prompts": 3, "minibatch_prompts": 2},
        "optim": {"lr": 1e-2},
        "checkpoint": {"every": 1, "keep_last": 2},
        "store": {"record": True},
        "logging": {"progress": False, "log_samples": 1},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    reference = root / "reference"
    began = time.perf_counter()
    rc, out = finish(start(str(path), "--out", str(reference)))
    assert rc == 0, out
    return path, reference, time.perf_counter() - began


def where(run: Path) -> str:
    """Where a kill landed: checkpoints and metric rows on disk."""
    rows = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
    names = [p.name for p in list_checkpoints(run / "checkpoints")]
    staging = [p.name for p in (run / "checkpoints").glob("*.tmp")] if (run / "checkpoints").exists() else []
    return f"checkpoints {names or '-'}{f' staging {staging}' if staging else ''}, {rows} metric rows"


# ----- kill -9 at random points, twice per seed ---------------------------------------------------


def metric_rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def kill_at_random_point(proc: subprocess.Popen, run: Path, rng: random.Random) -> str:
    """SIGKILL the main process at a random point: during start-up (before any checkpoint), or a
    random delay after a random metric row (mid rollout, update, checkpoint write or rotation)."""
    rows = rng.randint(-1, 2 * STEPS - 1)
    if rows < metric_rows(run):  # (a resume starts with rows on disk) kill during start-up
        rows = -1
    delay = rng.uniform(0.5, 4.0) if rows < 0 else rng.uniform(0.0, 0.6)
    deadline = time.monotonic() + 300
    while rows >= 0 and metric_rows(run) <= rows and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        rc, out = finish(proc, timeout=delay)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)  # the main process only: its verifier workers linger
        proc.wait()
        return where(run)
    assert rc == 0, out  # finished before the kill: a clean run, still compared below
    return "after the end"


@pytest.mark.parametrize("seed", range(5))
def test_kill_9_at_random_points_then_resume_is_identical(setup, tmp_path, seed):
    config, reference, _ = setup
    rng = random.Random(seed)
    run = tmp_path / "run"
    killed = [start(str(config), "--out", str(run))]
    landed = [kill_at_random_point(killed[0], run, rng)]
    killed.append(start(str(config), "--out", str(run), "--resume"))  # and kill the resume too
    landed.append(kill_at_random_point(killed[1], run, rng))
    # A stale lock and lingering children must not block the resume.
    rc, out = finish(start(str(config), "--out", str(run), "--resume"))
    for proc in killed:
        kill_group(proc)
    print(f"seed {seed}: kills landed at {landed}")
    assert rc == 0, out
    assert outcome(run) == outcome(reference)


# ----- every damage on every checkpoint file ---------------------------------------------------------

DAMAGES: dict[str, Callable[[Path], None]] = {"flip": flip_byte, "truncate": truncate, "delete": Path.unlink}


def damage_cases(reference: Path) -> list[tuple[str, str]]:
    newest = list_checkpoints(reference / "checkpoints")[-1]
    files = sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())
    cases = [
        (name, kind)
        for name in files
        for kind in DAMAGES
        if kind == "delete" or (newest / name).stat().st_size > 1
    ]
    return cases + [(folder.name + "/", "delete") for folder in sorted(newest.iterdir()) if folder.is_dir()]


def apply(folder: Path, name: str, kind: str) -> None:
    if name.endswith("/"):
        shutil.rmtree(folder / name)
    else:
        DAMAGES[kind](folder / name)


def resume_in_process(config: Path, run: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(run), "--resume", *extra])
    return result.exit_code, result.output


def test_damage_to_any_file_of_the_newest_checkpoint_falls_back_identically(setup, tmp_path):
    config, reference, _ = setup
    expected = outcome(reference)
    cases = damage_cases(reference)
    failures = []
    for name, kind in cases:
        run = tmp_path / f"{name.replace('/', '_')}-{kind}"
        shutil.copytree(reference, run)
        newest = list_checkpoints(run / "checkpoints")[-1]
        before = {
            k: v for k, v in sha256_tree(run).items() if not k.startswith(f"checkpoints/{newest.name}/")
        }
        apply(newest, name, kind)
        damaged = sha256_tree(newest)
        rc, out = resume_in_process(config, run)
        named = f"checkpoint {newest.name}: {name}" in out and "falling back to" in out
        kept = sha256_tree(run / "checkpoints" / "damaged" / newest.name) == damaged
        untouched = all(sha256_tree(run).get(k) == v for k, v in before.items())
        if not (rc == 0 and named and kept and untouched and outcome(run) == expected):
            failures.append((name, kind, rc, named, kept, untouched, out[-500:]))
        shutil.rmtree(run)
    print(
        f"damage on the newest checkpoint: {len(cases)} cases, "
        f"{len(cases) - len(failures)} identical recoveries"
    )
    assert not failures, failures


@pytest.mark.parametrize(
    "name",
    [
        "llama/model.safetensors",
        "gpt2/optimizer.pt",
        "trainer_state.json",
        "method_state.json",
        "manifest.json",
        "llama/",
    ],
)
def test_damage_to_every_checkpoint_refuses_in_one_line_and_changes_nothing(setup, tmp_path, name):
    config, reference, _ = setup
    for kind in ("delete",) if name.endswith("/") else DAMAGES:
        run = tmp_path / kind
        shutil.copytree(reference, run)
        for folder in list_checkpoints(run / "checkpoints"):
            apply(folder, name, kind)
        before = sha256_tree(run)
        rc, out = resume_in_process(config, run)
        line = one_line_error(out)
        assert rc == 2 and "no intact checkpoint" in line and name.rstrip("/") in line, (kind, out)
        assert sha256_tree(run) == before, kind


# ----- early crashes, the lock, identity and a lying trainer state ----------------------------------------


def test_a_run_killed_before_its_first_checkpoint_restarts_on_resume(setup, tmp_path):
    config, reference, _ = setup
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints")
    with (run / "samples.jsonl").open("a") as handle:
        handle.write('{"step": 9, "resp')  # torn by the kill
    before = sha256_tree(run)
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(run)])
    assert result.exit_code == 2 and "--resume" in one_line_error(result.output)
    assert sha256_tree(run) == before
    rc, out = resume_in_process(config, run)
    assert rc == 0 and "starting from step 0" in out, out
    assert outcome(run) == outcome(reference)
    assert (run / "samples.discarded.jsonl").read_text().endswith('{"step": 9, "resp\n')


def test_a_second_run_on_the_same_folder_is_refused(setup, tmp_path):
    config, reference, _ = setup
    run = tmp_path / "run"
    first = start(str(config), "--out", str(run), "--set", "train.steps=12")  # long enough to overlap
    # Until the first run holds the lock: it writes its pid into the lock file once it has it. Read,
    # not probed with flock: a probe holds the lock for a moment and can refuse the first run.
    lock = RunDir(run).lock
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if lock.exists() and f"pid {first.pid} " in lock.read_text():
            break
        time.sleep(0.05)
    second = start(str(config), "--out", str(run))
    third = start(str(config), "--out", str(run), "--resume")
    results = [finish(second), finish(third)]
    assert first.poll() is None, "the first run ended before the others tried: the check proves nothing"
    for rc, out in results:
        assert rc == 2 and f"in use by another graftrl process (pid {first.pid} " in one_line_error(out), out
    rc, out = finish(first)
    assert rc == 0, out
    rows = comparable_metrics(run)
    assert [r["step"] for r in rows] == [s for s in range(12) for _ in range(2)]  # nothing interleaved
    assert rows[: 2 * STEPS] == comparable_metrics(reference)


def test_resume_with_a_changed_identity_is_refused_unless_forced(setup, tmp_path):
    config, reference, _ = setup
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = sha256_tree(run)
    other = tmp_path / "other-model"
    shutil.copytree(Path(yaml.safe_load(config.read_text())["policies"][1]["path"]), other)
    for change, named in [
        (["--set", "seed=9"], "seed: 5 -> 9"),
        (["--set", "method=grpo"], "method: 'graft' -> 'grpo'"),
        (["--set", "rollout.n=4"], "rollout.n: 2 -> 4"),
        (["--set", f"policies.1.path={other}"], "policies[1].path (gpt2)"),
        (["--set", "policies.0.name=llama2"], "policies (names)"),
        (["--set", f"data.train={FIXTURES / 'math_small.parquet'}"], "data.train"),
    ]:
        rc, out = resume_in_process(config, run, *change)
        line = one_line_error(out)
        assert rc == 2 and named in line and "--force" in line, out
        assert sha256_tree(run) == before
    rc, out = resume_in_process(config, run, "--set", "seed=9", "--set", "train.steps=5", "--force")
    assert rc == 0, out
    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == 9
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000004", "step_000005"]


def test_a_trainer_state_claiming_more_steps_than_the_run_is_refused(setup, tmp_path):
    config, reference, _ = setup
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = list_checkpoints(run / "checkpoints")[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    (newest / "trainer_state.json").write_text(json.dumps({**state, "completed_steps": 100}))
    write_manifest(newest, 100)  # sealed again: the lie is consistent, only the step count is wrong
    newest.rename(newest.with_name("step_000100"))
    before = sha256_tree(run)
    rc, out = resume_in_process(config, run)
    assert rc == 2 and f"100 completed steps, more than train.steps={STEPS}" in one_line_error(out), out
    assert sha256_tree(run) == before


# ----- a stop after a step without a gradient (issue 26) ------------------------------------------
# Single-digit answers under math_verify's extraction: the random tiny llama is right by chance at
# step 2 only, so it has a gradient tensor from then on, and steps 3-7 have no trained row. AdamW
# still steps those zero gradients (weight decay, moments): a resume at step >= 3 must too.

ZERO_GRADIENT_STEPS = 8
STOP_AFTER = 3


@pytest.fixture(scope="module")
def zero_gradient_setup(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(config file, uninterrupted run) of the run described above."""
    root = tmp_path_factory.mktemp("zero-gradient")
    config = {
        "method": "graft",
        "seed": 5,
        "policies": [
            {"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(tiny_checkpoints["gpt2"])},
        ],
        "data": {"train": str(FIXTURES / "digits.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 4, "max_new_tokens": 6},
        "reward": {"extraction": "math_verify"},
        "train": {"steps": ZERO_GRADIENT_STEPS, "batch_prompts": 4, "minibatch_prompts": 1},
        "optim": {"lr": 1e-2},
        "checkpoint": {"every": 1, "keep_last": 2},
        "store": {"record": True},
        "logging": {"progress": False, "log_samples": 1},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    reference = root / "reference"
    rc, out = finish(start(str(path), "--out", str(reference)))
    assert rc == 0, out
    # The premise: a gradient before the stop, then steps without one (else the test proves nothing).
    llama = [row for row in comparable_metrics(reference) if row["model"] == "llama"]
    assert any(row["grad_norm"] > 0 for row in llama[:STOP_AFTER]), llama
    assert all(row["grad_norm"] == 0 for row in llama[STOP_AFTER:]), llama
    return path, reference


def stop_after_checkpoint(proc: subprocess.Popen, run: Path, step: int, how: signal.Signals) -> int:
    """Send ``how`` to the run as soon as checkpoint ``step`` is in place; its exit code."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if any(checkpoint.name == f"step_{step:06d}" for checkpoint in list_checkpoints(run / "checkpoints")):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the stop"
    os.kill(proc.pid, how)
    rc, _ = finish(proc)
    kill_group(proc)
    return rc


@pytest.mark.parametrize(
    ("how", "exit_code"),
    [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, None)],
    ids=["kill-9", "SIGTERM", "SIGINT"],
)
def test_a_stop_after_steps_without_a_gradient_resumes_identically(
    zero_gradient_setup, tmp_path, how, exit_code
):
    config, reference = zero_gradient_setup
    run = tmp_path / "run"
    rc = stop_after_checkpoint(start(str(config), "--out", str(run)), run, STOP_AFTER, how)
    assert rc != 0 and (exit_code is None or rc == exit_code), rc
    rc, out = finish(start(str(config), "--out", str(run), "--resume"))
    assert rc == 0, out
    assert outcome(run) == outcome(reference)


def test_a_finished_run_extended_with_more_steps_equals_the_longer_run(zero_gradient_setup, tmp_path):
    config, reference = zero_gradient_setup
    run = tmp_path / "run"
    rc, out = finish(start(str(config), "--out", str(run), "--set", f"train.steps={STOP_AFTER}"))
    assert rc == 0, out
    rc, out = finish(start(str(config), "--out", str(run), "--resume"))
    assert rc == 0, out
    assert outcome(run) == outcome(reference)


# ----- the disk fills up while a checkpoint is written -----------------------------------------------


@contextlib.contextmanager
def small_disk(folder: Path, mib: int):
    """A real file system of ``mib`` MiB at ``folder`` (a tmpfs: needs root, as CI runs)."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); CI runs as root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_resume_is_identical(
    zero_gradient_setup, tmp_path
):
    """A real ENOSPC: one line saying what a checkpoint needs, the partial folder removed, the last
    checkpoint intact; with space freed, --resume finishes as the uninterrupted run."""
    config, reference = zero_gradient_setup
    with small_disk(tmp_path / "disk", 64) as disk:
        run = disk / "run"
        rc, out = finish(start(str(config), "--out", str(run), "--set", "train.steps=1"))
        assert rc == 0, out
        checkpoint = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file())
        filler = disk / "filler"
        free = shutil.disk_usage(disk).free
        filler.write_bytes(b"\0" * max(0, free - checkpoint // 2))  # room for half a checkpoint
        before = sha256_tree(run / "checkpoints")
        rc, out = finish(start(str(config), "--out", str(run), "--resume", "--set", "train.steps=2"))
        line = one_line_error(out)
        assert rc == 2 and "no space left" in line and "a checkpoint needs about" in line, out
        assert "step_000001 is intact" in line, out
        assert sha256_tree(run / "checkpoints") == before  # the partial folder removed, step 1 untouched
        filler.unlink()
        rc, out = finish(start(str(config), "--out", str(run), "--resume"))
        assert rc == 0, out
        assert outcome(run) == outcome(reference)
