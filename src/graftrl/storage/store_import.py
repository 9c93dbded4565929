"""Several steps written into a trajectory store as one unit: an import that a kill leaves resumable.

``graftrl import-trajectories`` may add many step files to a store (merging with steps already
there). Written one after another, a kill half way would leave a store whose manifest lists some
of the import's steps and not others, and that store would pass every check: a peer run would
train on part of the file without a word. So an import goes through ``StoreImport``:

1. ``StoreImport(root, key, command)`` opens the store before anything expensive (the source
   model's scoring) is done: a store that cannot be written, a foreign one, or one holding the
   unfinished import of *another* command is refused here, in one line;
   ``check_sources`` refuses a step that already holds one of the import's sources.
2. ``commit(rows_by_step)`` computes every step file's bytes first (old rows + new rows, the same
   bytes for the same rows), records them in the manifest as ``import_in_progress`` (the command
   and each file's SHA-256), writes the files one by one (each atomically, each listed in the
   manifest as it lands) and removes the record last.

While the record is there, every reader and writer of the store refuses it in one line
(``store_manifest.read_manifest``). Rerunning the same command (``key``: the file's content and
every argument) finishes the import: a step whose file already has the recorded SHA-256 was
written by the interrupted run and is kept; the others still hold what the store held before (a
file is replaced by one atomic rename, and its manifest entry only after it), so they are merged
again from there. The store ends byte for byte as an uninterrupted import leaves it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from graftrl.files import sha256_file
from graftrl.storage.store import TrajectoryStore, TrajectoryWriter, encode_step
from graftrl.storage.store_manifest import PENDING, STEP_FILE, file_entry, step_file_name, write_manifest
from graftrl.storage.store_rows import StoredTrajectory, StoreError


class StoreImport:
    """One import into the store at ``root``; ``key`` identifies the command (file content and
    arguments), ``command`` is how the user reruns it (named in the refusals)."""

    def __init__(self, root: str | Path, key: str, command: str) -> None:
        self.writer = TrajectoryWriter(root, finishing_import=True)
        self.root = self.writer.root
        self.key = key
        self.command = command
        manifest = self.writer.manifest()
        pending = manifest.get(PENDING)
        self.done: dict[int, str] = {}
        """step -> its file's SHA-256, for steps an interrupted run of this import already wrote."""
        if pending is None:
            return
        if not isinstance(pending, dict) or pending.get("key") != key:
            what = pending.get("command") if isinstance(pending, dict) else None
            raise StoreError(
                f"{self.root}: an import into this store did not finish ({what or 'another import'}); "
                "run that command again to complete it before importing anything else"
            )
        for name, digest in (pending.get("steps") or {}).items():
            match = STEP_FILE.match(name)
            path = self.root / name
            if match and path.is_file() and sha256_file(path)[0] == digest:
                self.done[int(match.group(1))] = digest

    def check_sources(self, sources_by_step: Mapping[int, Collection[str]]) -> None:
        """Refuse a step that already holds trajectories of one of the import's sources (except a
        step this same import wrote before it was interrupted)."""
        files = self.writer.manifest()["files"]
        for step, sources in sorted(sources_by_step.items()):
            entry = files.get(step_file_name(step))
            if entry is None or step in self.done:
                continue
            clash = set(sources) & set(entry.get("sources", []))
            if clash:
                raise StoreError(
                    f"{self.root}: step {step} already holds trajectories from source(s) {sorted(clash)}; import "
                    "into a new --store folder, or give these another name with --source"
                )

    def commit(self, rows_by_step: Mapping[int, Sequence[StoredTrajectory]]) -> None:
        """Merge each step's new rows with the rows the store holds there and write them all as one
        unit (see the module docstring)."""
        reader = (
            TrajectoryStore(self.root, finishing_import=True) if self.writer.manifest()["files"] else None
        )
        held = set(reader.steps()) if reader is not None else set()
        encoded: dict[int, tuple[bytes, dict[str, Any]]] = {}
        for step, rows in sorted(rows_by_step.items()):
            if step in self.done:
                continue
            old = reader.read_step(step) if reader is not None and step in held else []
            encoded[step] = encode_step(step, [*old, *rows])
        manifest = self.writer.manifest()
        planned = {step_file_name(step): digest for step, digest in self.done.items()}
        planned.update({step_file_name(step): entry["sha256"] for step, (_, entry) in encoded.items()})
        manifest[PENDING] = {"key": self.key, "command": self.command, "steps": planned}
        write_manifest(self.root, manifest)  # from here on, readers refuse the store until the end
        for step, (data, entry) in encoded.items():
            self.writer.write_encoded(step, data, entry)
        manifest = self.writer.manifest()
        for step in self.done:  # written before the kill; listed unless the kill came in between
            name = step_file_name(step)
            if manifest["files"].get(name, {}).get("sha256") != self.done[step]:
                fix = f"rerun the import into a copy of the store from before it ({self.command})"
                manifest["files"][name] = file_entry(self.root / name, str(self.root / name), fix)
        del manifest[PENDING]
        write_manifest(self.root, manifest)
