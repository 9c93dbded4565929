"""Checkpoint folders that prove themselves intact, and the lock on a run folder.

Storage layer: files and hashes only, no models. The names are graftrl.storage.rundir's. Layout of
one checkpoint::

    checkpoints/step_000003/         named by completed steps
      <policy>/...                   whatever the worker's ``save`` wrote (weights, tokenizer,
                                     optimizer.pt, or sharded files): covered whatever it is
      method_state.json
      trainer_state.json             completed_steps, method, checkpoint_format
      manifest.json                  written last: size and sha256 of every other file

A checkpoint is assembled in ``step_000003.tmp`` and renamed into place once ``manifest.json`` is
written (atomically, after every file was fsynced), so a folder with the final name is complete
or visibly damaged: ``verify_checkpoint`` re-hashes every file and names the first one that is
missing, truncated, changed, or not listed. Folders without a manifest whose trainer state
carries no ``checkpoint_format`` were written by graftrl before manifests existed ("legacy"): the
trainer loads them unverified, with a warning.

The run lock (``hold_run_lock``) is an ``flock`` on ``run.lock`` in the run folder: the kernel
drops it when the process exits, however it exits, so a lock file left by a killed process is
free again without any clean-up.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from graftrl.errors import CheckpointError, RunLockError
from graftrl.files import atomic_write, fsync_dir, sha256_file
from graftrl.storage.rundir import (
    DAMAGED,
    MANIFEST,
    METHOD_STATE,
    STAGING_SUFFIX,
    TRAINER_STATE,
    RunDir,
    checkpoint_step,
)

CHECKPOINT_FORMAT = 1
FORMAT = "graftrl.storage.checkpoint"


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first (staging folders and ``damaged/`` excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def trainer_state(
    completed_steps: int, method: str, inputs: Mapping[str, Mapping[str, str]] | None = None
) -> dict[str, Any]:
    """trainer_state.json: the steps done, the method and the content of the run's inputs
    (``inputs``: name -> {"path", "sha256"}, what ``input_changes`` compares on resume)."""
    state: dict[str, Any] = {
        "completed_steps": completed_steps,
        "method": method,
        "checkpoint_format": CHECKPOINT_FORMAT,
    }
    if inputs is not None:
        state["inputs"] = {name: dict(value) for name, value in inputs.items()}
    return state


def input_changes(saved: Any, current: Mapping[str, Mapping[str, str]]) -> list[str]:
    """'name (path): sha256 old -> new' for every input whose content differs from the checkpoint's
    record (a checkpoint written before inputs were recorded checks nothing)."""
    if not isinstance(saved, Mapping):
        return []
    changes = []
    for name, now in current.items():
        before = saved.get(name)
        old = before.get("sha256") if isinstance(before, Mapping) else None
        if old is not None and old != now["sha256"]:
            changes.append(f"{name} ({now['path']}): sha256 {old[:12]}... -> {now['sha256'][:12]}...")
    return changes


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)


def write_manifest(folder: Path, completed_steps: int) -> dict[str, Any]:
    """Hash (and fsync) every file under ``folder``, then write manifest.json atomically, last."""
    files = {}
    for path in _files_under(folder):
        digest, size = sha256_file(path, fsync=True)
        files[path.relative_to(folder).as_posix()] = {"bytes": size, "sha256": digest}
    for directory in sorted({p.parent for p in _files_under(folder)}, reverse=True):
        fsync_dir(directory)
    manifest = {
        "format": FORMAT,
        "checkpoint_format": CHECKPOINT_FORMAT,
        "completed_steps": completed_steps,
        "files": files,
    }
    atomic_write(folder / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return manifest


@dataclass(frozen=True)
class CheckpointCheck:
    """What ``verify_checkpoint`` found: ``problem`` names the first bad file ('' when usable)."""

    folder: Path
    status: Literal["intact", "legacy", "damaged"]
    problem: str = ""

    @property
    def usable(self) -> bool:
        return self.status != "damaged"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _manifest_problem(manifest: Any) -> str:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return "not a graftrl checkpoint manifest"
    if manifest.get("checkpoint_format") != CHECKPOINT_FORMAT:
        return (
            f"checkpoint format {manifest.get('checkpoint_format')!r}, this graftrl reads {CHECKPOINT_FORMAT}"
        )
    files = manifest.get("files")
    if not isinstance(manifest.get("completed_steps"), int) or not isinstance(files, dict):
        return "fields 'completed_steps' and 'files' are missing or of the wrong type"
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("sha256"), str)
            or name.startswith("/")
            or ".." in Path(name).parts
        ):
            return f"bad entry {name!r} in field 'files'"
    return ""


def verify_checkpoint(folder: Path, required: Sequence[str] = ()) -> CheckpointCheck:
    """Re-hash a checkpoint against its manifest; ``required`` names files (or ``dir/`` folders)
    it must hold. Never raises for damage: the first problem found names the file."""

    def damaged(problem: str) -> CheckpointCheck:
        return CheckpointCheck(folder, "damaged", problem)

    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        state = _read_json(folder / TRAINER_STATE)
        if isinstance(state, dict) and "completed_steps" in state and "checkpoint_format" not in state:
            return CheckpointCheck(
                folder, "legacy", f"{MANIFEST}: none (written before checkpoint manifests)"
            )
        return damaged(
            f"{MANIFEST}: missing (it is written last; the checkpoint is incomplete or was edited)"
        )
    manifest = _read_json(manifest_path)
    if manifest is None:
        return damaged(f"{MANIFEST}: unreadable (not valid JSON)")
    if problem := _manifest_problem(manifest):
        return damaged(f"{MANIFEST}: {problem}")
    files: Mapping[str, Mapping[str, Any]] = manifest["files"]
    for name in required:
        present = any(key.startswith(name) for key in files) if name.endswith("/") else name in files
        if not present:
            return damaged(
                f"{name}: not in this checkpoint (its manifest lists no such "
                f"{'folder' if name.endswith('/') else 'file'})"
            )
    # Cheap checks first (existence, size), then the hashes.
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            top = name.split("/", 1)[0]
            if "/" in name and not (folder / top).is_dir():
                return damaged(f"{top}/: folder missing")
            return damaged(f"{name}: missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            return damaged(
                f"{name}: {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
            )
    for path in _files_under(folder):
        name = path.relative_to(folder).as_posix()
        if name not in files:
            return damaged(f"{name}: not listed in {MANIFEST} (added after the checkpoint was written)")
    for name, entry in files.items():
        digest, _ = sha256_file(folder / name)
        if digest != entry["sha256"]:
            return damaged(f"{name}: sha256 mismatch (the file changed after the checkpoint was written)")
    return CheckpointCheck(folder, "intact")


def required_files(policies: Sequence[str]) -> list[str]:
    """What a run's checkpoint must list: the trainer and method states and a folder per policy."""
    return [TRAINER_STATE, METHOD_STATE, *(f"{name}/" for name in policies)]


def newest_usable(
    root: Path, required: Sequence[str] = ()
) -> tuple[CheckpointCheck | None, list[CheckpointCheck]]:
    """The newest checkpoint under ``root`` that passes ``verify_checkpoint`` (intact, or legacy:
    unverifiable), and the damaged ones newer than it, newest first, as ``--resume`` looks at them.
    For readers (``graftrl eval``, ``graftrl analyze``): nothing is moved or changed."""
    damaged = []
    for folder in reversed(list_checkpoints(root)):
        check = verify_checkpoint(folder, required)
        if check.usable:
            return check, damaged
        damaged.append(check)
    return None, damaged


def set_aside(folder: Path) -> Path:
    """Move a damaged checkpoint to ``checkpoints/damaged/`` (kept, never read again); returns where."""
    target_dir = folder.parent / DAMAGED
    target_dir.mkdir(exist_ok=True)
    target = target_dir / folder.name
    suffix = 1
    while target.exists():
        target = target_dir / f"{folder.name}.{suffix}"
        suffix += 1
    os.replace(folder, target)
    fsync_dir(folder.parent)
    return target


def rotate(root: Path, keep_last: int, newest: Path) -> list[Path]:
    """Delete checkpoints older than ``newest`` beyond the ``keep_last`` most recent; returns them.

    ``newest`` is the checkpoint just written (intact by construction) and is never deleted, nor is
    anything after it. Staging leftovers of killed writes are removed too.
    """
    newest_step = checkpoint_step(newest)
    assert newest_step is not None
    older = [p for p in list_checkpoints(root) if (checkpoint_step(p) or 0) < newest_step]
    doomed = older[: max(0, len(older) - (keep_last - 1))]
    for folder in doomed:
        # Rename first: a kill mid-delete leaves a staging-named folder, never a half checkpoint.
        trash = folder.with_name(folder.name + STAGING_SUFFIX)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for leftover in root.glob(f"step_*{STAGING_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    return doomed


def check_trainer_state(folder: Path, state: Any, total_steps: int) -> int:
    """The completed steps of a loaded trainer_state.json, refused unless they fit the folder and run."""
    step = checkpoint_step(folder)
    completed = state.get("completed_steps") if isinstance(state, dict) else None
    if not isinstance(completed, int) or completed < 0:
        raise CheckpointError(
            f"{folder / TRAINER_STATE}: field 'completed_steps' is missing or not a count; "
            f"remove {folder} to resume from an older checkpoint"
        )
    if completed != step:
        raise CheckpointError(
            f"{folder / TRAINER_STATE}: says {completed} completed steps, but the folder is {folder.name}; "
            f"restore the folder's name or remove it to resume from an older checkpoint"
        )
    if completed > total_steps:
        raise CheckpointError(
            f"{folder / TRAINER_STATE}: says {completed} completed steps, more than "
            f"train.steps={total_steps}; "
            f"set train.steps >= {completed} (--set train.steps={completed}) to continue the run"
        )
    return completed


# ----- the run's identity ------------------------------------------------------------------

IDENTITY_KEYS = ("seed", "method", "rollout.n", "data.train", "data.prompt_suffix")
"""Config fields that make a run what it is (with the policies' names and paths): resuming under
different values would silently train another experiment into the same folder."""


def _lookup(raw: Mapping[str, Any], dotted: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _same_path(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def identity_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'key: old -> new' for every identity field that differs between two config dicts."""
    changes = []
    for key in IDENTITY_KEYS:
        old, new = _lookup(saved, key), _lookup(current, key)
        if not (_same_path(old, new) if key == "data.train" else old == new):
            changes.append(f"{key}: {old!r} -> {new!r}")

    def policies(raw: Mapping[str, Any]) -> list[tuple[Any, Any]]:
        items = raw.get("policies") or []
        return [(p.get("name"), p.get("path")) if isinstance(p, Mapping) else (None, None) for p in items]

    old_policies, new_policies = policies(saved), policies(current)
    if [n for n, _ in old_policies] != [n for n, _ in new_policies]:
        changes.append(f"policies (names): {[n for n, _ in old_policies]} -> {[n for n, _ in new_policies]}")
    else:
        for index, ((name, old), (_, new)) in enumerate(zip(old_policies, new_policies, strict=True)):
            if not _same_path(old, new):
                changes.append(f"policies[{index}].path ({name}): {old!r} -> {new!r}")
    return changes


# ----- the run lock ----------------------------------------------------------------------

_held: dict[Path, list[int]] = {}
"""Run folders this process holds: resolved path -> [fd, depth] (re-entrant within a process)."""


@contextlib.contextmanager
def hold_run_lock(run_dir: Path) -> Iterator[Path]:
    """Hold ``run_dir/run.lock`` exclusively, or raise RunLockError naming the process that does.

    Re-entrant within one process (the CLI holds it around the trainer, which takes it again). The
    descriptor is not inherited by child processes (Python opens it close-on-exec; verifier workers
    are spawned), so a lingering child cannot keep a dead run locked.
    """
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    key = run_dir.resolve()
    if key in _held:
        _held[key][1] += 1
        try:
            yield RunDir(run_dir).lock
        finally:
            _held[key][1] -= 1
        return
    path = RunDir(run_dir).lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunLockError(f"{path}: cannot lock the run folder ({error.strerror})") from None
        raise RunLockError(
            f"{run_dir} is in use by another graftrl process ({holder or 'holder unknown'}); "
            "wait for it to finish or stop it, or train into another --out"
        ) from None
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
    _held[key] = [fd, 1]
    try:
        yield path
    finally:
        del _held[key]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
