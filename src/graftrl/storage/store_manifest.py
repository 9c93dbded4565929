"""The trajectory store's manifest: ``manifest.json``, the one file that says which step files a
store holds (step, rows, sources, size and SHA-256 of each), and whether an import into it is
unfinished.

An import writes several steps as one unit (``graftrl.storage.store_import``): before its first
step file it records ``import_in_progress`` here (the command, and the SHA-256 each of its step
files will have), and it removes that record last. A manifest that still holds it describes a
store a kill interrupted mid-import: readers and writers refuse it in one line, and rerunning the
same import finishes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from graftrl.files import atomic_write, sha256_bytes
from graftrl.storage.store_rows import META_STEP, SCHEMA_VERSION, StoreError, validate_table

FORMAT = "graftrl.trajectory_store"
MANIFEST = "manifest.json"
PENDING = "import_in_progress"
"""Manifest field of an import that has not finished: {"key", "command", "steps": {file: sha256}}."""
STEP_FILE = re.compile(r"^step_(\d{6,})\.parquet$")


def step_file_name(step: int) -> str:
    return f"step_{step:06d}.parquet"


def empty_manifest() -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "files": {}}


def read_manifest(root: Path, *, missing_ok: bool, pending_ok: bool = False) -> dict[str, Any]:
    """The checked manifest of the store at ``root`` (an empty one when it is missing and
    ``missing_ok``). A manifest of an unfinished import is refused unless ``pending_ok`` (the
    import finishing it)."""
    path = root / MANIFEST
    if not path.exists():
        if missing_ok:
            return empty_manifest()
        if step_files(root):
            raise StoreError(
                f"{path}: missing, but the folder holds {len(step_files(root))} step files; rebuild it with "
                "graftrl.storage.store.rebuild_manifest (resuming the run that records into it does so)"
            )
        raise StoreError(
            f"{path}: no trajectory store here (manifest.json is missing); check the path, "
            "or create one with TrajectoryWriter or `graftrl import-trajectories`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StoreError(
            f"{path}: unreadable manifest ({error}); restore it from a backup (the step files hold "
            "the data; their checksums are lost with the manifest)"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: field 'format' is not {FORMAT!r}: not a graftrl trajectory store manifest")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: field 'schema_version' is {manifest.get('schema_version')!r}, but this graftrl reads "
            f"version {SCHEMA_VERSION}; use the graftrl release that wrote the store, or re-create it"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise StoreError(f"{path}: field 'files' must be an object; restore the manifest from a backup")
    for name, entry in files.items():
        if not STEP_FILE.match(name) or not isinstance(entry, dict):
            raise StoreError(f"{path}: field 'files': bad entry {name!r}; restore the manifest from a backup")
        for key, kind in (("step", int), ("rows", int), ("sha256", str)):
            if not isinstance(entry.get(key), kind):
                raise StoreError(
                    f"{path}: field 'files.{name}.{key}' is missing or not {kind.__name__}; "
                    "restore the manifest from a backup"
                )
        if entry["step"] != int(STEP_FILE.match(name).group(1)):  # type: ignore[union-attr]
            raise StoreError(
                f"{path}: field 'files.{name}.step' is {entry['step']}, which is not the file's step; "
                "restore the manifest from a backup"
            )
    pending = manifest.get(PENDING)
    if pending is not None and not pending_ok:
        command = pending.get("command") if isinstance(pending, dict) else None
        raise StoreError(
            f"{path}: an import into this store did not finish ({command or 'import-trajectories'}); "
            "run that same command again to complete it (it continues where it stopped), then use the store"
        )
    return manifest


def write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8") + b"\n"
    atomic_write(root / MANIFEST, data)


def step_files(root: Path) -> list[Path]:
    return sorted(path for path in root.glob("step_*.parquet") if STEP_FILE.match(path.name))


def file_entry(path: Path, where: str, fix: str) -> dict[str, Any]:
    """The manifest entry of a step file on disk, from its content: it must be a valid step file of
    this schema whose Parquet metadata names the step of its file name (else one line: ``fix``)."""
    data = path.read_bytes()
    step = int(STEP_FILE.match(path.name).group(1))  # type: ignore[union-attr]
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as error:
        raise StoreError(f"{where}: not a readable Parquet file ({error}); {fix}") from None
    validate_table(table, where, step, fix)
    stored_step = (table.schema.metadata or {}).get(META_STEP)
    if stored_step is not None and stored_step != str(step).encode():
        raise StoreError(
            f"{where}: its metadata says step {stored_step.decode(errors='replace')}, not {step}; {fix}"
        )
    return {
        "step": step,
        "rows": table.num_rows,
        "bytes": len(data),
        "sha256": sha256_bytes(data),
        "sources": sorted(set(table.column("source").to_pylist())),
    }


def rebuild_manifest(root: str | Path) -> list[int]:
    """Re-create a missing manifest.json from the step files present; returns the steps listed.

    Each file must be a valid step file of this schema (its Parquet metadata names the step and the
    schema version), so recorded steps are never orphaned silently; a file that is not refuses the
    rebuild with one line naming it. The checksums are the files' current ones.
    """
    root = Path(root)
    manifest = empty_manifest()
    for path in step_files(root):
        fix = f"move {path.name} out of the store to rebuild manifest.json from the other step files"
        manifest["files"][path.name] = file_entry(path, f"{path} (rebuilding the missing {MANIFEST})", fix)
    write_manifest(root, manifest)
    return sorted(entry["step"] for entry in manifest["files"].values())
