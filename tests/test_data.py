"""Tests for ``graftrl.storage.data``: problem files, prompt formatting and the prompt sampler."""

from __future__ import annotations

import json
import string
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from graftrl.storage.data import PAPER_PROMPT_SUFFIX, DataError, MathProblem, PromptSampler, load_problems

JSONL = FIXTURES / "math_small.jsonl"
# math_small.parquet is math_small.jsonl written with pyarrow (answers as strings);
# test_committed_parquet_matches_jsonl keeps the two in step.
PARQUET = FIXTURES / "math_small.parquet"


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------ loading


def test_load_jsonl_fixture() -> None:
    problems = load_problems(JSONL)
    assert len(problems) == 12
    assert len({p.id for p in problems}) == 12
    by_id = {p.id: p for p in problems}
    assert by_id["add-1"] == MathProblem("add-1", "What is $27 + 30$?", "57")  # number -> str
    assert by_id["neg-1"].answer == "-5"
    assert by_id["frac-1"].answer == r"\frac{3}{4}"
    assert by_id["sqrt-1"].answer == r"2\sqrt{3}"
    assert all(isinstance(p.answer, str) and p.problem for p in problems)


def test_committed_parquet_matches_jsonl() -> None:
    assert load_problems(PARQUET) == load_problems(JSONL)


def test_parquet_with_numeric_answers_and_default_ids(tmp_path: Path) -> None:
    path = tmp_path / "nums.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2-5?"], "answer": [2, -3]}), path)
    assert load_problems(path) == [MathProblem("nums-0", "1+1?", "2"), MathProblem("nums-1", "2-5?", "-3")]


def test_jsonl_and_parquet_built_from_it_agree(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in JSONL.read_text().splitlines()]
    path = tmp_path / "copy.parquet"
    pq.write_table(
        pa.table({"problem": [r["problem"] for r in rows], "answer": [str(r["answer"]) for r in rows]}), path
    )
    from_parquet = load_problems(path)
    from_jsonl = load_problems(JSONL)
    assert [(p.problem, p.answer) for p in from_parquet] == [(p.problem, p.answer) for p in from_jsonl]
    assert [p.id for p in from_parquet] == [f"copy-{i}" for i in range(12)]


def test_default_ids_count_records_not_blank_lines(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "train.jsonl",
        [
            '{"problem": "a", "answer": "1"}',
            "",
            '{"problem": "b", "answer": 2.5, "id": 7}',
            '{"problem": "c", "answer": "3"}',
        ],
    )
    assert [(p.id, p.answer) for p in load_problems(path)] == [
        ("train-0", "1"),
        ("7", "2.5"),
        ("train-2", "3"),
    ]


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "probs.json"
    path.write_text(json.dumps([{"problem": "p", "answer": 1}, {"problem": "q", "answer": "x"}]))
    assert [p.id for p in load_problems(path)] == ["probs-0", "probs-1"]


@pytest.mark.parametrize(
    ("lines", "fragments"),
    [
        (
            ['{"problem": "a", "answer": "1"}', '{"problem": "b"}'],
            ["bad.jsonl line 2", "missing field 'answer'", "each record needs 'problem' and 'answer'"],
        ),
        (['{"answer": "1"}'], ["bad.jsonl line 1", "missing field 'problem'"]),
        (['{"problem": "a", "answer": null}'], ["line 1", "field 'answer' is null"]),
        (['{"problem": "a", "answer": true}'], ["line 1", "'answer' must be a string or a number"]),
        (['{"problem": "", "answer": "1"}'], ["line 1", "'problem' must be a non-empty string"]),
        (['{"problem": "a", "answer": "  "}'], ["line 1", "field 'answer' is empty"]),
        (
            ['{"problem": "a", "answer": "1"}', "", '{"problem": "a" "answer": "1"}'],
            ["bad.jsonl line 3", "invalid JSON", "one JSON object"],
        ),
        (['["a", "1"]'], ["line 1", "expected an object"]),
        (
            [
                '{"id": "x", "problem": "a", "answer": "1"}',
                '{"problem": "b", "answer": "2"}',
                '{"id": "x", "problem": "c", "answer": "3"}',
            ],
            ["duplicate id 'x'", "line 1", "line 3", "ids must be unique"],
        ),
        (["", "   "], ["bad.jsonl", "contains no records"]),
    ],
)
def test_bad_jsonl_errors_name_file_line_and_field(
    tmp_path: Path, lines: list[str], fragments: list[str]
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as info:
        load_problems(path)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_bad_parquet_names_row_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": ["1", None]}), path)
    with pytest.raises(DataError, match=r"bad\.parquet row 1: field 'answer' is null"):
        load_problems(path)
    pq.write_table(pa.table({"problem": ["a"]}), path)
    with pytest.raises(DataError, match=r"row 0: missing field 'answer'"):
        load_problems(path)


def test_unsupported_suffix_and_missing_file(tmp_path: Path) -> None:
    csv = tmp_path / "p.csv"
    csv.write_text("problem,answer\n")
    with pytest.raises(DataError, match=r"p\.csv: unsupported file type '\.csv' \(use \.jsonl"):
        load_problems(csv)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_problems(tmp_path / "nope.jsonl")
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------ prompts


_TEMPLATE_FIELDS = {"problem", "suffix"}


def format_prompt(problem: str, template: str = "{problem}", suffix: str | None = PAPER_PROMPT_SUFFIX) -> str:
    """Fill ``template`` (a ``str.format`` string) with the problem and instruction suffix.

    Used only here (it left ``graftrl.storage.data``): a run formats prompts with
    ``sampling.with_suffix`` and the policy's own template (``Policy.format_prompt``).

    ``{problem}`` is required; ``{suffix}`` places the suffix (empty when ``suffix`` is None).
    A template without ``{suffix}`` gets a non-None suffix appended after one space, so a bare
    ``"{problem}"`` gives the paper's ``"<problem> Let's think step by step ..."``. Literal
    braces in the template must be doubled (``{{``); braces inside the problem need nothing.
    """
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(
            f"prompt template {template!r} is not a valid format string ({exc}); "
            "double literal braces as {{ and }}"
        ) from exc
    unknown = fields - _TEMPLATE_FIELDS
    if unknown or "problem" not in fields:
        raise ValueError(
            f"prompt template {template!r} must contain {{problem}} and may contain {{suffix}}; "
            f"found fields {sorted(fields)} (double literal braces as {{{{ and }}}})"
        )
    text = template.format(problem=problem, suffix=suffix or "")
    if suffix and "suffix" not in fields:
        text = f"{text} {suffix}"
    return text


def test_format_prompt() -> None:
    assert (
        format_prompt("What is 1+1?", "{problem}", PAPER_PROMPT_SUFFIX)
        == f"What is 1+1? {PAPER_PROMPT_SUFFIX}"
    )
    assert format_prompt("Q", "Problem: {problem}\n{suffix}\nAnswer:", "S") == "Problem: Q\nS\nAnswer:"
    assert format_prompt("Q", "{problem}\n{suffix}", None) == "Q\n"
    assert format_prompt("Q", "<q>{problem}</q>", None) == "<q>Q</q>"
    # Braces in the problem need no escaping; literal braces in the template are doubled.
    assert format_prompt(r"Simplify $\frac{a}{b}$", "{{x}} {problem}", None) == r"{x} Simplify $\frac{a}{b}$"


@pytest.mark.parametrize("template", ["no field", "{question}", "{problem} {answer}", "{problem"])
def test_format_prompt_rejects_bad_templates(template: str) -> None:
    with pytest.raises(ValueError, match="template"):
        format_prompt("Q", template, None)


# ------------------------------------------------------------------ sampler


def _problems(n: int) -> list[MathProblem]:
    return [MathProblem(f"p{i}", f"problem {i}", str(i)) for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), batch_size=st.integers(1, 50), seed=st.integers(0, 2**32), step=st.integers(0, 200)
)
def test_batch_is_a_pure_function_of_seed_and_step(n: int, batch_size: int, seed: int, step: int) -> None:
    problems = _problems(n)
    warm = PromptSampler(problems, batch_size, seed)
    for s in range(max(0, step - 3), step):  # a sampler that has served earlier steps ...
        warm.batch(s)
    fresh = PromptSampler(problems, batch_size, seed)  # ... and one resumed at `step`
    assert warm.batch(step) == fresh.batch(step)
    assert len(fresh.batch(step)) == batch_size


def test_each_problem_once_per_epoch_when_batch_divides() -> None:
    problems = _problems(24)
    sampler = PromptSampler(problems, batch_size=6, seed=3)
    assert sampler.steps_per_epoch == 4
    orders = []
    for epoch in range(3):
        seen = [p for step in range(epoch * 4, epoch * 4 + 4) for p in sampler.batch(step)]
        assert Counter(p.id for p in seen) == Counter(p.id for p in problems)
        orders.append([p.id for p in seen])
        assert {sampler.epoch_at(step) for step in range(epoch * 4, epoch * 4 + 4)} == {epoch}
    assert len({tuple(o) for o in orders}) == 3  # a fresh permutation every epoch


@pytest.mark.parametrize(("n", "batch_size"), [(10, 4), (5, 12), (7, 7), (3, 1)])
def test_batches_slice_the_concatenated_epoch_permutations(n: int, batch_size: int) -> None:
    """The documented rule: concatenate epoch permutations, step s takes the s-th slice."""
    sampler = PromptSampler(_problems(n), batch_size, seed=11)
    stream = [p.id for step in range(12) for p in sampler.batch(step)]
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == sorted(f"p{i}" for i in range(n))
    assert sampler.steps_per_epoch == -(-n // batch_size)


def test_seeds_give_different_orders_and_bad_arguments_fail() -> None:
    problems = _problems(50)
    assert PromptSampler(problems, 10, seed=0).batch(0) != PromptSampler(problems, 10, seed=1).batch(0)
    with pytest.raises(ValueError, match="no problems"):
        PromptSampler([], 4)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(problems, 0)
    with pytest.raises(ValueError, match="step"):
        PromptSampler(problems, 4).batch(-1)


def test_optional_family_field(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "fam.jsonl",
        ['{"problem": "1+1?", "answer": 2, "family": "add"}', '{"problem": "3-1?", "answer": 2}'],
    )
    first, second = load_problems(path)
    assert (first.family, second.family) == ("add", None)
    bad = _write_jsonl(tmp_path / "bad.jsonl", ['{"problem": "1+1?", "answer": 2, "family": ["add"]}'])
    with pytest.raises(DataError, match=r"bad\.jsonl line 1: field 'family' must be a string or a number"):
        load_problems(bad)
