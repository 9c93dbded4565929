"""Trajectory store: every rollout group of every model, one Parquet file per step.

Layout of a store folder::

    store/
      manifest.json            format, schema version, and per file: step, rows, sources, sha256
      step_000000.parquet      all models' rows for step 0
      step_000001.parquet
      ...

Schema version 1 (one row per sampled response; see ``SCHEMA``). The schema version is written
in each file's Parquet key-value metadata (``graftrl.schema_version``) and in the manifest; a
reader refuses any other version. Nothing is pickled.

Writes are atomic: a step file is serialised in memory, written to a hidden temp file in the
same folder, fsynced and renamed over the final name with ``os.replace``; the manifest is then
updated the same way. A crash therefore leaves either the previous state or a complete new step
file; temp files (``.step_*.tmp-*``) are never read, and a writer deletes leftovers when it
opens the store. The one window left: a crash between the
step file's rename and the manifest's leaves a complete file the manifest does not list yet (a
new step: ``verify`` reports it as unlisted) or, when a step is being overwritten, a file whose
checksum no longer matches (the reader says so and suggests re-writing the step).

Matching rule of the readers (``groups``, ``find_groups``): a group is identified by
(step, source, group_index), group_index being the prompt's position in the step's batch (a
batch can hold a prompt twice). When no step is given, a (prompt_id, source) pair resolves to
its *latest* occurrence: the highest step, then the highest group_index within that step.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED
from graftrl.errors import UserError
from graftrl.files import atomic_write, remove_stale_temps, sha256_bytes
from graftrl.storage.records import TrajectoryRecord

SCHEMA_VERSION = 1
FORMAT = "graftrl.trajectory_store"
MANIFEST = "manifest.json"
_META_VERSION = b"graftrl.schema_version"
_META_STEP = b"graftrl.step"
_STEP_FILE = re.compile(r"^step_(\d{6,})\.parquet$")
FINISH_REASONS = ("stop", "length")

SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("tokenizer_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),
        pa.field("group_index", pa.int64(), nullable=False),
        pa.field("index", pa.int64(), nullable=False),
        pa.field("n", pa.int64(), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("num_bytes", pa.int64(), nullable=False),
        pa.field("token_logprobs", pa.list_(pa.float32()), nullable=True),
        pa.field("eos_logprob", pa.float32(), nullable=True),
        pa.field("mean_logprob", pa.float64(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("advantage", pa.float64(), nullable=False),
    ]
)
"""Parquet schema, version 1. Nullable: token_logprobs (an import may carry only the mean)
and eos_logprob (only a response that stopped has one)."""

_MEAN_TOLERANCE = 1e-3
"""|mean(token_logprobs) - mean_logprob| allowed (float32 storage, float32 means)."""


class StoreError(UserError):
    """A trajectory store problem, naming the file and field, and what to do about it."""


@dataclass(frozen=True)
class StoredTrajectory:
    """One stored response: the tokenizer-neutral record plus what it needs to be replayed.

    The first eleven fields are ``records.TrajectoryRecord``'s (``to_record`` returns one).
    """

    prompt_id: str
    step: int
    """Training step at which the response was sampled (0-based, as in metrics.jsonl)."""
    source: str
    """Name of the model that sampled it."""
    index: int
    """Position within its group, 0..n-1."""
    response: str
    """Response text, decoded without special tokens."""
    reward: float
    """Verifier reward in {0, 1}."""
    advantage: float
    """GRPO advantage computed by the source on its full group."""
    mean_logprob: float
    """Source behaviour log-prob averaged over content tokens (terminal EOS excluded)."""
    num_tokens: int
    """Source token count, terminal EOS excluded."""
    num_bytes: int
    """UTF-8 byte length of ``response``."""
    finished: bool
    """True when the response ended with EOS (finish reason "stop"); False: cut at the limit."""
    prompt_text: str
    """The text the source's prompt template was applied to (problem plus run suffix)."""
    tokenizer_id: str
    """Source tokenizer identity: ``name_or_path@<vocab sha256 prefix>`` (see ``tokenizer_id``)."""
    n: int
    """Group size."""
    group_index: int = 0
    """Position of the prompt in the step's batch (tells apart a prompt drawn twice in a step)."""
    token_logprobs: tuple[float, ...] | None = None
    """Per content token behaviour log-probs (float32, ``num_tokens`` of them, EOS excluded);
    None when the source only reported the mean, or when a reader skipped the column."""
    eos_logprob: float | None = None
    """Behaviour log-prob of the terminal EOS when the response stopped, else None."""

    @property
    def finish_reason(self) -> str:
        return "stop" if self.finished else "length"

    def to_record(self) -> TrajectoryRecord:
        """The record the trainer exchanges between models."""
        names = [f.name for f in fields(TrajectoryRecord)]
        return TrajectoryRecord(**{name: getattr(self, name) for name in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def tokenizer_id(tokenizer: Any) -> str:
    """``name_or_path@<first 16 hex of sha256(vocab)>``: equal ids mean the same token ids.

    The hash covers the full vocabulary (added tokens included) as sorted (token, id) pairs.
    """
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    return f"{name}@{digest.hexdigest()[:16]}"


class _Problem(Protocol):
    id: str
    problem: str


def rows_from_rollout(
    step: int,
    source: str,
    tokenizer_id: str,
    problems: Sequence[_Problem],
    rollout: Any,
    rewards: Any,
    advantages: Any,
    *,
    prompt_texts: Sequence[str] | None = None,
) -> list[StoredTrajectory]:
    """Rows for one model's rollout batch, prompt-major like the trainer (row = p * n + i).

    rollout: a ``rollout.RolloutBatch``; rewards, advantages: [P, n] tensors (or anything
    ``.reshape(-1)`` + ``float`` work on). prompt_texts: the strings the source's template was
    applied to (the trainer's prompts with the suffix); default ``problem.problem``. The mean
    log-prob is ``RolloutBatch.content_mean_logprob`` so ``to_record()`` equals the trainer's
    record for the same row.
    """
    n = int(rollout.n)
    rows_total = len(rollout.texts)
    if rows_total != len(problems) * n:
        raise ValueError(f"rows_from_rollout: {rows_total} responses for {len(problems)} prompts x n={n}")
    flat_rewards = [float(x) for x in rewards.reshape(-1).tolist()]
    flat_advantages = [float(x) for x in advantages.reshape(-1).tolist()]
    if len(flat_rewards) != rows_total or len(flat_advantages) != rows_total:
        raise ValueError(
            f"rows_from_rollout: rewards/advantages hold {len(flat_rewards)}/{len(flat_advantages)} "
            f"values, expected [P, n] = {rows_total}"
        )
    texts = list(prompt_texts) if prompt_texts is not None else [p.problem for p in problems]
    if len(texts) != len(problems):
        raise ValueError(f"rows_from_rollout: {len(texts)} prompt texts for {len(problems)} problems")
    out = []
    for row in range(rows_total):
        finished = bool(rollout.finished[row])
        logprobs = rollout.behaviour_logprobs[row].float()
        content = logprobs[:-1] if finished and len(logprobs) else logprobs
        text = rollout.texts[row]
        out.append(
            StoredTrajectory(
                prompt_id=str(problems[row // n].id),
                step=int(step),
                source=source,
                index=row % n,
                response=text,
                reward=flat_rewards[row],
                advantage=flat_advantages[row],
                mean_logprob=rollout.content_mean_logprob(row),
                num_tokens=rollout.content_length(row),
                num_bytes=len(text.encode("utf-8")),
                finished=finished,
                prompt_text=texts[row // n],
                tokenizer_id=tokenizer_id,
                n=n,
                group_index=row // n,
                token_logprobs=tuple(content.tolist()),
                eos_logprob=float(logprobs[-1]) if finished and len(logprobs) else None,
            )
        )
    return out


def step_file_name(step: int) -> str:
    return f"step_{step:06d}.parquet"


_atomic_write = atomic_write
_sha256 = sha256_bytes


# ------------------------------------------------------------------------------------------
# Table <-> rows, and validation
# ------------------------------------------------------------------------------------------


def _table_from_rows(rows: Sequence[StoredTrajectory], step: int) -> pa.Table:
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for row in rows:
        for name in SCHEMA.names:
            if name == "finish_reason":
                columns[name].append(row.finish_reason)
            elif name == "token_logprobs":
                values = row.token_logprobs
                columns[name].append(None if values is None else list(values))
            else:
                columns[name].append(getattr(row, name))
    metadata = {_META_VERSION: str(SCHEMA_VERSION).encode(), _META_STEP: str(step).encode()}
    try:
        return pa.Table.from_pydict(columns, schema=SCHEMA.with_metadata(metadata))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise StoreError(f"step {step}: rows do not fit the store schema: {error}") from None


def _rows_from_table(table: pa.Table, token_logprobs: bool = True) -> list[StoredTrajectory]:
    data = table.to_pydict()
    out = []
    for i in range(table.num_rows):
        lps = data["token_logprobs"][i] if token_logprobs else None
        eos = data["eos_logprob"][i]
        out.append(
            StoredTrajectory(
                prompt_id=data["prompt_id"][i],
                step=data["step"][i],
                source=data["source"][i],
                index=data["index"][i],
                response=data["response"][i],
                reward=data["reward"][i],
                advantage=data["advantage"][i],
                mean_logprob=data["mean_logprob"][i],
                num_tokens=data["num_tokens"][i],
                num_bytes=data["num_bytes"][i],
                finished=data["finish_reason"][i] == "stop",
                prompt_text=data["prompt_text"][i],
                tokenizer_id=data["tokenizer_id"][i],
                n=data["n"][i],
                group_index=data["group_index"][i],
                token_logprobs=None if lps is None else tuple(lps),
                eos_logprob=eos,
            )
        )
    return out


def _describe_row(data: Mapping[str, Sequence[Any]], i: int) -> str:
    keys = ", ".join(f"{key} {data[key][i]!r}" for key in ("source", "prompt_id", "index") if key in data)
    return f"row {i} ({keys})"


def _validate_table(table: pa.Table, where: str, step: int, fix: str) -> None:
    """Raise StoreError naming ``where`` and the field at the first problem found."""

    def fail(message: str) -> None:
        raise StoreError(f"{where}: {message}; {fix}")

    metadata = table.schema.metadata or {}
    version = metadata.get(_META_VERSION)
    if version is None:
        fail(
            f"no schema version in the Parquet metadata (key {_META_VERSION.decode()!r}): not a graftrl store file"
        )
    if version != str(SCHEMA_VERSION).encode():
        raise StoreError(
            f"{where}: schema version {version.decode(errors='replace')}, but this graftrl reads version "
            f"{SCHEMA_VERSION}; read it with the graftrl release that wrote it, or re-create the store "
            "(re-run the steps or re-import the trajectories) with this one"
        )
    for expected in SCHEMA:
        if expected.name not in table.schema.names:
            fail(f"missing column {expected.name!r} (schema v{SCHEMA_VERSION} expects {expected.type})")
        actual = table.schema.field(expected.name).type
        if actual != expected.type:
            fail(
                f"column {expected.name!r} has type {actual}, schema v{SCHEMA_VERSION} expects {expected.type}"
            )
    data = table.select([name for name in SCHEMA.names if name != "token_logprobs"]).to_pydict()
    for expected in SCHEMA:
        if not expected.nullable and table.column(expected.name).null_count:
            i = data[expected.name].index(None)
            fail(f"column {expected.name!r} is null at {_describe_row(data, i)}")

    def check(name: str, bad: np.ndarray, what: str) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            fail(f"column {name!r} at {_describe_row(data, i)}: {what} (value {data[name][i]!r})")

    ints = {k: np.asarray(data[k], dtype=np.int64) for k in ("step", "group_index", "index", "n")}
    ints.update({k: np.asarray(data[k], dtype=np.int64) for k in ("num_tokens", "num_bytes")})
    check("step", ints["step"] != step, f"step differs from the file's step {step}")
    check("n", ints["n"] < 1, "group size n must be >= 1")
    check("index", (ints["index"] < 0) | (ints["index"] >= ints["n"]), "index must be in 0..n-1")
    check("group_index", ints["group_index"] < 0, "negative group_index")
    check("num_tokens", ints["num_tokens"] < 0, "negative token count")
    check("num_bytes", ints["num_bytes"] < 0, "negative byte count")
    byte_lengths = np.asarray([len(text.encode("utf-8")) for text in data["response"]], dtype=np.int64)
    check("num_bytes", ints["num_bytes"] != byte_lengths, "differs from the UTF-8 length of 'response'")
    reward = np.asarray(data["reward"], dtype=np.float64)
    check("reward", np.isnan(reward), "reward is NaN")
    check("reward", (reward != 0.0) & (reward != 1.0), "reward must be 0 or 1")
    for name in ("advantage", "mean_logprob"):
        check(name, ~np.isfinite(np.asarray(data[name], dtype=np.float64)), "not a finite number")
    check(
        "mean_logprob", np.asarray(data["mean_logprob"], dtype=np.float64) > 1e-6, "a log-prob must be <= 0"
    )
    check(
        "finish_reason",
        np.asarray([r not in FINISH_REASONS for r in data["finish_reason"]], dtype=bool),
        f"must be one of {FINISH_REASONS}",
    )
    eos = np.asarray([np.nan if v is None else v for v in data["eos_logprob"]], dtype=np.float64)
    has_eos = np.asarray([v is not None for v in data["eos_logprob"]], dtype=bool)
    stopped = np.asarray([r == "stop" for r in data["finish_reason"]], dtype=bool)
    check("eos_logprob", has_eos & ~stopped, "set on a response whose finish_reason is 'length'")
    check("eos_logprob", has_eos & ~(eos <= 1e-6), "not a finite log-prob <= 0")

    column = table.column("token_logprobs").combine_chunks()
    present = ~column.is_null().to_numpy(zero_copy_only=False)
    if present.any():
        lengths = np.asarray(column.value_lengths().fill_null(0), dtype=np.int64)
        check("token_logprobs", present & (lengths != ints["num_tokens"]), "length differs from 'num_tokens'")
        values = np.asarray(column.flatten(), dtype=np.float64)
        bad_value = ~(values <= 1e-6)  # NaN, +inf and positive values
        owners = np.repeat(np.arange(len(lengths)), np.where(present, lengths, 0))
        rows_bad = np.zeros(len(lengths), dtype=bool)
        rows_bad[owners[bad_value]] = True
        check("token_logprobs", rows_bad, "holds a value that is not a finite log-prob <= 0")
        sums = np.zeros(len(lengths))
        np.add.at(sums, owners, values)
        means = np.divide(sums, lengths, out=np.zeros(len(lengths)), where=lengths > 0)
        mean = np.asarray(data["mean_logprob"], dtype=np.float64)
        off = present & (np.abs(means - mean) > _MEAN_TOLERANCE * np.maximum(1.0, np.abs(mean)))
        check("mean_logprob", off, "differs from the mean of 'token_logprobs'")

    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, (source, group) in enumerate(zip(data["source"], data["group_index"], strict=True)):
        groups[(source, group)].append(i)
    for (source, group), members in groups.items():
        first = members[0]
        for key in ("prompt_id", "n", "tokenizer_id", "prompt_text"):
            values = {data[key][i] for i in members}
            if len(values) > 1:
                fail(
                    f"column {key!r}: group {group} of source {source!r} mixes values {sorted(map(str, values))}"
                )
        n = data["n"][first]
        indices = sorted(data["index"][i] for i in members)
        if indices != list(range(n)):
            fail(
                f"column 'index': group {group} of source {source!r} (prompt {data['prompt_id'][first]!r}) "
                f"holds indices {indices}, expected 0..{n - 1} once each (n = {n})"
            )


# ------------------------------------------------------------------------------------------
# Manifest
# ------------------------------------------------------------------------------------------


def _empty_manifest() -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "files": {}}


def _read_manifest(root: Path, *, missing_ok: bool) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.exists():
        if missing_ok:
            return _empty_manifest()
        if _step_files(root):
            raise StoreError(
                f"{path}: missing, but the folder holds {len(_step_files(root))} step files; rebuild it with "
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
        if not _STEP_FILE.match(name) or not isinstance(entry, dict):
            raise StoreError(f"{path}: field 'files': bad entry {name!r}; restore the manifest from a backup")
        for key, kind in (("step", int), ("rows", int), ("sha256", str)):
            if not isinstance(entry.get(key), kind):
                raise StoreError(
                    f"{path}: field 'files.{name}.{key}' is missing or not {kind.__name__}; "
                    "restore the manifest from a backup"
                )
        if entry["step"] != int(_STEP_FILE.match(name).group(1)):  # type: ignore[union-attr]
            raise StoreError(
                f"{path}: field 'files.{name}.step' is {entry['step']}, which is not the file's step; "
                "restore the manifest from a backup"
            )
    return manifest


def _write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8") + b"\n"
    _atomic_write(root / MANIFEST, data)


def _step_files(root: Path) -> list[Path]:
    return sorted(path for path in root.glob("step_*.parquet") if _STEP_FILE.match(path.name))


def rebuild_manifest(root: str | Path) -> list[int]:
    """Re-create a missing manifest.json from the step files present; returns the steps listed.

    Each file must be a valid step file of this schema (its Parquet metadata names the step and the
    schema version), so recorded steps are never orphaned silently; a file that is not refuses the
    rebuild with one line naming it. The checksums are the files' current ones.
    """
    root = Path(root)
    manifest = _empty_manifest()
    for path in _step_files(root):
        data = path.read_bytes()
        step = int(_STEP_FILE.match(path.name).group(1))  # type: ignore[union-attr]
        fix = f"move {path.name} out of the store to rebuild manifest.json from the other step files"
        where = f"{path} (rebuilding the missing {MANIFEST})"
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError, ValueError) as error:
            raise StoreError(f"{where}: not a readable Parquet file ({error}); {fix}") from None
        _validate_table(table, where, step, fix)
        stored_step = (table.schema.metadata or {}).get(_META_STEP)
        if stored_step is not None and stored_step != str(step).encode():
            raise StoreError(
                f"{where}: its metadata says step {stored_step.decode(errors='replace')}, not {step}; {fix}"
            )
        manifest["files"][path.name] = {
            "step": step,
            "rows": table.num_rows,
            "bytes": len(data),
            "sha256": _sha256(data),
            "sources": sorted(set(table.column("source").to_pylist())),
        }
    _write_manifest(root, manifest)
    return sorted(entry["step"] for entry in manifest["files"].values())


# ------------------------------------------------------------------------------------------
# Writer
# ------------------------------------------------------------------------------------------


class TrajectoryWriter:
    """Writes step files and keeps the manifest current. One writer per store at a time."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(
                f"store folder {self.root}: cannot create it ({error.strerror or error}); choose a writable "
                "folder (--store / store.path)"
            ) from None
        remove_stale_temps(self.root)  # left by a writer killed mid-write; never read
        self.rebuilt: list[int] = []
        """Steps re-listed from their files because manifest.json was missing (see ``rebuild_manifest``)."""
        if not (self.root / MANIFEST).exists() and _step_files(self.root):
            self.rebuilt = rebuild_manifest(self.root)
        _read_manifest(self.root, missing_ok=True)  # refuse a foreign or newer store up front

    def write_step(self, step: int, rows: Sequence[StoredTrajectory]) -> Path:
        """Write all models' rows for ``step`` (replacing an earlier file for that step).

        Rows are validated first (same checks as the reader), so a bad row is never written.
        """
        if step < 0:
            raise StoreError(f"write_step: step must be >= 0, got {step}")
        if not rows:
            raise StoreError(f"write_step: no rows for step {step}")
        ordered = sorted(rows, key=lambda r: (r.source, r.group_index, r.index))
        table = _table_from_rows(ordered, step)
        name = step_file_name(step)
        _validate_table(table, f"step {step} (not written)", step, "fix the rows before writing them")
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="zstd")
        data = buffer.getvalue()
        manifest = _read_manifest(self.root, missing_ok=True)
        _atomic_write(self.root / name, data)
        manifest["files"][name] = {
            "step": step,
            "rows": table.num_rows,
            "bytes": len(data),
            "sha256": _sha256(data),
            "sources": sorted({r.source for r in rows}),
        }
        _write_manifest(self.root, manifest)
        return self.root / name

    def truncate_after(self, step: int) -> list[int]:
        """Drop steps > ``step`` (on resume); their files move to ``discarded/``. Returns them."""
        manifest = _read_manifest(self.root, missing_ok=True)
        later = {name: e for name, e in manifest["files"].items() if e["step"] > step}
        if not later:
            return []
        for name in later:
            del manifest["files"][name]
        _write_manifest(self.root, manifest)
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

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        _read_manifest(self.root, missing_ok=False)
        self._keys: dict[str, tuple[str, list[tuple[str, str, int]]]] = {}

    def _entries(self) -> dict[int, tuple[str, dict[str, Any]]]:
        manifest = _read_manifest(self.root, missing_ok=False)
        return {entry["step"]: (name, entry) for name, entry in manifest["files"].items()}

    def steps(self) -> list[int]:
        """Steps listed in the manifest, ascending."""
        return sorted(self._entries())

    def sources(self) -> list[str]:
        return sorted({s for _, e in self._entries().values() for s in e.get("sources", [])})

    def _load(self, step: int, name: str, entry: Mapping[str, Any]) -> pa.Table:
        path = self.root / name
        fix_restore = "restore the file from a backup or re-create the step (re-run it or re-import)"
        if not path.exists():
            raise StoreError(
                f"{path}: missing, but manifest.json lists it for step {step}; restore the file from a backup, "
                f"or drop its entry 'files.{name}' from manifest.json to give up the step"
            )
        data = path.read_bytes()
        digest = _sha256(data)
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
        _validate_table(table, str(path), step, fix_restore)
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
        return _rows_from_table(self._table(step), token_logprobs)

    def _group_keys(self, step: int, name: str, entry: Mapping[str, Any]) -> list[tuple[str, str, int]]:
        cached = self._keys.get(name)
        if cached is None or cached[0] != entry["sha256"]:
            self._load(step, name, entry)
        return self._keys[name][1]

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

        For stored-peer training (SPEC 2.3): with ``step`` the group must come from that step;
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
            if _STEP_FILE.match(path.name) and path.name not in listed:
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


# ------------------------------------------------------------------------------------------
# Import of external trajectories
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportSummary:
    rows: int
    groups: int
    steps: list[int]
    sources: list[str]
    scored: int
    """Rows whose log-probs were computed with the source model."""
    computed_advantages: int
    """Groups whose GRPO advantages were computed here."""
    unequal_groups: str | None = None
    """A one-line note when one source's groups differ in size (None: all equal)."""


@dataclass
class _Line:
    where: str
    prompt_id: str
    response: str
    reward: float
    step: int
    source: str
    prompt_text: str | None
    finished: bool
    advantage: float | None
    index: int | None
    token_logprobs: list[float] | None
    mean_logprob: float | None
    num_tokens: int | None
    eos_logprob: float | None
    tokenizer_id: str | None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_line(obj: Any, where: str, default_source: str) -> _Line:
    def bad(field_name: str, what: str) -> StoreError:
        return StoreError(f"{where}: field {field_name!r} {what}")

    if not isinstance(obj, dict):
        raise StoreError(f"{where}: expected a JSON object per line")
    for required in ("prompt_id", "response", "reward"):
        if required not in obj:
            raise bad(required, "is missing (required: prompt_id, response, reward)")
    prompt_id = obj["prompt_id"]
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, str | int):
        raise bad("prompt_id", f"must be a string or integer, got {prompt_id!r}")
    if not isinstance(obj["response"], str):
        raise bad("response", "must be a string")
    reward = obj["reward"]
    if isinstance(reward, bool):
        reward = float(reward)
    if not _number(reward) or float(reward) not in (0.0, 1.0):
        raise bad("reward", f"must be 0 or 1 (a verifier reward), got {reward!r}")
    step = obj.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", f"must be an integer >= 0, got {step!r}")
    source = obj.get("source", default_source)
    if not isinstance(source, str) or not source:
        raise bad("source", f"must be a non-empty string, got {source!r}")
    prompt_text = obj.get("prompt")
    if prompt_text is not None and not isinstance(prompt_text, str):
        raise bad("prompt", "must be a string")
    finish = obj.get("finish_reason", "stop")
    if finish not in FINISH_REASONS:
        raise bad("finish_reason", f"must be one of {FINISH_REASONS}, got {finish!r}")
    advantage = obj.get("advantage")
    if advantage is not None and (not _number(advantage) or not math.isfinite(advantage)):
        raise bad("advantage", f"must be a finite number, got {advantage!r}")
    index = obj.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise bad("index", f"must be an integer >= 0, got {index!r}")
    lps = obj.get("token_logprobs")
    if lps is not None and (
        not isinstance(lps, list) or not all(_number(v) and math.isfinite(v) and v <= 1e-6 for v in lps)
    ):
        raise bad("token_logprobs", "must be a list of finite log-probs <= 0 (content tokens, EOS excluded)")
    mean = obj.get("mean_logprob")
    if mean is not None and (not _number(mean) or not math.isfinite(mean) or mean > 1e-6):
        raise bad("mean_logprob", f"must be a finite log-prob <= 0, got {mean!r}")
    num_tokens = obj.get("num_tokens")
    if num_tokens is not None and (
        isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0
    ):
        raise bad("num_tokens", f"must be an integer >= 0, got {num_tokens!r}")
    if lps is not None:
        if num_tokens is not None and num_tokens != len(lps):
            raise bad(
                "num_tokens", f"is {num_tokens} but 'token_logprobs' has {len(lps)} values (EOS excluded)"
            )
        computed = sum(lps) / len(lps) if lps else 0.0
        if mean is not None and abs(computed - mean) > _MEAN_TOLERANCE * max(1.0, abs(mean)):
            raise bad("mean_logprob", f"is {mean} but the mean of 'token_logprobs' is {computed:.6f}")
        mean, num_tokens = computed, len(lps)
    elif mean is not None and num_tokens is None:
        raise bad("num_tokens", "is missing: 'mean_logprob' needs the source token count next to it")
    eos = obj.get("eos_logprob")
    if eos is not None and (not _number(eos) or finish != "stop" or eos > 1e-6):
        raise bad("eos_logprob", "must be a log-prob <= 0, and only on a response with finish_reason 'stop'")
    tok = obj.get("tokenizer_id")
    if tok is not None and not isinstance(tok, str):
        raise bad("tokenizer_id", "must be a string")
    return _Line(
        where=where,
        prompt_id=str(prompt_id),
        response=obj["response"],
        reward=float(reward),
        step=step,
        source=source,
        prompt_text=prompt_text,
        finished=finish == "stop",
        advantage=None if advantage is None else float(advantage),
        index=index,
        token_logprobs=None if lps is None else [float(v) for v in lps],
        mean_logprob=None if mean is None else float(mean),
        num_tokens=num_tokens,
        eos_logprob=None if eos is None else float(eos),
        tokenizer_id=tok,
    )


def import_jsonl(
    path: str | Path,
    store_root: str | Path,
    model_path: str | Path | None = None,
    template: str = "{problem}",
    *,
    source: str | None = None,
    chat_template: bool = False,
    temperature: float = 1.0,
    device: str = "auto",
    dtype: str = "float32",
    source_tokenizer_id: str | None = None,
    adv_eps: float = ADV_EPS,
    adv_std_unbiased: bool = ADV_STD_UNBIASED,
) -> ImportSummary:
    """Import trajectories logged elsewhere (one JSON object per line) as a peer's store.

    Fields per line: ``prompt_id``, ``response``, ``reward`` (0/1) required; optional ``step``
    (default 0), ``source`` (default: ``source`` argument, else the model folder's name, else
    the file's stem), ``prompt`` (the text the template is applied to), ``finish_reason``
    ("stop" default | "length"), ``index``, ``advantage``, ``token_logprobs`` (content tokens,
    terminal EOS excluded) or ``mean_logprob`` + ``num_tokens``, ``eos_logprob``,
    ``tokenizer_id``. Unknown fields are ignored.

    Groups are (step, source, prompt_id). A group without advantages gets GRPO advantages
    (eq. 1, ``adv_eps``, ``adv_std_unbiased``); a group must give all or none. Rows without
    log-probs are scored with the source model at ``model_path`` (its ``template`` or chat
    template, ``Policy.encode_response``, ``Policy.score`` at ``temperature``, mean over content
    tokens with the terminal EOS excluded); without ``model_path`` the import is refused.
    ``source_tokenizer_id`` names the source tokenizer for lines without ``tokenizer_id``
    (default: computed from the model, else "unknown"). Steps already in the store are merged
    with, unless they hold the same source. The whole file is checked before anything is
    scored or written.
    """
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path}: no such file")
    if not path.is_file():
        raise StoreError(f"{path}: is a folder, not a JSONL file; give the trajectories file itself")
    default_source = source or (Path(model_path).name if model_path else path.stem)
    lines: list[_Line] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path} line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise StoreError(
                    f"{where}: not UTF-8 text (byte {error.start} of the line); save the file as UTF-8"
                ) from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as error:
                raise StoreError(f"{where}: not valid JSON ({error.msg})") from None
            lines.append(_parse_line(obj, where, default_source))
    if not lines:
        raise StoreError(f"{path}: no trajectories (the file is empty)")

    groups: dict[tuple[int, str, str], list[_Line]] = defaultdict(list)
    for line in lines:
        groups[(line.step, line.source, line.prompt_id)].append(line)
    for (_, _, prompt_id), members in groups.items():
        _check_group(members, prompt_id)
    unequal_groups = _unequal_group_sizes(groups)

    needs_score = [line for line in lines if line.mean_logprob is None]
    if needs_score and model_path is None:
        first = needs_score[0]
        raise StoreError(
            f"{first.where}: missing field 'token_logprobs' (or 'mean_logprob' + 'num_tokens'), the "
            f"source's log-probs the compatibility score needs ({len(needs_score)} line(s) lack them); "
            "pass --model PATH (the source model) to compute them"
        )
    default_tokenizer = source_tokenizer_id
    if model_path is not None:
        default_tokenizer = _score_lines(
            needs_score, str(model_path), template, chat_template, temperature, device, dtype
        )
        default_tokenizer = source_tokenizer_id or default_tokenizer

    computed = 0
    rows_by_step: dict[int, list[StoredTrajectory]] = defaultdict(list)
    group_counter: dict[tuple[int, str], int] = defaultdict(int)
    for (step, src, prompt_id), members in groups.items():
        advantages = _group_advantages(members, adv_eps, adv_std_unbiased)
        computed += int(members[0].advantage is None)
        indices = [m.index for m in members] if members[0].index is not None else range(len(members))
        group_index = group_counter[(step, src)]
        group_counter[(step, src)] += 1
        prompt_text = next((m.prompt_text for m in members if m.prompt_text is not None), "")
        for line, advantage, index in zip(members, advantages, indices, strict=True):
            assert line.mean_logprob is not None and line.num_tokens is not None
            rows_by_step[step].append(
                StoredTrajectory(
                    prompt_id=prompt_id,
                    step=step,
                    source=src,
                    index=int(index),
                    response=line.response,
                    reward=line.reward,
                    advantage=advantage,
                    mean_logprob=line.mean_logprob,
                    num_tokens=line.num_tokens,
                    num_bytes=len(line.response.encode("utf-8")),
                    finished=line.finished,
                    prompt_text=prompt_text,
                    tokenizer_id=line.tokenizer_id or default_tokenizer or "unknown",
                    n=len(members),
                    group_index=group_index,
                    token_logprobs=None if line.token_logprobs is None else tuple(line.token_logprobs),
                    eos_logprob=line.eos_logprob,
                )
            )

    root = Path(store_root)
    writer = TrajectoryWriter(root)
    existing = TrajectoryStore(root) if (root / MANIFEST).exists() else None
    merged: dict[int, list[StoredTrajectory]] = {}
    for step, rows in sorted(rows_by_step.items()):
        new_sources = {r.source for r in rows}
        if existing is not None and step in existing.steps():
            old = existing.read_step(step)
            clash = new_sources & {r.source for r in old}
            if clash:
                raise StoreError(
                    f"{root}: step {step} already holds trajectories from source(s) {sorted(clash)}; import "
                    "into a new --store folder, or give these another name with --source"
                )
            rows = old + rows
        merged[step] = rows
    for step, rows in merged.items():
        writer.write_step(step, rows)
    return ImportSummary(
        rows=len(lines),
        groups=len(groups),
        steps=sorted(rows_by_step),
        sources=sorted({line.source for line in lines}),
        scored=len(needs_score),
        computed_advantages=computed,
        unequal_groups=unequal_groups,
    )


def _check_group(members: Sequence[_Line], prompt_id: str) -> None:
    """All-or-none advantages and indices, one prompt text: before any expensive scoring."""
    what = f"the group of prompt {prompt_id!r} (step {members[0].step}, source {members[0].source!r})"
    for name in ("advantage", "index"):
        given = [getattr(m, name) is not None for m in members]
        if any(given) and not all(given):
            line = members[given.index(False)]
            raise StoreError(
                f"{line.where}: field {name!r} is missing while other lines of {what} have it; "
                "give it on every line of the group or on none"
            )
    indices = [m.index for m in members]
    if indices[0] is not None and sorted(indices) != list(range(len(members))):  # type: ignore[type-var]
        raise StoreError(
            f"{members[-1].where}: field 'index': {what} has indices {indices}; "
            f"give 0..{len(members) - 1} once each (the group has {len(members)} lines), or leave them out"
        )
    texts = {m.prompt_text for m in members if m.prompt_text is not None}
    if len(texts) > 1:
        raise StoreError(f"{members[-1].where}: field 'prompt' differs between lines of {what}")


def _unequal_group_sizes(groups: Mapping[tuple[int, str, str], Sequence[_Line]]) -> str | None:
    """A note naming a group whose size differs from the rest of its source's, else None.

    The store keeps each group's own n, so such a file imports; a run replaying it refuses, at the
    step that needs it, every group whose size is not its ``rollout.n``.
    """
    sizes: dict[str, dict[int, tuple[str, int, str]]] = defaultdict(dict)
    for (step, src, prompt_id), members in groups.items():
        sizes[src].setdefault(len(members), (prompt_id, step, members[-1].where))
    for src, by_size in sizes.items():
        if len(by_size) > 1:
            common = max(by_size, key=lambda n: sum(len(m) == n for k, m in groups.items() if k[1] == src))
            odd = next(n for n in by_size if n != common)
            prompt_id, step, where = by_size[odd]
            return (
                f"{where}: the group of prompt {prompt_id!r} (step {step}, source {src!r}) has {odd} responses "
                f"while other groups of {src!r} have {common}; a run replaying this store as a peer refuses "
                "groups whose size is not its rollout.n"
            )
    return None


def _group_advantages(members: Sequence[_Line], eps: float, unbiased: bool) -> list[float]:
    if members[0].advantage is not None:
        return [float(m.advantage) for m in members]  # type: ignore[arg-type]
    import torch

    from graftrl.core import grpo_advantages

    rewards = torch.tensor([[m.reward for m in members]], dtype=torch.float32)
    return [float(a) for a in grpo_advantages(rewards, eps, unbiased).view(-1).tolist()]


def _score_lines(
    lines: Sequence[_Line],
    model_path: str,
    template: str,
    chat_template: bool,
    temperature: float,
    device: str,
    dtype: str,
) -> str:
    """Fill mean_logprob / token_logprobs / num_tokens from the source model; returns its tokenizer id."""
    from graftrl.models.policy import Policy
    from graftrl.models.rollout import content_mean_logprob

    try:
        policy = Policy.from_pretrained(
            "source",
            model_path,
            dtype=dtype,
            device=device,
            template=template,
            chat_template=chat_template,
            temperature=temperature,
        )
    except (OSError, ValueError) as error:
        raise StoreError(f"--model {model_path}: cannot load the source model ({error})") from None
    source_id = tokenizer_id(policy.tokenizer)
    if not lines:
        return source_id
    missing_prompt = [line for line in lines if line.prompt_text is None]
    if missing_prompt:
        raise StoreError(
            f"{missing_prompt[0].where}: field 'prompt' is missing; scoring a response with --model needs the "
            "prompt text it answered (the text the --template is applied to)"
        )
    try:
        prompts = policy.encode_prompts([line.prompt_text or "" for line in lines])
    except (KeyError, IndexError, ValueError) as error:
        raise StoreError(
            f"--template {template!r}: cannot format a prompt ({error}); use '{{problem}}'"
        ) from None
    responses = [policy.encode_response(line.response, line.finished) for line in lines]
    scores = policy.score(prompts, responses)
    for line, logprobs in zip(lines, scores, strict=True):
        logprobs = logprobs.float()
        content = logprobs[:-1] if line.finished and len(logprobs) else logprobs
        line.token_logprobs = content.tolist()
        line.num_tokens = len(content)
        line.mean_logprob = content_mean_logprob(logprobs, line.finished)
        line.eos_logprob = float(logprobs[-1]) if line.finished and len(logprobs) else None
    return source_id
