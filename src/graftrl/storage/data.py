"""Math prompt datasets: loading problem files, sampling prompt batches.

Files are JSONL, JSON (an array of records, or JSONL under a ``.json`` name) or Parquet, one
record per problem with ``problem``, ``answer`` and an optional ``id``. Errors name the file,
the line (JSONL, 1-based) or record/row (0-based) and the field, and say how to fix it: a bad
record should cost a minute to find, not a failed run hours later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from graftrl.errors import UserError

__all__ = [
    "PAPER_PROMPT_SUFFIX",
    "DataError",
    "MathProblem",
    "Problem",
    "PromptSampler",
    "load_problems",
]

PAPER_PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


PROBLEM_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The file types ``load_problems`` reads (a local benchmark or data file is named by them)."""


class DataError(UserError):
    """A problem file is malformed; the message names the file, record and field to fix."""


@dataclass(frozen=True)
class Problem:
    """One prompt with what its verifier needs: a gold answer (math, match), tests (code), or any
    other fields of the row (``extra``: a user's scorer gets them all)."""

    id: str
    problem: str
    """The prompt text (the user turn; a data file's chat messages are folded into it)."""
    answer: str = ""
    """Gold answer as a string (math_verify parses strings); empty for rows checked by tests."""
    family: str | None = None
    """Optional sub-skill or subject (a record's ``family`` field): held-out pass@1 and the
    training reward are also reported per family."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The row's other fields as read (``tests``, ``entry_point``, verl's ``data_source`` and
    ``extra_info``, ...), passed through to the verifier; not part of equality or hashing."""


MathProblem = Problem
"""The name of ``Problem`` before verifiers other than math existed (kept for a release)."""


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_problems(path: str | Path) -> list[MathProblem]:
    """Load problems from ``.jsonl``, ``.json`` or ``.parquet``.

    Each record needs a non-empty string ``problem`` and an ``answer`` (a string or a number,
    which is converted with ``str``); ``id`` is optional and defaults to
    ``f"{file_stem}-{index}"`` with the 0-based record index (blank JSONL lines are not
    counted), so the same data gives the same ids in JSONL and Parquet. An optional ``family``
    (string) groups problems for per-family reports. Other fields are ignored.
    Raises ``DataError`` for a malformed, empty or duplicate-id file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: problem file not found (expected a .jsonl, .json or .parquet file)")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records = _read_json_records(path)
    elif suffix == ".parquet":
        records = _read_parquet_records(path)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl, .json or .parquet)")
    if not records:
        raise DataError(f"{path}: contains no records (each line/row must hold one problem)")

    problems: list[MathProblem] = []
    first_seen: dict[str, str] = {}
    for index, (where, record) in enumerate(records):
        problem = _to_problem(path, where, index, record)
        if problem.id in first_seen:
            raise DataError(
                f"{path}: duplicate id {problem.id!r} at {first_seen[problem.id]} and {where} "
                "(ids must be unique: rename one, or drop the 'id' field to use generated ids)"
            )
        first_seen[problem.id] = where
        problems.append(problem)
    return problems


def _read_json_records(path: Path) -> list[tuple[str, Any]]:
    """Return ``(location, record)`` pairs; location is ``line N`` (1-based) or ``record N``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc}); re-save the file as UTF-8") from exc
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):  # one array of records
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path} line {exc.lineno}: invalid JSON ({exc.msg}); fix the file or write it as JSONL"
            ) from exc
        return [(f"record {i}", rec) for i, rec in enumerate(data)]
    records: list[tuple[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path} line {lineno}: invalid JSON ({exc.msg} at column {exc.colno}); "
                "each line must be one JSON object"
            ) from exc
    return records


def _read_parquet_records(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read as Parquet ({exc})") from exc
    return [(f"row {i}", rec) for i, rec in enumerate(table.to_pylist())]


def _to_problem(path: Path, where: str, index: int, record: Any) -> MathProblem:
    loc = f"{path} {where}"
    if not isinstance(record, dict):
        raise DataError(f"{loc}: expected an object with 'problem' and 'answer', got {type(record).__name__}")
    for name in ("problem", "answer"):
        if record.get(name) is None:
            raise DataError(
                f"{loc}: missing field {name!r} (each record needs 'problem' and 'answer')"
                if name not in record
                else f"{loc}: field {name!r} is null (give it a value or remove the record)"
            )
    problem = record["problem"]
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{loc}: field 'problem' must be a non-empty string, got {problem!r}")
    answer = _scalar_to_str(loc, "answer", record["answer"])
    raw_id = record.get("id")
    pid = f"{path.stem}-{index}" if raw_id is None else _scalar_to_str(loc, "id", raw_id)
    raw_family = record.get("family")
    family = None if raw_family is None else _scalar_to_str(loc, "family", raw_family)
    return MathProblem(id=pid, problem=problem, answer=answer, family=family)


def _scalar_to_str(loc: str, name: str, value: Any) -> str:
    """Accept strings and numbers (JSON/Parquet often store answers and ids as numbers)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{loc}: field {name!r} must be a string or a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{loc}: field {name!r} is {value!r}; write the answer as a string instead")
    text = str(value).strip()
    if not text:
        raise DataError(f"{loc}: field {name!r} is empty")
    return text


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


class PromptSampler:
    """Deterministic, resumable batches of problems: ``batch(step)`` depends only on (seed, step).

    Rule: each epoch is a fresh permutation of the problems drawn from a numpy Generator seeded
    with ``(seed, epoch)``; the permutations are concatenated into one endless stream and step
    ``s`` takes items ``[s * batch_size, (s + 1) * batch_size)``. So every problem appears
    exactly once per epoch of the stream; when ``batch_size`` does not divide the number of
    problems a batch can span the end of one epoch and the start of the next (and may then hold
    a problem twice), and ``batch_size > len(problems)`` simply wraps over several epochs.
    Resuming needs only the step number; no sampler state is saved. (Streams are stable for a
    given numpy version: numpy does not promise identical permutations across releases.)
    """

    def __init__(self, problems: Sequence[MathProblem], batch_size: int, seed: int = 0) -> None:
        if not problems:
            raise ValueError("PromptSampler: no problems given (load a non-empty dataset first)")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"PromptSampler: seed must be >= 0, got {seed}")
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = int(seed)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> int:
        """Steps to draw one epoch's worth of problems, rounded up (``ceil(n / batch_size)``)."""
        return math.ceil(len(self.problems) / self.batch_size)

    def epoch_at(self, step: int) -> int:
        """Epoch that the first problem of ``batch(step)`` belongs to (for logging)."""
        return step * self.batch_size // len(self.problems)

    def batch(self, step: int) -> list[MathProblem]:
        """Problems for training step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"PromptSampler.batch: step must be >= 0, got {step}")
        n = len(self.problems)
        start = step * self.batch_size
        out: list[MathProblem] = []
        while len(out) < self.batch_size:
            epoch, offset = divmod(start + len(out), n)
            take = min(n - offset, self.batch_size - len(out))
            out.extend(self.problems[i] for i in self._permutation(epoch)[offset : offset + take])
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 4:  # consecutive steps touch at most a few epochs
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch])
            perm = self._perms[epoch] = rng.permutation(len(self.problems))
        return perm
