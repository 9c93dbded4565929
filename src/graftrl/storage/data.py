"""Prompt datasets: loading problem files, sampling prompt batches.

Files are JSONL, JSON (an array of records, or JSONL under a ``.json`` name) or Parquet, one
record per problem. graftrl's own rows hold ``problem``, ``answer`` and an optional ``id`` and
``family``; verl's Parquet rows, TRL's ``prompt`` column (a string or chat messages) and code
rows with ``tests`` are read as they are (``graftrl.storage.data_formats`` has the rules: how
chat messages fold into one prompt, where the gold answer and the id come from, which fields go
to ``Problem.extra``). Errors name the file, the line (JSONL, 1-based) or record/row (0-based)
and the field, and say how to fix it: a bad record should cost a minute to find, not a failed
run hours later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graftrl.storage.problems import DataError, MathProblem, Problem

__all__ = [
    "PAPER_PROMPT_SUFFIX",
    "DataError",
    "MathProblem",
    "Problem",
    "PromptSampler",
    "load_problems",
    "scan_problems",
]

PAPER_PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


PROBLEM_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The file types ``load_problems`` reads (a local benchmark or data file is named by them)."""


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_problems(path: str | Path, check: Callable[[Problem], str | None] | None = None) -> list[Problem]:
    """Load problems from ``.jsonl``, ``.json`` or ``.parquet``.

    graftrl's rows need a non-empty string ``problem`` and an ``answer`` (a string or a number,
    which is converted with ``str``); ``id`` is optional and defaults to
    ``f"{file_stem}-{index}"`` with the 0-based record index (blank JSONL lines are not
    counted), so the same data gives the same ids in JSONL and Parquet. An optional ``family``
    (string) groups problems for per-family reports. verl's rows, TRL's ``prompt`` rows and code
    rows with ``tests`` are read too, and every other field of a row is kept in
    ``Problem.extra`` (``graftrl.storage.data_formats`` describes the formats).

    ``check`` (a verifier's ``check_problem``) is called on each problem; a message it returns
    becomes a ``DataError`` naming the file and the row. Raises ``DataError`` for a malformed,
    empty or duplicate-id file.
    """
    from graftrl.storage.data_formats import id_field, row_to_problem

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: problem file not found (expected a .jsonl, .json or .parquet file)")
    records = _read_records(path)
    if not records:
        raise DataError(f"{path}: contains no records (each line/row must hold one problem)")

    problems: list[Problem] = []
    first_seen: dict[str, str] = {}
    for index, (where, record) in enumerate(records):
        problem = row_to_problem(path, where, index, record)
        if problem.id in first_seen:
            fix = (
                "ids come from verl's 'extra_info.index' here: make the indices unique, or give each "
                "row an 'id'"
                if id_field(record) == "extra_info.index"
                else "ids must be unique: rename one, or drop the 'id' field to use generated ids"
            )
            raise DataError(
                f"{path}: duplicate id {problem.id!r} at {first_seen[problem.id]} and {where} ({fix})"
            )
        first_seen[problem.id] = where
        message = check(problem) if check is not None else None
        if message:
            raise DataError(f"{path} {where}: {message}")
        problems.append(problem)
    return problems


def scan_problems(
    path: str | Path,
    check: Callable[[Problem], str | None] | None = None,
    limit: int | None = None,
) -> tuple[list[tuple[str, Problem]], list[str]]:
    """``load_problems`` that reports every bad row instead of stopping at the first (``graftrl
    verify --problems``): ``(where, problem)`` for each good row (``where``: ``line N``, ``record
    N`` or ``row N``) and one message per bad row, naming the file, the row and the field (a
    duplicate id, or ``check``'s message, too). A file that cannot be read at all is one message.
    ``limit`` keeps the first that many records."""
    from graftrl.storage.data_formats import row_to_problem

    path = Path(path)
    try:
        if not path.is_file():
            raise DataError(f"{path}: problem file not found (expected a .jsonl, .json or .parquet file)")
        records = _read_records(path)
    except DataError as exc:
        return [], [str(exc)]
    if not records:
        return [], [f"{path}: contains no records (each line/row must hold one problem)"]
    good: list[tuple[str, Problem]] = []
    bad: list[str] = []
    first_seen: dict[str, str] = {}
    for index, (where, record) in enumerate(records[:limit] if limit else records):
        try:
            problem = row_to_problem(path, where, index, record)
        except DataError as exc:
            bad.append(str(exc))
            continue
        if problem.id in first_seen:
            bad.append(
                f"{path} {where}: duplicate id {problem.id!r} (first at {first_seen[problem.id]}); ids must be unique"
            )
            continue
        first_seen[problem.id] = where
        message = check(problem) if check is not None else None
        if message:
            bad.append(f"{path} {where}: {message}")
            continue
        good.append((where, problem))
    return good, bad


def _read_records(path: Path) -> list[tuple[str, Any]]:
    """``(location, record)`` pairs of a JSONL, JSON or Parquet file, by its suffix."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_json_records(path)
    if suffix == ".parquet":
        return _read_parquet_records(path)
    raise DataError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl, .json or .parquet)")


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


def _to_problem(path: Path, where: str, index: int, record: Any) -> Problem:
    """One record as a ``Problem`` (``graftrl.storage.data_formats.row_to_problem``)."""
    from graftrl.storage.data_formats import row_to_problem

    return row_to_problem(path, where, index, record)


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
