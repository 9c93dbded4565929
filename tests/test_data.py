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

from graftrl.storage.data import (
    PAPER_PROMPT_SUFFIX,
    DataError,
    MathProblem,
    Problem,
    PromptSampler,
    load_problems,
)
from graftrl.storage.data_formats import fold_messages, normalise_tests

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


# ------------------------------------------------------------------ other formats


def _write_json_lines(path: Path, rows: list[object]) -> Path:
    return _write_jsonl(path, [json.dumps(row) for row in rows])


def _one_line_error(path: Path, where: str, field: str) -> str:
    with pytest.raises(DataError) as info:
        load_problems(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path} {where}: "), message
    assert f"field {field!r}" in message, message
    return message


def test_math_rows_read_as_before_with_nothing_extra() -> None:
    rows = [json.loads(line) for line in JSONL.read_text().splitlines()]
    problems = load_problems(JSONL)
    assert [(p.id, p.problem, p.answer, p.family, dict(p.extra)) for p in problems] == [
        (r["id"], r["problem"], str(r["answer"]), None, {}) for r in rows
    ]
    assert all(dict(p.extra) == {} for p in load_problems(PARQUET))


def test_other_fields_of_a_row_are_kept_in_extra(tmp_path: Path) -> None:
    row = {"problem": "1+1?", "answer": 2, "solution": "1+1=2", "level": 3, "tags": ["add"], "meta": {"a": 1}}
    (problem,) = load_problems(_write_json_lines(tmp_path / "x.jsonl", [row]))
    assert problem == Problem("x-0", "1+1?", "2")  # extra is not part of equality
    assert problem.extra == {"solution": "1+1=2", "level": 3, "tags": ["add"], "meta": {"a": 1}}


def _verl_row(index: int, content: str, ground_truth: object, system: str | None = None) -> dict:
    prompt = [{"role": "user", "content": content}]
    if system is not None:
        prompt.insert(0, {"role": "system", "content": system})
    return {
        "data_source": "openai/gsm8k",
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train", "index": index},
    }


def _table(rows: list[dict]) -> pa.Table:
    """Rows as one table; fields a row lacks are null (``from_pylist`` takes the first row's)."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    return pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows])


def test_verl_parquet_math_and_code_rows(tmp_path: Path) -> None:
    """verl's rows as its docs show them, written with pyarrow: one file holds math rows and a
    code row, so Parquet fills the fields a row lacks with null."""
    rows = [
        _verl_row(0, "Natalia sold 48 clips ... How many?", "72"),
        _verl_row(1, "What is 6 * 7?", 42, system="You are a careful solver."),
        {
            **_verl_row(2, "Write add(a, b).", None),
            "data_source": "mbpp",
            "ability": "code",
            "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
            "entry_point": "add",
        },
    ]
    rows[1]["prompt"][0]["content"] = "You are a careful solver."
    rows[1]["reward_model"]["ground_truth"] = "42"  # one Parquet column holds one type
    path = tmp_path / "verl.parquet"
    pq.write_table(_table(rows), path)

    first, second, code = load_problems(path)
    assert (first.id, first.problem, first.answer) == ("0", "Natalia sold 48 clips ... How many?", "72")
    assert second.problem == "You are a careful solver.\n\nWhat is 6 * 7?"
    assert (second.id, second.answer, second.family) == ("1", "42", None)
    assert first.extra == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "ground_truth": "72",
        "extra_info": {"split": "train", "index": 0},
    }
    assert (code.id, code.problem, code.answer) == ("2", "Write add(a, b).", "")
    assert code.extra["tests"] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    assert code.extra["entry_point"] == "add"
    assert code.extra["data_source"] == "mbpp"
    assert "ground_truth" not in code.extra and "prompt" not in code.extra


def test_verl_code_ground_truth_that_is_not_an_answer_is_kept_in_extra(tmp_path: Path) -> None:
    truth = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    row = {**_verl_row(7, "Read a and b, print a+b.", truth), "ability": "code"}
    del row["extra_info"]
    path = tmp_path / "code.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    (problem,) = load_problems(path)
    assert (problem.id, problem.answer) == ("code-0", "")  # no extra_info.index: generated id
    assert problem.extra["ground_truth"] == truth
    assert problem.extra["ability"] == "code"


def test_verl_rows_with_repeated_indices_say_where_ids_come_from(tmp_path: Path) -> None:
    path = _write_json_lines(tmp_path / "v.jsonl", [_verl_row(0, "a", "1"), _verl_row(0, "b", "2")])
    with pytest.raises(
        DataError, match=r"duplicate id '0' at line 1 and line 2 \(ids come from verl's 'extra_info\.index'"
    ):
        load_problems(path)
    rows = [{**_verl_row(0, "a", "1"), "id": "a"}, {**_verl_row(0, "b", "2"), "id": "b"}]
    assert [p.id for p in load_problems(_write_json_lines(tmp_path / "w.jsonl", rows))] == ["a", "b"]


def test_trl_prompt_rows(tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "solution": "4"},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}],
            "answer": 6,
            "solution": "3+3 is 6",
        },
        {"prompt": "Standard format: 5+5?", "solution": "10"},
        {"prompt": [{"role": "system", "content": "  "}, {"role": "user", "content": "1+0?"}], "answer": "1"},
    ]
    problems = load_problems(_write_json_lines(tmp_path / "trl.jsonl", rows))
    assert [(p.id, p.problem, p.answer) for p in problems] == [
        ("trl-0", "What is 2+2?", "4"),
        ("trl-1", "Be brief.\n\n3+3?", "6"),  # 'answer' before 'solution'
        ("trl-2", "Standard format: 5+5?", "10"),
        ("trl-3", "1+0?", "1"),  # a blank system message is dropped
    ]
    assert problems[0].extra == {"solution": "4"}
    assert problems[1].extra == {"solution": "3+3 is 6"}


def test_a_problem_field_wins_over_prompt_and_prompt_is_then_kept(tmp_path: Path) -> None:
    row = {"problem": "raw", "prompt": [{"role": "user", "content": "templated"}], "answer": "1"}
    (problem,) = load_problems(_write_json_lines(tmp_path / "p.jsonl", [row]))
    assert problem.problem == "raw"
    assert problem.extra == {"prompt": [{"role": "user", "content": "templated"}]}


def test_code_rows_normalise_their_tests(tmp_path: Path) -> None:
    pairs = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]
    rows = [
        {
            "problem": "HumanEval style",
            "tests": ["assert f(1) == 2"],
            "entry_point": "f",
            "canonical_solution": "x",
        },
        {"problem": "APPS", "tests": {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}},
        {"problem": "CodeContests", "tests": {"input": ["1 2\n", "5 5\n"], "output": ["3\n", "10\n"]}},
        {"problem": "pairs", "tests": pairs, "answer": ""},
        {"problem": "JSON string", "tests": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
        {"problem": "MBPP", "tests": ["assert g() == 1"], "setup": "import os", "imports": ["import re"]},
    ]
    problems = load_problems(_write_json_lines(tmp_path / "code.jsonl", rows))
    assert all(p.answer == "" for p in problems)
    assert problems[0].extra == {"tests": ["assert f(1) == 2"], "entry_point": "f", "canonical_solution": "x"}
    assert problems[1].extra["tests"] == problems[2].extra["tests"] == problems[3].extra["tests"] == pairs
    assert problems[4].extra["tests"] == pairs[:1]
    assert problems[5].extra == {"tests": ["assert g() == 1"], "setup": "import os", "imports": ["import re"]}
    # The same rows from Parquet (the dict-valued tests as JSON strings, as hub copies store them).
    path = tmp_path / "apps.parquet"
    apps = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    pq.write_table(pa.table({"problem": ["APPS"], "tests": [apps], "id": [17]}), path)
    (problem,) = load_problems(path)
    assert (problem.id, problem.answer, problem.extra["tests"]) == ("17", "", pairs)


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
            ],
            "roles ['user', 'assistant', 'user']; graftrl takes one user message",
        ),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles ['user', 'user']"),
        ([{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], "roles ['user', 'system']"),
        ([{"role": "assistant", "content": "a"}], "roles ['assistant']"),
        ([{"role": "user", "content": [{"type": "text", "text": "q"}]}], "message 0 (user) has list content"),
        ([{"content": "q"}], "message 0 is not a chat message"),
        (["q"], "message 0 is not a chat message"),
        ([], "non-empty list of chat messages"),
        ({"role": "user", "content": "q"}, "non-empty list of chat messages"),
        ([{"role": "user", "content": "  "}], "empty user message"),
    ],
)
def test_bad_message_shapes_are_one_line_naming_file_row_and_field(
    tmp_path: Path, prompt: object, fragment: str
) -> None:
    path = _write_json_lines(
        tmp_path / "chat.jsonl",
        [{"prompt": [{"role": "user", "content": "ok"}], "answer": "1"}, {"prompt": prompt, "answer": "1"}],
    )
    assert fragment in _one_line_error(path, "line 2", "prompt")


def test_bad_prompt_in_parquet_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "chat.parquet"
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    pq.write_table(_table([_verl_row(0, "fine", "1"), {**_verl_row(1, "", "2"), "prompt": turns}]), path)
    assert "roles ['user', 'assistant']" in _one_line_error(path, "row 1", "prompt")


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ({"tests": []}, "tests", "is empty"),
        ({"tests": "assert f() == 1"}, "tests", "not JSON"),
        ({"tests": ["assert f() == 1", {"input": "", "output": ""}]}, "tests", "all tests of one kind"),
        ({"tests": [{"input": [1, 2], "output": "3"}]}, "tests", "test 0 needs a string 'input'"),
        ({"tests": {"inputs": ["1"], "outputs": []}}, "tests", "has 1 inputs but 0 outputs"),
        ({"tests": {"fn_name": "f"}}, "tests", "without the lists 'input' and 'output'"),
        ({"tests": ["assert f() == 1"], "entry_point": 3}, "entry_point", "must be a string"),
        ({"tests": ["assert f() == 1"], "imports": [1]}, "imports", "a string or a list of strings"),
        ({"answer": "1", "reward_model": "72"}, "reward_model", "an object like verl's"),
        ({"reward_model": {"ground_truth": ""}}, "reward_model.ground_truth", "is empty"),
    ],
)
def test_bad_code_and_verl_fields(tmp_path: Path, row: dict, field: str, fragment: str) -> None:
    path = _write_json_lines(tmp_path / "rows.jsonl", [{"problem": "p", **row}])
    assert fragment in _one_line_error(path, "line 1", field)


def test_answer_is_needed_unless_the_row_has_tests_or_a_ground_truth(tmp_path: Path) -> None:
    path = _write_json_lines(tmp_path / "a.jsonl", [{"prompt": "q"}])
    message = _one_line_error(path, "line 1", "answer")  # "missing field 'answer'"
    assert "'answer' or 'solution'" in message and "'tests'" in message
    path = _write_json_lines(
        tmp_path / "b.jsonl", [{"problem": "q", "answer": None, "tests": ["assert True"]}]
    )
    assert load_problems(path)[0].answer == ""
    path = _write_json_lines(
        tmp_path / "c.jsonl", [{"problem": "q", "reward_model": {"ground_truth": [1, 2]}}]
    )
    assert load_problems(path)[0].answer == ""


def test_check_callback_message_names_file_and_row(tmp_path: Path) -> None:
    rows = [{"problem": "q", "tests": ["assert True"]}, {"problem": "r", "answer": "1"}]
    path = _write_json_lines(tmp_path / "mixed.jsonl", rows)
    seen: list[str] = []

    def needs_tests(problem: Problem) -> str | None:
        seen.append(problem.id)
        return (
            None
            if "tests" in problem.extra
            else "field 'tests' is missing (the code verifier runs a row's tests)"
        )

    with pytest.raises(DataError) as info:
        load_problems(path, check=needs_tests)
    assert (
        str(info.value) == f"{path} line 2: field 'tests' is missing (the code verifier runs a row's tests)"
    )
    assert seen == ["mixed-0", "mixed-1"]
    assert [p.id for p in load_problems(path, check=lambda problem: None)] == ["mixed-0", "mixed-1"]


def test_helpers_and_pickling() -> None:
    import pickle

    assert fold_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == "S\n\nU"
    assert normalise_tests({"inputs": ["a"], "outputs": ["b"]}) == [{"input": "a", "output": "b"}]
    problem = Problem("p", "q", extra={"tests": [{"input": "a", "output": "b"}]})
    assert pickle.loads(pickle.dumps(problem)).extra == problem.extra  # verifier workers get rows


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
