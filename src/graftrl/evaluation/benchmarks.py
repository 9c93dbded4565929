"""Evaluation benchmarks: local problem files, Hugging Face datasets, and the paper's five by name.

A benchmark *spec* is one of

- ``NAME=PATH``: a local JSONL / JSON / Parquet file (``problem``, ``answer``, optional ``id``)
  reported under NAME, e.g. ``MATH500=data/eval/math500.jsonl``;
- ``PATH``: a local file, reported under its file stem;
- a built-in name (case and punctuation are ignored: ``MATH500``, ``math-500``, ``aime24``,
  ``Minerva``, ...), loaded from its usual Hugging Face dataset;
- ``ORG/DATASET`` or ``ORG/DATASET:SPLIT`` (optionally ``NAME=ORG/DATASET[:SPLIT]``): any Hugging
  Face dataset with ``problem`` (or ``question``) and ``answer`` fields.

Hub datasets need the optional ``datasets`` package (``pip install -e '.[hub]'``), imported
only when a hub benchmark is asked for; local files never need it. Offline (``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE`` set, or a failed download) a hub benchmark raises ``BenchmarkError``
saying how to pass a local file instead. ``python -m graftrl.evaluation.benchmarks export DIR`` writes the
built-in benchmarks to ``DIR/<NAME>.jsonl`` on an online machine, for use offline.

Built-in datasets (the paper's evaluation set, section 5.1):

==========  ============================  =====  ================  =========
name        dataset                       split  fields            problems
==========  ============================  =====  ================  =========
MATH500     HuggingFaceH4/MATH-500        test   problem / answer  500
AIME2024    HuggingFaceH4/aime_2024       train  problem / answer  30
AIME2025    math-ai/aime25                test   problem / answer  30
AMC23       math-ai/amc23                 test   question / answer 40
Minerva     math-ai/minervamath           test   question / answer 272
==========  ============================  =====  ================  =========
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.storage.data import PROBLEM_SUFFIXES, DataError, MathProblem, load_problems

__all__ = [
    "BUILTIN_BENCHMARKS",
    "PAPER_BENCHMARKS",
    "Benchmark",
    "BenchmarkError",
    "HubDataset",
    "is_offline",
    "load_benchmark",
    "load_benchmarks",
    "parse_benchmark_spec",
    "write_problems",
]

_TRUTHY = {"1", "true", "yes", "on"}


class BenchmarkError(DataError):
    """A benchmark cannot be resolved or loaded; the message says what to pass instead."""


@dataclass(frozen=True)
class HubDataset:
    """Where a benchmark lives on the Hugging Face hub and which fields hold what."""

    dataset: str
    split: str | None = None
    """None: the first of ``test``, ``train``, ``validation`` that exists."""
    config: str | None = None
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    size: int | None = None
    """Expected number of problems (documentation only)."""


BUILTIN_BENCHMARKS: dict[str, HubDataset] = {
    "MATH500": HubDataset("HuggingFaceH4/MATH-500", "test", id_field="unique_id", size=500),
    "AIME2024": HubDataset("HuggingFaceH4/aime_2024", "train", id_field="id", size=30),
    "AIME2025": HubDataset("math-ai/aime25", "test", id_field="id", size=30),
    "AMC23": HubDataset("math-ai/amc23", "test", problem_field="question", id_field="id", size=40),
    "Minerva": HubDataset("math-ai/minervamath", "test", problem_field="question", size=272),
}
"""The paper's five evaluation benchmarks, by their usual Hugging Face datasets."""

PAPER_BENCHMARKS: tuple[str, ...] = tuple(BUILTIN_BENCHMARKS)
"""Default `graftrl eval` set, in the paper's column order."""

_ALIASES = {
    "math500": "MATH500",
    "math": "MATH500",
    "aime2024": "AIME2024",
    "aime24": "AIME2024",
    "aime2025": "AIME2025",
    "aime25": "AIME2025",
    "amc23": "AMC23",
    "amc2023": "AMC23",
    "minerva": "Minerva",
    "minervamath": "Minerva",
}


def _builtin_name(name: str) -> str | None:
    return _ALIASES.get(re.sub(r"[^a-z0-9]", "", name.lower()))


@dataclass(frozen=True)
class BenchmarkSource:
    """A parsed spec: a local file or a hub dataset, and the name it is reported under."""

    name: str
    path: Path | None = None
    hub: HubDataset | None = None

    def describe(self) -> str:
        if self.path is not None:
            return str(self.path)
        assert self.hub is not None
        split = f":{self.hub.split}" if self.hub.split else ""
        return f"hf://{self.hub.dataset}{split}"


@dataclass(frozen=True)
class Benchmark:
    name: str
    problems: list[MathProblem]
    source: str
    """Where the problems came from (a path or ``hf://dataset:split``)."""


def _looks_local(text: str) -> bool:
    return text.lower().endswith(PROBLEM_SUFFIXES) or Path(text).is_file()


def _hub_from_text(text: str) -> HubDataset | None:
    """``org/dataset`` or ``org/dataset:split`` -> HubDataset with auto-detected fields."""
    match = re.fullmatch(r"([\w.\-]+/[\w.\-]+)(?::([\w.\-]+))?", text)
    if match is None:
        return None
    return HubDataset(match.group(1), match.group(2))


def parse_benchmark_spec(spec: str) -> BenchmarkSource:
    """Resolve a spec (see the module docstring) without loading anything."""
    spec = spec.strip()
    if not spec:
        raise BenchmarkError("empty benchmark spec; pass NAME=PATH, a file path or a built-in name")
    name, sep, value = spec.partition("=")
    if sep:
        name, value = name.strip(), value.strip()
        if not name or not value:
            raise BenchmarkError(f"benchmark {spec!r}: expected NAME=PATH, e.g. MATH500=data/math500.jsonl")
        if _looks_local(value):
            return BenchmarkSource(name, path=Path(value))
        builtin = _builtin_name(value)
        if builtin is not None:
            return BenchmarkSource(name, hub=BUILTIN_BENCHMARKS[builtin])
        hub = _hub_from_text(value)
        if hub is None:
            raise BenchmarkError(
                f"benchmark {spec!r}: {value!r} is neither a .jsonl/.json/.parquet file nor a "
                "Hugging Face dataset id (ORG/NAME)"
            )
        return BenchmarkSource(name, hub=hub)
    if _looks_local(spec):
        return BenchmarkSource(Path(spec).stem, path=Path(spec))
    builtin = _builtin_name(spec)
    if builtin is not None:
        return BenchmarkSource(builtin, hub=BUILTIN_BENCHMARKS[builtin])
    hub = _hub_from_text(spec)
    if hub is not None:
        return BenchmarkSource(hub.dataset.rsplit("/", 1)[1], hub=hub)
    raise BenchmarkError(
        f"unknown benchmark {spec!r}: pass NAME=PATH (a JSONL/Parquet file with problem and answer "
        f"fields), a file path, a Hugging Face dataset id (ORG/NAME[:SPLIT]) or one of the built-in "
        f"names {', '.join(BUILTIN_BENCHMARKS)}"
    )


def is_offline() -> bool:
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value."""
    return any(
        os.environ.get(var, "").strip().lower() in _TRUTHY
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _local_hint(name: str) -> str:
    return (
        f"pass a local file instead: --benchmark {name}=path/to/{name.lower()}.jsonl (JSONL or Parquet "
        "with 'problem' and 'answer' fields; on an online machine `python -m graftrl.evaluation.benchmarks export "
        "DIR` writes the built-in benchmarks as such files)"
    )


def load_benchmark(
    spec: str | BenchmarkSource,
    max_problems: int | None = None,
    check: Callable[[MathProblem], str | None] | None = None,
) -> Benchmark:
    """Load a benchmark from a spec; ``max_problems`` keeps the first that many problems.
    ``check`` (the verifier's ``check_problem``): a row it cannot use is refused in one line
    naming the file (or dataset), the row and the field."""
    source = parse_benchmark_spec(spec) if isinstance(spec, str) else spec
    if source.path is not None:
        if not source.path.is_file():
            raise BenchmarkError(
                f"benchmark {source.name!r}: file {source.path} not found (expected a .jsonl, .json "
                "or .parquet file with 'problem' and 'answer' fields)"
            )
        problems = load_problems(source.path, check=check)
    else:
        assert source.hub is not None
        problems = _load_hub(source.name, source.hub, check)
    if max_problems is not None:
        problems = problems[:max_problems]
    return Benchmark(source.name, problems, source.describe())


def load_benchmarks(
    specs: Iterable[str],
    max_problems: int | None = None,
    check: Callable[[MathProblem], str | None] | None = None,
) -> list[Benchmark]:
    """Load several benchmarks; names must be unique (they are the report's columns). ``check``:
    as ``load_benchmark``'s."""
    benchmarks = [load_benchmark(spec, max_problems, check) for spec in specs]
    names = [b.name for b in benchmarks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise BenchmarkError(
            f"benchmark names must be unique, got {duplicates} more than once; name them with NAME=PATH"
        )
    return benchmarks


def _load_hub(
    name: str, hub: HubDataset, check: Callable[[MathProblem], str | None] | None = None
) -> list[MathProblem]:
    where = f"benchmark {name!r} (Hugging Face dataset {hub.dataset})"
    if is_offline():
        raise BenchmarkError(
            f"{where} needs the Hugging Face hub, but this machine is offline (HF_HUB_OFFLINE or "
            f"HF_DATASETS_OFFLINE is set); {_local_hint(name)}"
        )
    try:
        import datasets
    except ImportError:
        raise BenchmarkError(
            f"{where} needs the optional `datasets` package (pip install -e '.[hub]'), or {_local_hint(name)}"
        ) from None
    try:
        rows = _hub_rows(datasets, hub)
    except BenchmarkError:
        raise
    except Exception as error:  # network, auth, missing split: all end the same way
        raise BenchmarkError(
            f"{where} could not be loaded ({type(error).__name__}: {error}); if the machine is "
            f"offline, {_local_hint(name)}"
        ) from None
    return _rows_to_problems(name, hub, rows, check)


def _hub_rows(datasets: Any, hub: HubDataset) -> list[dict[str, Any]]:
    if hub.split is not None:
        return list(datasets.load_dataset(hub.dataset, hub.config, split=hub.split))
    loaded = datasets.load_dataset(hub.dataset, hub.config)
    for split in ("test", "train", "validation"):
        if split in loaded:
            return list(loaded[split])
    raise BenchmarkError(
        f"Hugging Face dataset {hub.dataset} has splits {list(loaded)}; name one as {hub.dataset}:SPLIT"
    )


def _pick(record: dict[str, Any], preferred: str, fallbacks: Sequence[str]) -> str | None:
    for field in (preferred, *fallbacks):
        if field in record:
            return field
    return None


def _answer_text(value: Any) -> Any:
    # Some hub copies store integer answers as floats (27.0); write them as integers.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and len(value) == 1:
        return _answer_text(value[0])
    return value


def _rows_to_problems(
    name: str,
    hub: HubDataset,
    rows: list[dict[str, Any]],
    check: Callable[[MathProblem], str | None] | None = None,
) -> list[MathProblem]:
    from graftrl.storage.data import _to_problem

    if not rows:
        raise BenchmarkError(f"benchmark {name!r}: Hugging Face dataset {hub.dataset} has no rows")
    problem_field = _pick(rows[0], hub.problem_field, ("problem", "question", "Problem", "Question"))
    answer_field = _pick(rows[0], hub.answer_field, ("answer", "final_answer", "Answer"))
    if problem_field is None or answer_field is None:
        raise BenchmarkError(
            f"benchmark {name!r}: Hugging Face dataset {hub.dataset} has fields {sorted(rows[0])}; "
            "expected a problem/question field and an answer field"
        )
    id_field = hub.id_field if hub.id_field and hub.id_field in rows[0] else None
    origin = Path(name)
    problems = []
    for index, row in enumerate(rows):
        record = {"problem": row.get(problem_field), "answer": _answer_text(row.get(answer_field))}
        record["id"] = f"{name}-{row[id_field]}" if id_field and row.get(id_field) is not None else None
        if record["id"] is None:
            record["id"] = f"{name}-{index}"
        problem = _to_problem(origin, f"row {index}", index, record)
        if check is not None and (message := check(problem)):
            raise DataError(f"benchmark {name!r} (Hugging Face dataset {hub.dataset}) row {index}: {message}")
        problems.append(problem)
    return problems


def write_problems(problems: Iterable[MathProblem], path: str | Path) -> Path:
    """Write problems as JSONL (``id``, ``problem``, ``answer``), the format ``load_problems`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for p in problems:
            handle.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n")
    return path


def _main(argv: Sequence[str]) -> int:  # pragma: no cover - needs the hub
    if len(argv) < 2 or argv[0] != "export":
        print("usage: python -m graftrl.evaluation.benchmarks export DIR [NAME ...]", file=sys.stderr)
        return 2
    out = Path(argv[1])
    for spec in argv[2:] or PAPER_BENCHMARKS:
        benchmark = load_benchmark(spec)
        path = write_problems(benchmark.problems, out / f"{benchmark.name}.jsonl")
        print(f"{benchmark.name}: {len(benchmark.problems)} problems -> {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main(sys.argv[1:]))
