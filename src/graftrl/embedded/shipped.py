"""The default pair's warm-started weights, shipped with graftrl as a verified artifact.

The first ``graftrl demo`` would otherwise spend about 40% of its time warm-starting the two
embedded models. The default pair (``docs/demo/worked/provenance.json``) is shipped in
``shipped/<spec>-<fingerprint>/`` beside this module: the folder ``warm_start`` saved, file for
file, as warm-started on the CPU kernels named in ``manifest.json`` (``graftrl.machine.cpu_kernels``),
which also holds each file's SHA-256.

A folder is installed into the model cache only where it is exactly what a local warm-start would
write: on a machine with the same CPU kernels (other kernels give other last bits, and then other
results than a local warm-start, so there the pair is warm-started as before), and only when every
file matches its hash (a damaged or edited artifact is never trained from). Anything else (another
task, seed, mix or a quick warm-start) has another fingerprint and is warm-started as before.

An experiment can pin its own starting weights the same way (``pin_models``): the folders and a
manifest in the experiment's folder, committed with its cells. Pinned weights are used on any CPU
kernels, because they *are* the weights the experiment's cells were trained from: a machine with
other kernels then continues the experiment instead of warm-starting other last bits and
retraining every cell.
``GRAFTRL_REBUILD_EMBEDDED=1`` (or ``shipped=False``) skips the artifact: the slow test tier does
so and compares the warm-start's bytes with the documented ones.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from graftrl.errors import UserError
from graftrl.files import atomic_write, sha256_file
from graftrl.machine import cpu_kernels

__all__ = [
    "MANIFEST_NAME",
    "REBUILD_ENV",
    "REPORT_NAME",
    "SHIPPED_DIR",
    "PinnedWeightsError",
    "cache_record",
    "cached_problem",
    "install_shipped",
    "pin_models",
    "pinned_models",
    "rebuild_requested",
    "seal_cached",
    "ship",
    "shipped_kernels",
    "shipped_models",
    "verify_shipped",
]

#: Where the shipped folders and their manifest live (package data).
SHIPPED_DIR = Path(__file__).parent / "shipped"
MANIFEST_NAME = "manifest.json"
#: Name of the report file a warm-start writes next to the saved model (its provenance reads it).
REPORT_NAME = "graftrl_warmstart.json"
#: Set to 1 to warm-start locally even where a shipped pair matches the fingerprint.
REBUILD_ENV = "GRAFTRL_REBUILD_EMBEDDED"


def _manifest(root: Path) -> dict:
    manifest = root / MANIFEST_NAME
    if not manifest.is_file():
        return {"cpu_kernels": None, "models": {}}
    try:
        loaded = json.loads(manifest.read_bytes().decode("utf-8"))
        if not isinstance(loaded, dict) or not isinstance(loaded.get("models"), dict):
            raise ValueError("no 'models' mapping")
    except ValueError as error:
        raise UserError(
            f"{manifest}: unreadable ({type(error).__name__}); restore it (git checkout, or reinstall graftrl "
            "for the shipped one)"
        ) from None
    return loaded


def shipped_models(root: Path = SHIPPED_DIR) -> dict[str, dict[str, str]]:
    """The manifest's models: ``{"<spec>-<fingerprint>": {file name: sha256}}`` (empty when none)."""
    return _manifest(root)["models"]


def shipped_kernels(root: Path = SHIPPED_DIR) -> str | None:
    """The CPU kernels the shipped folders were warm-started on (``cpu_kernels()`` there)."""
    return _manifest(root)["cpu_kernels"]


def verify_shipped(folder: Path, files: Mapping[str, str]) -> list[str]:
    """The files of ``folder`` that are missing or whose SHA-256 differs from the manifest's."""
    return [
        name
        for name, digest in files.items()
        if not (folder / name).is_file() or sha256_file(folder / name)[0] != digest
    ]


def rebuild_requested() -> bool:
    return os.environ.get(REBUILD_ENV, "").strip().lower() in {"1", "true", "yes"}


def install_shipped(key: str, out_dir: Path, root: Path = SHIPPED_DIR) -> bool:
    """Copy the shipped folder ``key`` (``<spec>-<fingerprint>``) to ``out_dir`` once verified.

    Returns False, installing nothing, when no such folder is shipped, a rebuild was asked for
    (``REBUILD_ENV``), this machine's CPU kernels are not the artifact's, or a file fails its hash
    (then with a one-line warning): the caller warm-starts instead. The copy is made beside ``out_dir`` and renamed into place, so an
    interrupted install leaves no half-written model in the cache.
    """
    files = shipped_models(root).get(key)
    if files is None or rebuild_requested():
        return False
    if (shipped_on := shipped_kernels(root)) != (here := cpu_kernels()):
        print(
            f"note: graftrl ships {key} as warm-started on {shipped_on} CPU kernels; this machine's "
            f"({here}) would train other last bits, so it is warm-started here",
            file=sys.stderr,
        )
        return False
    source = root / key
    if bad := verify_shipped(source, files):
        print(
            f"warning: the shipped warm-start {key} fails its SHA-256 check ({', '.join(bad)}); "
            "warm-starting it here instead (reinstall graftrl to restore the artifact)",
            file=sys.stderr,
        )
        return False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out_dir.parent))
    try:
        for name in files:
            shutil.copyfile(source / name, staging / name)
        if bad := verify_shipped(staging, files):  # the copy, too, before it is used
            raise OSError(f"copy of {', '.join(bad)} differs from the shipped bytes")
        shutil.rmtree(out_dir, ignore_errors=True)  # a stale folder whose report had another fingerprint
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def ship(folders: list[Path], root: Path = SHIPPED_DIR) -> dict[str, dict[str, str]]:
    """Make ``root`` hold exactly ``folders`` (models warm-started on this machine, each named
    ``<spec>-<fingerprint>``) and a manifest of this machine's CPU kernels and their files' SHA-256;
    returns the manifest's models. The maintainers' step (``scripts/ship_warmstart.py``)."""
    models = {}
    for folder in folders:
        target = root / folder.name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target)
        models[folder.name] = {f.name: sha256_file(f)[0] for f in sorted(target.iterdir()) if f.is_file()}
    for stale in root.iterdir() if root.is_dir() else []:
        if stale.is_dir() and stale.name not in models:
            shutil.rmtree(stale)
    manifest = {"cpu_kernels": cpu_kernels(), "models": models}
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return models


def cache_record(folder: Path) -> Path:
    """Where a cached model's file digests are kept: beside its folder (``<key>.sha256.json``), so
    the folder stays exactly what ``warm_start`` saved (and what ``ship`` would copy)."""
    return folder.with_name(f"{folder.name}.sha256.json")


def seal_cached(folder: Path) -> None:
    """Record the SHA-256 of every file of a cached model, once it is complete (installed from the
    shipped artifact or warm-started here): ``cached_problem`` checks them at every later use."""
    files = {f.name: sha256_file(f)[0] for f in sorted(folder.iterdir()) if f.is_file()}
    atomic_write(
        cache_record(folder), (json.dumps({"files": files}, indent=1, sort_keys=True) + "\n").encode()
    )


def cached_problem(folder: Path, shipped_files: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with a cached model's files (None when each matches its recorded SHA-256).

    A folder cached before records existed is checked against the shipped manifest when its key is
    shipped for this machine's kernels (``shipped_files``), else adopted as it is and sealed."""
    record = cache_record(folder)
    if not record.is_file():
        if shipped_files is not None and (bad := verify_shipped(folder, shipped_files)):
            return f"{', '.join(bad)} fails its SHA-256 check against the shipped manifest"
        seal_cached(folder)
        return None
    try:
        files = json.loads(record.read_bytes().decode("utf-8"))["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"{record.name} is unreadable, so its files cannot be verified"
    if bad := verify_shipped(folder, files):
        return f"{', '.join(bad)} fails its SHA-256 check (changed or truncated since it was cached)"
    return None


class PinnedWeightsError(UserError):
    """An experiment's pinned starting weights are damaged; the message names the folder and the fix."""


def pinned_models(pin_dir: Path, keys: Mapping[str, str]) -> dict[str, Path] | None:
    """Spec name -> the pinned folder, when ``pin_dir``'s manifest holds exactly the folders ``keys``
    names (``<spec>-<fingerprint>``) and every file matches its SHA-256; None when nothing (or
    another design's weights) is pinned there. A damaged pinned file raises PinnedWeightsError:
    training from other weights would silently make the experiment's committed cells stale."""
    models = shipped_models(pin_dir)
    if set(models) != set(keys.values()):
        return None
    for key, files in models.items():
        if bad := verify_shipped(pin_dir / key, files):
            raise PinnedWeightsError(
                f"{pin_dir / key}: {', '.join(bad)} fails its SHA-256 check against {pin_dir / MANIFEST_NAME}; "
                "restore it (git checkout) or delete the folder to warm-start and pin anew"
            )
    return {name: pin_dir / key for name, key in keys.items()}


def pin_models(folders: Mapping[str, Path], pin_dir: Path) -> dict[str, Path]:
    """Copy ``folders`` (spec name -> ``<spec>-<fingerprint>`` folder) into ``pin_dir`` with their
    manifest (``ship``), staged beside it and renamed into place; spec name -> the pinned folder."""
    pin_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{pin_dir.name}-", dir=pin_dir.parent))
    try:
        ship(list(folders.values()), root=staging)
        shutil.rmtree(pin_dir, ignore_errors=True)
        staging.rename(pin_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: pin_dir / folder.name for name, folder in folders.items()}
