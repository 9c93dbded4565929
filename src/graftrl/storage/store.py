"""Trajectory store: every rollout group of every model, one Parquet file per step.

Layout of a store folder::

    store/
      manifest.json            format, schema version, and per file: step, rows, sources, sha256
      step_000000.parquet      all models' rows for step 0
      step_000001.parquet
      ...

Rows follow schema version 1 (``graftrl.storage.store_rows``: ``SCHEMA``, ``StoredTrajectory``,
the checks a file must pass); the manifest records the version too. Nothing is pickled.

Writes are atomic: a step file is serialised in memory, written to a hidden temp file in the
same folder, fsynced and renamed over the final name with ``os.replace``; the manifest is then
updated the same way. A crash therefore leaves either the previous state or a complete new step
file; temp files (``.step_*.tmp-*``) are never read, and a writer deletes leftovers when it
opens the store. The one window left: a crash between the
step file's rename and the manifest's leaves a complete file the manifest does not list yet (a
new step: ``verify`` reports it as unlisted) or, when a step is being overwritten, a file whose
checksum no longer matches (the reader says so and suggests re-writing the step).

An import writes several steps as one unit (``graftrl.storage.store_import``): while its
``import_in_progress`` record is in the manifest (``graftrl.storage.store_manifest``), every reader
and writer refuses the store, naming the command that finishes it.

Matching rule of the readers (``groups``, ``find_groups``): a group is identified by
(step, source, group_index), group_index being the prompt's position in the step's batch (a
batch can hold a prompt twice). When no step is given, a (prompt_id, source) pair resolves to
its *latest* occurrence: the highest step, then the highest group_index within that step.
"""

from __future__ import annotations

import io
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from graftrl.files import atomic_write, remove_stale_temps, sha256_bytes
from graftrl.storage.rundir import ensure_writable
from graftrl.storage.store_manifest import (
    FORMAT,
    MANIFEST,
    STEP_FILE,
    read_manifest,
    rebuild_manifest,
    step_file_name,
    step_files,
    write_manifest,
)
from graftrl.storage.store_rows import (
    FINISH_REASONS,
    MEAN_TOLERANCE,
    SCHEMA,
    SCHEMA_VERSION,
    StoredTrajectory,
    StoreError,
    rows_from_table,
    table_from_rows,
    tokenizer_id,
    validate_table,
)

__all__ = [  # the row format's public names are the store's too
    "FINISH_REASONS",
    "FORMAT",
    "MANIFEST",
    "MEAN_TOLERANCE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "StoreError",
    "StoredTrajectory",
    "TrajectoryStore",
    "TrajectoryWriter",
    "VerifyReport",
    "rebuild_manifest",
    "step_file_name",
    "tokenizer_id",
]


# ------------------------------------------------------------------------------------------
# Writer
# ------------------------------------------------------------------------------------------


def encode_step(step: int, rows: Sequence[StoredTrajectory]) -> tuple[bytes, dict[str, Any]]:
    """A step file's bytes and its manifest entry. Rows are validated first (the reader's checks),
    so a bad row is never written; the same rows give the same bytes."""
    if step < 0:
        raise StoreError(f"write_step: step must be >= 0, got {step}")
    if not rows:
        raise StoreError(f"write_step: no rows for step {step}")
    ordered = sorted(rows, key=lambda r: (r.source, r.group_index, r.index))
    table = table_from_rows(ordered, step)
    validate_table(table, f"step {step} (not written)", step, "fix the rows before writing them")
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    data = buffer.getvalue()
    entry = {
        "step": step,
        "rows": table.num_rows,
        "bytes": len(data),
        "sha256": sha256_bytes(data),
        "sources": sorted({r.source for r in rows}),
    }
    return data, entry


class TrajectoryWriter:
    """Writes step files and keeps the manifest current. One writer per store at a time.

    A store an import left unfinished is refused (``finishing_import``: the import that finishes
    it, ``graftrl.storage.store_import``)."""

    def __init__(self, root: str | Path, *, finishing_import: bool = False) -> None:
        self.root = ensure_writable(Path(root), "store folder (--store / store.path)")
        remove_stale_temps(self.root)  # left by a writer killed mid-write; never read
        self.rebuilt: list[int] = []
        """Steps re-listed from their files because manifest.json was missing (see ``rebuild_manifest``)."""
        if not (self.root / MANIFEST).exists() and step_files(self.root):
            self.rebuilt = rebuild_manifest(self.root)
        # refuse a foreign or newer store, or an unfinished import, up front
        read_manifest(self.root, missing_ok=True, pending_ok=finishing_import)
        self._pending_ok = finishing_import

    def manifest(self) -> dict[str, Any]:
        return read_manifest(self.root, missing_ok=True, pending_ok=self._pending_ok)

    def write_step(self, step: int, rows: Sequence[StoredTrajectory]) -> Path:
        """Write all models' rows for ``step`` (replacing an earlier file for that step)."""
        data, entry = encode_step(step, rows)
        return self.write_encoded(step, data, entry)

    def write_encoded(self, step: int, data: bytes, entry: Mapping[str, Any]) -> Path:
        """Write a step file ``encode_step`` made, then list it in the manifest."""
        name = step_file_name(step)
        manifest = self.manifest()
        atomic_write(self.root / name, data)
        manifest["files"][name] = dict(entry)
        write_manifest(self.root, manifest)
        return self.root / name

    def truncate_after(self, step: int) -> list[int]:
        """Drop steps > ``step`` (on resume); their files move to ``discarded/``. Returns them."""
        manifest = self.manifest()
        later = {name: e for name, e in manifest["files"].items() if e["step"] > step}
        if not later:
            return []
        for name in later:
            del manifest["files"][name]
        write_manifest(self.root, manifest)
        discarded = self.root / "discarded"
        discarded.mkdir(exist_ok=True)
        for name in later:
            if (self.root / name).exists():
                os.replace(self.root / name, discarded / name)
        return sorted(e["step"] for e in later.values())


# ------------------------------------------------------------------------------------------
# Reader
# ------------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What ``TrajectoryStore.verify`` found. ``ok`` is False when any problem was found."""

    root: Path
    checked: dict[str, int] = field(default_factory=dict)
    """File name -> rows, for every file that passed."""
    problems: list[str] = field(default_factory=list)
    """One message per damaged file (file, field, what to do)."""
    warnings: list[str] = field(default_factory=list)
    """Unlisted step files and leftover temp files: harmless to readers."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = f"{self.root}: {len(self.checked)} file(s), {sum(self.checked.values())} rows verified"
        lines = [head + (", no problems" if self.ok else f", {len(self.problems)} problem(s):")]
        lines += [f"  error: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


GroupKey = tuple[str, str]
"""(prompt_id, source)."""


class TrajectoryStore:
    """Reads a store; every read checks the file's checksum and every field.

    Reads are not cached (a store can grow while a run writes it) except a small index of
    which (prompt_id, source) groups each file holds, keyed by the file's checksum.
    """

    def __init__(self, root: str | Path, *, finishing_import: bool = False) -> None:
        self.root = Path(root)
        self._pending_ok = finishing_import
        """Only for the import finishing an interrupted one: every other reader refuses such a store."""
        self._manifest()
        self._keys: dict[str, tuple[str, list[tuple[str, str, int]]]] = {}

    def _entries(self) -> dict[int, tuple[str, dict[str, Any]]]:
        manifest = self._manifest()
        return {entry["step"]: (name, entry) for name, entry in manifest["files"].items()}

    def steps(self) -> list[int]:
        """Steps listed in the manifest, ascending."""
        return sorted(self._entries())

    def sources_by_step(self) -> dict[int, list[str]]:
        """step -> the sources the manifest lists for its file (from the manifest alone)."""
        return {step: list(entry.get("sources", [])) for step, (_, entry) in self._entries().items()}

    def sources(self) -> list[str]:
        return sorted({s for _, e in self._entries().values() for s in e.get("sources", [])})

    def fingerprint(self) -> str:
        """sha256 over the manifest's (file, step, rows, sha256) entries: equal fingerprints mean
        the same step files, byte for byte (each file's checksum is verified on every read)."""
        entries = sorted((name, e["step"], e["rows"], e["sha256"]) for name, e in self._read_files().items())
        return sha256_bytes(json.dumps(entries).encode("utf-8"))

    def _read_files(self) -> dict[str, Any]:
        return self._manifest()["files"]

    def _manifest(self) -> dict[str, Any]:
        return read_manifest(self.root, missing_ok=False, pending_ok=self._pending_ok)

    def _load(self, step: int, name: str, entry: Mapping[str, Any]) -> pa.Table:
        path = self.root / name
        fix_restore = "restore the file from a backup or re-create the step (re-run it or re-import)"
        if not path.exists():
            raise StoreError(
                f"{path}: missing, but manifest.json lists it for step {step}; restore the file from a backup, "
                f"or drop its entry 'files.{name}' from manifest.json to give up the step"
            )
        data = path.read_bytes()
        digest = sha256_bytes(data)
        if digest != entry["sha256"]:
            raise StoreError(
                f"{path}: checksum mismatch (sha256 {digest[:12]}..., manifest.json field "
                f"'files.{name}.sha256' says {entry['sha256'][:12]}...): the file changed after it was "
                f"written (disk damage, an edit, or a writer interrupted while replacing the step); {fix_restore}"
            )
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError, ValueError) as error:
            raise StoreError(f"{path}: not a readable Parquet file ({error}); {fix_restore}") from None
        validate_table(table, str(path), step, fix_restore)
        if table.num_rows != entry["rows"]:
            raise StoreError(
                f"{path}: {table.num_rows} rows, manifest.json field 'files.{name}.rows' says {entry['rows']}; "
                f"{fix_restore}"
            )
        self._keys[name] = (
            digest,
            list(
                zip(
                    table.column("prompt_id").to_pylist(),
                    table.column("source").to_pylist(),
                    table.column("group_index").to_pylist(),
                    strict=True,
                )
            ),
        )
        return table

    def _table(self, step: int) -> pa.Table:
        entries = self._entries()
        if step not in entries:
            raise StoreError(
                f"{self.root}: no step {step} in the store (steps: {_span(sorted(entries))}); pick a listed step"
            )
        name, entry = entries[step]
        return self._load(step, name, entry)

    def read_step(self, step: int, *, token_logprobs: bool = True) -> list[StoredTrajectory]:
        """Every row of ``step``, ordered by (source, group_index, index).

        ``token_logprobs=False`` skips building the per-token tuples (they come back None),
        which is much faster when only the means are needed.
        """
        return rows_from_table(self._table(step), token_logprobs)

    def _group_keys(self, step: int, name: str, entry: Mapping[str, Any]) -> list[tuple[str, str, int]]:
        cached = self._keys.get(name)
        if cached is None or cached[0] != entry["sha256"]:
            self._load(step, name, entry)
        return self._keys[name][1]

    def occurrences(self, source: str | None = None) -> dict[GroupKey, list[tuple[int, int]]]:
        """(prompt_id, source) -> every (step, group_index) holding that group, ascending.

        For matching rules other than ``groups``'s (e.g. the nearest stored step); reads each
        step file once to index it (cached by checksum, as ``groups`` does).
        """
        found: dict[GroupKey, set[tuple[int, int]]] = defaultdict(set)
        for step, (name, entry) in sorted(self._entries().items()):
            if source is not None and "sources" in entry and source not in entry["sources"]:
                continue
            for prompt_id, src, group in self._group_keys(step, name, entry):
                if source is None or src == source:
                    found[(prompt_id, src)].add((step, group))
        return {key: sorted(places) for key, places in found.items()}

    def _latest(self, prompt_ids: set[str] | None, source: str | None) -> dict[GroupKey, tuple[int, int]]:
        """(prompt_id, source) -> (step, group_index) of the latest occurrence."""
        latest: dict[GroupKey, tuple[int, int]] = {}
        for step, (name, entry) in sorted(self._entries().items()):
            if source is not None and "sources" in entry and source not in entry["sources"]:
                continue
            for prompt_id, src, group in self._group_keys(step, name, entry):
                if (source is None or src == source) and (prompt_ids is None or prompt_id in prompt_ids):
                    key = (prompt_id, src)
                    latest[key] = max(latest.get(key, (step, group)), (step, group))
        return latest

    def groups(
        self,
        step: int | None = None,
        source: str | None = None,
        prompt_ids: Iterable[str] | None = None,
        *,
        token_logprobs: bool = True,
    ) -> dict[GroupKey, list[StoredTrajectory]]:
        """(prompt_id, source) -> the group's rows, ordered by index.

        With ``step`` only that step is read; without it each key resolves to its latest
        occurrence (highest step, then highest group_index). A prompt drawn twice in one step
        also resolves to its later group.
        """
        wanted = None if prompt_ids is None else {str(p) for p in prompt_ids}

        def match(prompt_id: str, src: str) -> bool:
            return (source is None or src == source) and (wanted is None or prompt_id in wanted)

        if step is not None:
            rows = [
                r for r in self.read_step(step, token_logprobs=token_logprobs) if match(r.prompt_id, r.source)
            ]
            last: dict[GroupKey, int] = {}
            for r in rows:
                last[(r.prompt_id, r.source)] = max(last.get((r.prompt_id, r.source), -1), r.group_index)
            chosen = [r for r in rows if r.group_index == last[(r.prompt_id, r.source)]]
        else:
            by_step: dict[int, set[tuple[str, int]]] = defaultdict(set)
            for (_, src), (s, group) in self._latest(wanted, source).items():
                by_step[s].add((src, group))
            chosen = [
                r
                for s in sorted(by_step)
                for r in self.read_step(s, token_logprobs=token_logprobs)
                if (r.source, r.group_index) in by_step[s]
            ]
        out: dict[GroupKey, list[StoredTrajectory]] = {}
        for r in chosen:
            out.setdefault((r.prompt_id, r.source), []).append(r)
        return {key: sorted(rows, key=lambda r: r.index) for key, rows in out.items()}

    def find_groups(
        self,
        prompt_ids: Iterable[str],
        source: str,
        step: int | None = None,
        *,
        token_logprobs: bool = False,
    ) -> dict[str, list[StoredTrajectory]]:
        """prompt_id -> ``source``'s group for that prompt; prompts never stored are absent.

        For stored-peer training (algorithm.md §2.3): with ``step`` the group must come from that step;
        with ``step=None`` the latest occurrence wins (highest step, then later position in the
        batch). Per-token log-probs are skipped unless asked for (training needs the means).
        """
        found = self.groups(step, source, prompt_ids, token_logprobs=token_logprobs)
        return {prompt_id: rows for (prompt_id, _), rows in found.items()}

    def verify(self) -> VerifyReport:
        """Check every listed file (existence, checksum, Parquet, schema, values); never raises
        for damage in a step file (a broken manifest still raises StoreError)."""
        report = VerifyReport(self.root)
        entries = self._entries()
        for step, (name, entry) in sorted(entries.items()):
            try:
                report.checked[name] = self._load(step, name, entry).num_rows
            except StoreError as error:
                report.problems.append(str(error))
        listed = {name for name, _ in entries.values()}
        for path in sorted(self.root.iterdir()):
            if STEP_FILE.match(path.name) and path.name not in listed:
                report.warnings.append(
                    f"{path}: step file not listed in manifest.json (a writer stopped before updating the "
                    "manifest); readers ignore it: re-write the step, or delete the file"
                )
            elif path.name.startswith(".") and ".tmp-" in path.name:
                report.warnings.append(f"{path}: leftover temp file of an interrupted write; delete it")
        return report


def _span(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}..{steps[-1]} ({len(steps)} files)"
