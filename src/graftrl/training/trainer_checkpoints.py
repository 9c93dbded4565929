"""The trainer's checkpoints: write one (staged, sealed by a manifest, refused when the state is
non-finite or the disk is full), check a resume's identity and inputs, and resume from the newest
intact one, cutting the derived logs and the store back to it.

``TrainerCheckpoints`` is a collaborator of :class:`graftrl.training.trainer.Trainer`
(``trainer.checkpoints``): built from what it uses (the run folder, config, backend, method, the
inputs it hashes and the recorder) and nothing else of the trainer; ``resume`` says where the run
goes on (``Resumed``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from graftrl.config import Config, ConfigError
from graftrl.console import warn as _warn
from graftrl.errors import CheckpointError
from graftrl.files import folder_bytes, is_disk_full, sha256_file
from graftrl.methods import Method
from graftrl.storage.checkpoint import (
    CheckpointCheck,
    check_trainer_state,
    identity_changes,
    input_changes,
    list_checkpoints,
    required_files,
    rotate,
    set_aside,
    trainer_state,
    verify_checkpoint,
    write_manifest,
)
from graftrl.storage.data import MathProblem
from graftrl.storage.rundir import METHOD_STATE, STAGING_SUFFIX, TRAINER_STATE, RunDir, checkpoint_step
from graftrl.storage.store import TrajectoryWriter
from graftrl.training.backends import WorkerGroup
from graftrl.training.worker_calls import CheckpointRequest

PROBLEMS_IN_CODE = "(problems passed to Trainer)"
"""The data path recorded for a run whose problems were handed over in code."""


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run goes on."""

    start_step: int
    """The first step to run (0: no checkpoint, the run starts over)."""
    changed_inputs: tuple[str, ...] = ()
    """Inputs whose content changed since the loaded checkpoint (``--force``; marked in the first
    resumed step's metrics)."""


class TrainerCheckpoints:
    """Checkpoint writing, resume checks and resume of one run (the trainer's ``checkpoints``)."""

    def __init__(
        self,
        files: RunDir,
        config: Config,
        backend: WorkerGroup,
        method: Method,
        *,
        problems: Sequence[MathProblem],
        problems_in_code: bool,
        peer_inputs: Callable[[], Mapping[str, dict[str, str]]],
        recorder: TrajectoryWriter | None,
    ) -> None:
        """``problems_in_code``: the problems were handed over in code, so the run hashes them,
        not ``data.train``; ``peer_inputs``: what the peer sources read (``peers.<name>`` -> path, sha256)."""
        self.files = files
        self.config = config
        self.backend = backend
        self.method = method
        self.names = [p.name for p in config.policies]
        self.problems = problems
        self.problems_in_code = problems_in_code
        self.peer_inputs = peer_inputs
        self.recorder = recorder
        self._inputs: dict[str, dict[str, str]] | None = None

    @property
    def root(self) -> Path:
        return self.files.checkpoints

    def inputs(self) -> dict[str, dict[str, str]]:
        """The content of what the run reads besides its models: the training data (the file, or
        the problems handed to the trainer in code) and every stored peer's store,
        name -> {"path", "sha256"} (hashed once per process)."""
        if self._inputs is None:
            if self.problems_in_code:
                listed = json.dumps([dataclasses.asdict(p) for p in self.problems], sort_keys=True)
                digest = hashlib.sha256(listed.encode()).hexdigest()
                self._inputs = {"data.train": {"path": PROBLEMS_IN_CODE, "sha256": digest}}
            else:
                data = Path(self.config.data.train)
                self._inputs = {"data.train": {"path": str(data), "sha256": sha256_file(data)[0]}}
            self._inputs.update(self.peer_inputs())
        return self._inputs

    def _required_files(self) -> list[str]:
        return required_files(self.names)

    def save(self, step: int) -> Path:
        """Weights, optimizer and method state after ``step``, sealed by a manifest (graftrl.storage.checkpoint).

        Assembled in a staging folder and renamed into place; refused (CheckpointError) when any
        policy's weights or optimizer state hold NaN or inf, so a diverged state never replaces a
        good checkpoint.
        """
        nonfinite = self.backend.nonfinite_state()
        bad = {name: found for name, found in zip(self.names, nonfinite, strict=True) if found}
        if bad:
            kept = list_checkpoints(self.root)
            raise CheckpointError(
                f"step {step}: non-finite values in "
                + "; ".join(f"{name} ({', '.join(found)})" for name, found in bad.items())
                + "; checkpoint not written"
                + (f", the last one is {kept[-1]}" if kept else "")
                + f": lower optim.lr or tighten optim.grad_clip, then {self.files.resume_remedy()}"
            )
        completed = step + 1
        final = self.files.checkpoint(completed)
        staging = final.with_name(final.name + STAGING_SUFFIX)
        shutil.rmtree(staging, ignore_errors=True)
        previous = self.latest()
        try:
            staging.mkdir(parents=True)
            self.backend.save(CheckpointRequest(tuple(str(staging / name) for name in self.names)))
            (staging / METHOD_STATE).write_text(json.dumps(self.method.state_dict()))
            (staging / TRAINER_STATE).write_text(
                json.dumps(trainer_state(completed, self.method.name, self.inputs()))
            )
            write_manifest(staging, completed)  # last: a folder with a manifest is complete
        except Exception as error:
            if not is_disk_full(error):
                raise
            self._refuse_full_disk(step, staging, previous)
        if final.exists():  # only after a fallback re-ran this step; the old one is replaced
            shutil.rmtree(final)
        staging.rename(final)
        rotate(self.root, self.config.checkpoint.keep_last, final)
        return final

    def _refuse_full_disk(self, step: int, staging: Path, previous: Path | None) -> None:
        """The disk filled while ``staging`` was written: remove it, say what a checkpoint needs."""
        written = folder_bytes(staging)
        shutil.rmtree(staging, ignore_errors=True)
        free = shutil.disk_usage(self.root).free
        # The last checkpoint's size is what the next one needs; without one, what was written so far.
        needed = (
            f"about {folder_bytes(previous) / 2**20:.1f} MiB"
            if previous
            else f"over {written / 2**20:.1f} MiB"
        )
        raise CheckpointError(
            f"step {step}: no space left on the device of {self.root} while writing checkpoint "
            f"{staging.name.removesuffix(STAGING_SUFFIX)}: a checkpoint needs {needed}, "
            f"{free / 2**20:.1f} MiB are free; the partial folder was removed"
            + (f" and {previous.name} is intact" if previous else "")
            + f": free space (or lower checkpoint.keep_last), then {self.files.resume_remedy()}"
        ) from None

    def latest(self) -> Path | None:
        """The newest checkpoint folder by name (not verified; ``resume`` verifies)."""
        done = list_checkpoints(self.root)
        return done[-1] if done else None

    def check_identity(self) -> None:
        """Refuse (ConfigError) a resume whose config changes the run's identity vs its config.yaml."""
        saved_path = self.files.config
        if not list_checkpoints(self.root):
            return  # nothing to resume: the run starts over from step 0 anyway
        try:
            saved = yaml.safe_load(saved_path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
            raise ConfigError(
                f"--resume: cannot read {saved_path} ({error.__class__.__name__}) to check that the config "
                "still describes this run; restore it, or pass --force to resume under the new config"
            ) from None
        changes = identity_changes(
            saved if isinstance(saved, dict) else {}, self.config.model_dump(mode="json")
        )
        if changes:
            raise ConfigError(
                f"--resume: the config changes the run's identity vs {saved_path}: {'; '.join(changes)}; "
                "undo the change, train into another --out, or pass --force to resume anyway"
            )

    def resume(self, force: bool = False) -> Resumed:
        """Load the newest intact checkpoint (verified against its manifest): where the run goes on.

        Damaged newer checkpoints are named, set aside under ``checkpoints/damaged/`` and skipped;
        with none intact the resume is refused (CheckpointError). With no checkpoint at all the run
        starts from step 0. Derived logs and the store are cut back to the resumed step. ``force``:
        even when the inputs or the method changed since the checkpoint.
        """
        skipped: list[str] = []
        chosen = None
        resumed = Resumed(0)
        for folder in reversed(list_checkpoints(self.root)):
            check = verify_checkpoint(folder, self._required_files())
            if check.status == "legacy":
                problem, loaded = self._load_legacy(folder)
                if loaded is not None:
                    _warn(f"{folder}: written before checkpoint manifests; loaded unverified")
                    chosen, resumed = folder, loaded
                    break
                check = CheckpointCheck(folder, "damaged", problem)
            if check.status == "damaged":
                skipped.append(f"{folder.name}: {check.problem}")
                continue
            chosen, resumed = folder, self._load(folder, force)
            break
        if chosen is None and skipped:
            what, start_over = (
                (
                    "continuing the compare cell",
                    f"delete {self.files.root} and rerun the same `graftrl compare`",
                )
                if self.files.is_compare_cell()
                else ("--resume", "start over in another --out")
            )
            raise CheckpointError(
                f"{what}: no intact checkpoint under {self.root} ({'; '.join(skipped)}); "
                f"restore one from a backup, or {start_over}"
            )
        for line in skipped:
            _warn(f"checkpoint {line}; falling back to {chosen.name if chosen else '-'}")
        for damaged in list_checkpoints(self.root):
            if chosen is not None and (checkpoint_step(damaged) or 0) > resumed.start_step:
                _warn(f"{damaged.name} set aside as {set_aside(damaged)}")
        if chosen is not None:  # finish a rotation a kill interrupted, so the folder looks uninterrupted
            rotate(self.root, self.config.checkpoint.keep_last, chosen)
        else:
            _warn(
                f"--resume: no checkpoint in {self.root} yet; starting from step 0 "
                "(earlier log lines move to *.discarded.jsonl)"
            )
        self._truncate_derived(resumed.start_step - 1)
        return resumed

    def _load(self, folder: Path, force: bool) -> Resumed:
        state = json.loads((folder / TRAINER_STATE).read_text())
        start_step = check_trainer_state(folder, state, self.config.train.steps)
        changed = input_changes(state.get("inputs"), self.inputs())
        if changed and not force:
            raise ConfigError(
                f"--resume: {changed[0]}{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} "
                f"changed since {folder.name} was written; restore it, train into another --out, or pass "
                "--force to resume on the new content (the metrics then mark the resumed step)"
            )
        for change in changed:
            _warn(f"--force: {change} changed since {folder.name}; resuming on the new content")
        self.backend.load(CheckpointRequest(tuple(str(folder / name) for name in self.names)))
        method_state = json.loads((folder / METHOD_STATE).read_text())
        if state.get("method") == self.method.name:
            self.method.load_state_dict(method_state)
        elif force:
            _warn(
                f"{folder}: method {state.get('method')!r} -> {self.method.name!r}: method state starts fresh"
            )
        else:
            raise CheckpointError(
                f"{folder / TRAINER_STATE}: written by method {state.get('method')!r}, the config says "
                f"{self.method.name!r}; set method: {state.get('method')} or pass --force"
            )
        return Resumed(start_step, tuple(change.split(" ", 1)[0] for change in changed))

    def _load_legacy(self, folder: Path) -> tuple[str, Resumed | None]:
        """Load a checkpoint without a manifest: (the problem found, None) or ("", where the run
        goes on) when it loaded and is finite."""
        missing = [name for name in self._required_files() if not (folder / name.rstrip("/")).exists()]
        if missing:
            return f"{missing[0]}: missing", None
        try:
            resumed = self._load(folder, force=True)
        except CheckpointError:
            raise
        except Exception as error:  # an unverifiable folder: any load failure means "damaged"
            first_line = (str(error).splitlines() or [""])[0][:200]
            return f"does not load ({error.__class__.__name__}: {first_line})", None
        for name, found in zip(self.names, self.backend.nonfinite_state(), strict=True):
            if found:
                return f"{name}: non-finite values ({', '.join(found)})", None
        return "", resumed

    def _truncate_derived(self, step: int) -> None:
        """Cut metrics, samples, compatibility and validation logs and the store back to ``step``."""
        for path, torn in self.files.truncate_logs(step).items():
            _warn(f"{path}: {torn} unreadable line(s) (a torn write) moved aside")
        if self.recorder is not None:
            if self.recorder.rebuilt:
                _warn(f"{self.recorder.root}/manifest.json was missing; rebuilt from its step files")
            self.recorder.truncate_after(step)
