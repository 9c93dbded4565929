"""The trajectory store's row format: Parquet schema version 1, one row per sampled response.

``StoredTrajectory`` is a row (the tokenizer-neutral record plus what it takes to replay it);
``table_from_rows`` / ``rows_from_table`` convert between rows and Arrow tables, and
``validate_table`` checks a table read from a file another party may have written, naming the
file, row and field at the first problem. The schema version is written in each file's Parquet
key-value metadata (``META_VERSION``); a reader refuses any other version. Nothing is pickled.
The folder layout, manifest and atomic writes are ``graftrl.storage.store``'s.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa

from graftrl.errors import UserError
from graftrl.storage.records import TrajectoryRecord

SCHEMA_VERSION = 1
META_VERSION = b"graftrl.schema_version"
META_STEP = b"graftrl.step"
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

MEAN_TOLERANCE = 1e-3
"""|mean(token_logprobs) - mean_logprob| allowed (float32 storage, float32 means)."""


class StoreError(UserError):
    """A trajectory store problem, naming the file and field, and what to do about it."""


@dataclass(frozen=True)
class StoredTrajectory(TrajectoryRecord):
    """One stored row: the tokenizer-neutral record plus what it needs to be replayed.

    The record's fields come first (``to_record`` returns the record alone); the rest are the
    source's prompt, tokenizer, group and per-token log-probs.
    """

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

    @classmethod
    def from_record(cls, record: TrajectoryRecord, **replay: Any) -> StoredTrajectory:
        """The stored row of ``record``; ``replay`` gives the fields after the record's."""
        return cls(**_record_values(record), **replay)

    def to_record(self) -> TrajectoryRecord:
        """The record the trainer exchanges between models (without the replay fields)."""
        return TrajectoryRecord(**_record_values(self))


def _record_values(record: TrajectoryRecord) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(TrajectoryRecord)}


_COLUMN_OF_FIELD = {"finished": "finish_reason"}
"""The one row field stored under another name and form (True <-> "stop", False <-> "length")."""
# SCHEMA spells out the file format (column order, float32 log-probs); it must name exactly the
# row's fields, so a field added to the record cannot be silently dropped on write.
if sorted(_COLUMN_OF_FIELD.get(f.name, f.name) for f in fields(StoredTrajectory)) != sorted(SCHEMA.names):
    raise RuntimeError("graftrl.storage.store_rows: SCHEMA's columns differ from StoredTrajectory's fields")


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


# ------------------------------------------------------------------------------------------
# Table <-> rows, and validation
# ------------------------------------------------------------------------------------------


def table_from_rows(rows: Sequence[StoredTrajectory], step: int) -> pa.Table:
    columns = {name: [getattr(row, name) for row in rows] for name in SCHEMA.names}
    columns["token_logprobs"] = [None if lps is None else list(lps) for lps in columns["token_logprobs"]]
    metadata = {META_VERSION: str(SCHEMA_VERSION).encode(), META_STEP: str(step).encode()}
    try:
        return pa.Table.from_pydict(columns, schema=SCHEMA.with_metadata(metadata))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise StoreError(f"step {step}: rows do not fit the store schema: {error}") from None


def rows_from_table(table: pa.Table, token_logprobs: bool = True) -> list[StoredTrajectory]:
    data = table.select([n for n in SCHEMA.names if token_logprobs or n != "token_logprobs"]).to_pydict()
    stopped = [reason == "stop" for reason in data.pop("finish_reason")]
    per_token = data.pop("token_logprobs", [None] * table.num_rows)
    return [
        StoredTrajectory(
            **{name: column[i] for name, column in data.items()},
            finished=stopped[i],
            token_logprobs=None if per_token[i] is None else tuple(per_token[i]),
        )
        for i in range(table.num_rows)
    ]


def _describe_row(data: Mapping[str, Sequence[Any]], i: int) -> str:
    keys = ", ".join(f"{key} {data[key][i]!r}" for key in ("source", "prompt_id", "index") if key in data)
    return f"row {i} ({keys})"


def validate_table(table: pa.Table, where: str, step: int, fix: str) -> None:
    """Raise StoreError naming ``where`` and the field at the first problem found."""

    def fail(message: str) -> None:
        raise StoreError(f"{where}: {message}; {fix}")

    metadata = table.schema.metadata or {}
    version = metadata.get(META_VERSION)
    if version is None:
        fail(
            f"no schema version in the Parquet metadata (key {META_VERSION.decode()!r}): not a graftrl store file"
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
    check("reward", np.isinf(reward), "reward must be a finite number (a verifier's reward)")
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
        off = present & (np.abs(means - mean) > MEAN_TOLERANCE * np.maximum(1.0, np.abs(mean)))
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
