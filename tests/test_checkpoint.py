"""Verified checkpoints, fallback on damage, the run lock, and logs cut back on resume.

Fast tier: the storage functions on small folders, and the trainer in-process on the tiny models.
The subprocess kill -9 / damage matrix is in test_faults.py (``pytest -m faults``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import (
    CROSSED,
    SRC,
    ScriptedRewards,
    comparable_metrics,
    flip_byte,
    make_config,
    step_rows,
    truncate,
    weights_of,
)

from graftrl.config import ConfigError, config_from_dict
from graftrl.errors import CheckpointError, RunLockError
from graftrl.storage.checkpoint import (
    MANIFEST,
    hold_run_lock,
    identity_changes,
    list_checkpoints,
    rotate,
    verify_checkpoint,
    write_manifest,
)
from graftrl.storage.rundir import read_metrics, truncate_jsonl
from graftrl.storage.store import StoreError, TrajectoryStore, TrajectoryWriter
from graftrl.training.trainer import Trainer


def sha256_tree(root: Path, skip: tuple[str, ...] = ("run.lock",)) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in skip
    }


# ----- manifest and verification ------------------------------------------------------------


@pytest.fixture
def sealed(tmp_path) -> Path:
    folder = tmp_path / "step_000002"
    (folder / "llama" / "shards").mkdir(parents=True)
    (folder / "llama" / "model.safetensors").write_bytes(os.urandom(4096))
    (folder / "llama" / "shards" / "0.distcp").write_bytes(os.urandom(1000))
    (folder / "llama" / "optimizer.pt").write_bytes(os.urandom(2048))
    (folder / "trainer_state.json").write_text(json.dumps({"completed_steps": 2, "checkpoint_format": 1}))
    (folder / "method_state.json").write_text("{}")
    write_manifest(folder, 2)
    return folder


def test_manifest_covers_every_file_recursively(sealed):
    manifest = json.loads((sealed / MANIFEST).read_text())
    assert set(manifest["files"]) == {
        "llama/model.safetensors",
        "llama/shards/0.distcp",
        "llama/optimizer.pt",
        "trainer_state.json",
        "method_state.json",
    }
    entry = manifest["files"]["llama/shards/0.distcp"]
    data = (sealed / "llama/shards/0.distcp").read_bytes()
    assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    check = verify_checkpoint(sealed, ["trainer_state.json", "llama/"])
    assert check.status == "intact" and check.usable and check.problem == ""


@pytest.mark.parametrize(
    ("target", "damage", "expected"),
    [
        ("llama/model.safetensors", flip_byte, "llama/model.safetensors: sha256 mismatch"),
        ("llama/model.safetensors", truncate, "llama/model.safetensors: 2048 bytes, the manifest says 4096"),
        ("llama/model.safetensors", Path.unlink, "llama/model.safetensors: missing"),
        ("llama/shards/0.distcp", flip_byte, "llama/shards/0.distcp: sha256 mismatch"),
        ("llama/optimizer.pt", truncate, "llama/optimizer.pt: 1024 bytes"),
        ("trainer_state.json", flip_byte, "trainer_state.json: sha256 mismatch"),
        ("method_state.json", Path.unlink, "method_state.json: missing"),
        ("manifest.json", flip_byte, "manifest.json: unreadable"),
        ("manifest.json", truncate, "manifest.json: unreadable"),
        ("manifest.json", Path.unlink, "manifest.json: missing"),
        ("llama", shutil.rmtree, "llama/: folder missing"),
    ],
)
def test_every_damage_is_named(sealed, target, damage, expected):
    damage(sealed / target)
    check = verify_checkpoint(sealed, ["trainer_state.json", "llama/"])
    assert check.status == "damaged" and not check.usable
    assert check.problem.startswith(expected), check.problem


def test_unlisted_file_and_missing_required_entry_are_damage(sealed):
    assert "gpt2/: not in this checkpoint" in verify_checkpoint(sealed, ["gpt2/"]).problem
    (sealed / "llama" / "extra.safetensors").write_bytes(b"x")
    assert verify_checkpoint(sealed).problem.startswith("llama/extra.safetensors: not listed")


def test_a_checkpoint_from_before_manifests_is_legacy(tmp_path):
    folder = tmp_path / "step_000001"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"completed_steps": 1, "method": "graft"}))
    assert verify_checkpoint(folder).status == "legacy"
    # The same folder written by this version (format marker present) without manifest is damaged.
    (folder / "trainer_state.json").write_text(json.dumps({"completed_steps": 1, "checkpoint_format": 1}))
    assert verify_checkpoint(folder).status == "damaged"


def test_rotation_never_deletes_the_newest_or_anything_after_it(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        (root / f"step_{step:06d}").mkdir(parents=True)
    (root / "step_000006.tmp").mkdir()  # a killed write
    (root / "damaged" / "step_000009").mkdir(parents=True)
    deleted = rotate(root, keep_last=2, newest=root / "step_000003")
    assert [p.name for p in deleted] == ["step_000001"]
    assert [p.name for p in list_checkpoints(root)] == [
        "step_000002",
        "step_000003",
        "step_000004",
        "step_000005",
    ]
    assert not (root / "step_000006.tmp").exists() and (root / "damaged" / "step_000009").exists()
    rotate(root, keep_last=1, newest=root / "step_000005")
    assert [p.name for p in list_checkpoints(root)] == ["step_000005"]


# ----- the run lock ---------------------------------------------------------------------------


def _locker(run: Path, then: str) -> subprocess.Popen:
    code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from graftrl.storage.checkpoint import hold_run_lock
        from graftrl.errors import RunLockError
        try:
            with hold_run_lock(Path({str(run)!r})):
                print("held", flush=True)
                {then}
        except RunLockError as error:
            print(error, flush=True)
            sys.exit(2)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


def test_a_second_process_is_refused_and_a_dead_holders_lock_is_free(tmp_path):
    run = tmp_path / "run"
    holder = _locker(run, "time.sleep(60)")
    assert holder.stdout.readline().strip() == "held"
    with (
        pytest.raises(RunLockError, match=rf"in use by another graftrl process \(pid {holder.pid} "),
        hold_run_lock(run),
    ):
        pass
    other = _locker(run, "pass")
    out, _ = other.communicate(timeout=30)
    assert other.returncode == 2 and f"pid {holder.pid}" in out and len(out.strip().splitlines()) == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (run / "run.lock").exists()  # the stale file stays; the kernel dropped the lock
    with hold_run_lock(run), hold_run_lock(run):  # free again, and re-entrant in one process
        follower = _locker(run, "pass")
        assert follower.communicate(timeout=30)[1] is None and follower.returncode == 2
    follower = _locker(run, "pass")
    assert follower.communicate(timeout=30)[0].strip() == "held" and follower.returncode == 0


# ----- logs and store cut back on resume --------------------------------------------------------


def test_truncate_jsonl_moves_later_rows_and_a_torn_line_aside(tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [{"step": s, "x": s} for s in (0, 0, 1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "x": ')  # torn last line
    assert truncate_jsonl(path, 1) == (1, 1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    discarded = (tmp_path / "samples.discarded.jsonl").read_text().splitlines()
    assert discarded == [json.dumps(rows[3]), '{"step": 3, "x": ']
    assert truncate_jsonl(tmp_path / "absent.jsonl", 0) == (0, 0)


def test_read_metrics_skips_only_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert read_metrics(tmp_path) == [{"step": 0}, {"step": 1}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"st\n{"step": 1}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(tmp_path)


def test_a_deleted_store_manifest_is_rebuilt_from_the_step_files(tmp_path):
    root = tmp_path / "store"
    writer = TrajectoryWriter(root)
    for step in (0, 1, 2):
        writer.write_step(step, step_rows(step))
    before = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").unlink()
    with pytest.raises(StoreError, match="missing, but the folder holds 3 step files"):
        TrajectoryStore(root)
    rebuilt = TrajectoryWriter(root)
    assert rebuilt.rebuilt == [0, 1, 2]
    assert json.loads((root / "manifest.json").read_text()) == before
    assert TrajectoryStore(root).verify().ok


def test_a_foreign_file_refuses_the_rebuild_naming_it(tmp_path):
    root = tmp_path / "store"
    TrajectoryWriter(root).write_step(0, step_rows(0))
    (root / "manifest.json").unlink()
    (root / "step_000001.parquet").write_bytes(b"not parquet")
    with pytest.raises(StoreError, match=r"step_000001\.parquet \(rebuilding the missing manifest\.json\)"):
        TrajectoryWriter(root)
    assert not (root / "manifest.json").exists()


def test_identity_changes_name_the_keys():
    base = make_config({"llama": Path("/m/llama"), "gpt2": Path("/m/gpt2")})
    assert identity_changes(base, base) == []
    changed = json.loads(json.dumps(base))
    changed["seed"] = 4
    changed["rollout"]["n"] = 8
    changed["policies"][1]["path"] = "/m/other"
    changed["train"]["steps"] = 50  # not identity: extending a run is a resume
    assert identity_changes(base, changed) == [
        "seed: 3 -> 4",
        "rollout.n: 4 -> 8",
        "policies[1].path (gpt2): '/m/gpt2' -> '/m/other'",
    ]
    renamed = json.loads(json.dumps(base))
    renamed["policies"][0]["name"] = "llama2"
    assert identity_changes(base, renamed) == ["policies (names): ['llama', 'gpt2'] -> ['llama2', 'gpt2']"]


# ----- the trainer, in-process --------------------------------------------------------------------


def run_config(paths, steps: int = 3, **extra) -> dict:
    config = make_config(paths, steps=steps)
    config["checkpoint"] = {"every": 1, "keep_last": 3}
    config["store"] = {"record": True}
    config["logging"]["log_samples"] = 1
    return {**config, **extra}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """An uninterrupted 3-step run with checkpoints after every step."""
    run = tmp_path_factory.mktemp("reference") / "run"
    trainer = Trainer(config_from_dict(run_config(tiny_checkpoints)), run, verifier=ScriptedRewards(CROSSED))
    trainer.train()
    return run, weights_of(trainer)


def resume(paths, run: Path, **extra) -> Trainer:
    trainer = Trainer(config_from_dict(run_config(paths, **extra)), run, verifier=ScriptedRewards(CROSSED))
    trainer.train(resume=True)
    return trainer


def derived_logs(run: Path) -> dict[str, list[dict]]:
    out = {"metrics": comparable_metrics(run)}
    for name in ("samples", "compatibility"):
        out[name] = [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]
    store = TrajectoryStore(run / "store")
    out["store"] = [[r.to_dict() for r in store.read_step(s)] for s in store.steps()]
    return out


@pytest.mark.parametrize(
    ("target", "damage"),
    [("llama/model.safetensors", flip_byte), ("gpt2/optimizer.pt", truncate), ("manifest.json", Path.unlink)],
)
def test_damage_falls_back_to_the_newest_intact_checkpoint(
    tiny_checkpoints, reference, tmp_path, capsys, target, damage
):
    ref_run, ref_weights = reference
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    damage(run / "checkpoints" / "step_000003" / target)
    damaged_files = sha256_tree(run / "checkpoints" / "step_000003")
    trainer = resume(tiny_checkpoints, run)
    assert trainer.start_step == 2
    err = capsys.readouterr().err
    assert f"checkpoint step_000003: {target}" in err and "falling back to step_000002" in err
    # Recovery is exact: the same weights, logs and store as the uninterrupted run.
    weights = weights_of(trainer)
    assert all(torch.equal(value, weights[key]) for key, value in ref_weights.items())
    assert derived_logs(run) == derived_logs(ref_run)
    assert sha256_tree(run / "checkpoints" / "step_000003") == sha256_tree(
        ref_run / "checkpoints" / "step_000003"
    )
    # Nothing is lost: the damaged checkpoint is kept, byte for byte, under checkpoints/damaged/.
    assert sha256_tree(run / "checkpoints" / "damaged" / "step_000003") == damaged_files


def test_no_intact_checkpoint_refuses_and_changes_nothing(tiny_checkpoints, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    for step in (1, 2, 3):
        flip_byte(run / "checkpoints" / f"step_{step:06d}" / "llama" / "model.safetensors")
    before = sha256_tree(run)
    with pytest.raises(
        CheckpointError, match=r"no intact checkpoint .*step_000001: llama/model\.safetensors"
    ):
        resume(tiny_checkpoints, run)
    assert sha256_tree(run) == before


def test_resume_without_checkpoint_starts_over_after_moving_logs_aside(tiny_checkpoints, reference, tmp_path):
    ref_run, ref_weights = reference
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    shutil.rmtree(run / "checkpoints")  # a run killed before its first checkpoint
    old_metrics = (run / "metrics.jsonl").read_text()
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "mod')  # torn by the kill
    trainer = resume(tiny_checkpoints, run)
    assert trainer.start_step == 0
    assert all(torch.equal(v, weights_of(trainer)[k]) for k, v in ref_weights.items())
    assert derived_logs(run) == derived_logs(ref_run)
    assert (run / "metrics.discarded.jsonl").read_text() == old_metrics + '{"step": 3, "mod\n'
    assert (run / "store" / "discarded" / "step_000002.parquet").exists()


def test_non_finite_state_is_never_checkpointed(tiny_checkpoints, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    trainer = Trainer(config_from_dict(run_config(tiny_checkpoints)), run, verifier=ScriptedRewards(CROSSED))
    before = sha256_tree(run)
    with torch.no_grad():
        next(trainer.policies[1].model.parameters())[0, 0] = float("nan")
    with pytest.raises(
        CheckpointError, match=r"step 3: non-finite values in gpt2 \(weights .*checkpoint not written"
    ):
        trainer.checkpoints.save(3)
    assert sha256_tree(run) == before and not (run / "checkpoints" / "step_000004.tmp").exists()
    trainer.close()


def test_trainer_state_must_fit_the_folder_and_the_run(tiny_checkpoints, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    renamed = run / "checkpoints" / "step_000005"
    (run / "checkpoints" / "step_000003").rename(renamed)  # still intact: the manifest is relative
    with pytest.raises(CheckpointError, match="says 3 completed steps, but the folder is step_000005"):
        resume(tiny_checkpoints, run, train={**run_config(tiny_checkpoints)["train"], "steps": 10})
    renamed.rename(run / "checkpoints" / "step_000003")
    with pytest.raises(CheckpointError, match=r"3 completed steps, more than train\.steps=2"):
        resume(tiny_checkpoints, run, steps=2)


def test_resume_refuses_a_changed_identity_unless_forced(tiny_checkpoints, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    before = sha256_tree(run)
    with pytest.raises(ConfigError, match=r"changes the run's identity .*seed: 3 -> 4; .*--force"):
        resume(tiny_checkpoints, run, seed=4)
    assert sha256_tree(run) == before
    trainer = Trainer(
        config_from_dict(run_config(tiny_checkpoints, seed=4, steps=4)),
        run,
        verifier=ScriptedRewards(CROSSED),
    )
    trainer.train(resume=True, force=True)
    assert trainer.start_step == 3 and (run / "checkpoints" / "step_000004" / MANIFEST).exists()


def test_a_checkpoint_without_manifest_from_an_older_graftrl_loads(
    tiny_checkpoints, reference, tmp_path, capsys
):
    ref_run, ref_weights = reference
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    for folder in list_checkpoints(run / "checkpoints"):  # as graftrl wrote them before manifests
        (folder / MANIFEST).unlink()
        state = json.loads((folder / "trainer_state.json").read_text())
        del state["checkpoint_format"]
        (folder / "trainer_state.json").write_text(json.dumps(state))
    shutil.rmtree(run / "checkpoints" / "step_000003")
    truncate(run / "checkpoints" / "step_000002" / "gpt2" / "optimizer.pt")  # unverifiable, fails to load
    trainer = resume(tiny_checkpoints, run)
    err = capsys.readouterr().err
    assert "checkpoint step_000002: does not load" in err and "loaded unverified" in err
    assert trainer.start_step == 1
    assert all(torch.equal(v, weights_of(trainer)[k]) for k, v in ref_weights.items())
    assert verify_checkpoint(run / "checkpoints" / "step_000003").status == "intact"
