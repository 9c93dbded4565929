"""`graftrl verify`: a code config's verifier on given responses (each reason and the summary), on
its data (`--problems`: bad rows, canonical solutions), `reward.sandbox: none`'s warning and the
one-line error of an unmatched response. The policies name folders that do not exist: verify
loads no model."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.cli.common import console

ADD = {
    "id": "add",
    "problem": "Write add(a, b) returning the sum.",
    "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"],
    "entry_point": "add",
}
SUM = {
    "id": "sum",
    "problem": "Read two integers on one line; print their sum.",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
}
RESPONSES = [
    {"id": "add", "response": "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"},  # right
    {"id": "add", "response": "```python\ndef add(a, b):\n    return abs(a) + b\n```"},  # 2 of 3
    {"id": "add", "response": "```python\ndef add(a, b):\n    return a - b\n```"},  # wrong
    # by problem text, not id: a syntax error
    {"problem": SUM["problem"], "response": "```python\nprint(sum(map(int, input().split()))\n```"},
    # the second test sleeps past reward.code.test_timeout_s
    {
        "id": "sum",
        "response": "```python\nimport time\na, b = map(int, input().split())\nif a == 5:\n"
        "    time.sleep(30)\nprint(a + b)\n```",
    },
    {"id": "sum", "response": "I cannot write this one.\n```python\n```"},  # no code
]


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    """Rows of the table on one line each (the console is 80 columns when not a terminal)."""
    monkeypatch.setattr(console, "_width", 200)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def code_config(tmp_path, problems, **reward) -> str:
    write_jsonl(tmp_path / "problems.jsonl", problems)
    config = {
        "policies": [
            {"name": "a", "path": str(tmp_path / "no-such-model-a")},
            {"name": "b", "path": str(tmp_path / "no-such-model-b")},
        ],
        "data": {"train": "problems.jsonl"},
        "reward": {"kind": "code", **reward},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_verify_prints_each_responses_reward_and_reason(tmp_path):
    config = code_config(tmp_path, [ADD, SUM])
    responses = write_jsonl(tmp_path / "responses.jsonl", RESPONSES)
    out = tmp_path / "verdicts.json"
    result = invoke(
        "verify",
        config,
        "--responses",
        responses,
        "--set",
        "reward.code.test_timeout_s=1",
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    text = result.output
    assert "verifying 6 responses" in text and "reward.kind code (sandbox bwrap" in text
    rows = json.loads(out.read_text())
    assert [(r["line"], r["id"], round(r["reward"], 3), r["failure"]) for r in rows] == [
        (1, "add", 1.0, None),
        (2, "add", 0.667, "tests_failed"),
        (3, "add", 0.0, "tests_failed"),
        (4, "sum", 0.0, "syntax_error"),
        (5, "sum", 0.5, "timeout"),
        (6, "sum", 0.0, "no_code"),
    ]
    reasons = [r["reason"] for r in rows]
    assert reasons[0] == "3 of 3 tests passed"
    assert reasons[1].startswith("2 of 3 tests passed; test 2: fail")
    assert reasons[2].startswith("0 of 3 tests passed")
    assert reasons[3].startswith("syntax error")
    assert reasons[4].startswith("1 of 2 tests passed; test 1: timeout")
    assert reasons[5] == "no code found"
    for reason in (
        "3 of 3 tests passed",
        "2 of 3 tests passed",
        "syntax error",
        "test 1: timeout",
        "no code found",
    ):
        assert reason in text  # each in the printed table
    assert (
        "6 responses: mean reward 0.361, 1 of 6 successes (reward >= 1); failures by class: "
        "tests_failed 2, syntax_error 1, timeout 1, no_code 1"
    ) in " ".join(text.split())
    assert "warning" not in text  # the sandbox is on: no warning


def test_problems_checks_rows_and_canonical_solutions(tmp_path):
    good = {**ADD, "canonical_solution": "def add(a, b):\n    return a + b\n"}
    off_by_one = {**SUM, "canonical_solution": "print(sum(map(int, input().split())) + 1)\n"}
    no_tests = {"id": "empty", "problem": "Write something.", "answer": "x"}
    config = code_config(tmp_path, [good, off_by_one, no_tests])
    result = invoke("verify", config, "--problems")
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert any(
        line.startswith("checked data.train") and "3 rows, 1 bad, 2 with a canonical_solution" in line
        for line in lines
    )
    bad = [line for line in lines if line.startswith("bad row:")]
    assert len(bad) == 1 and "problems.jsonl line 3" in bad[0] and "'tests'" in bad[0]
    failing = [line for line in lines if line.startswith("canonical solution fails:")]
    assert len(failing) == 1 and "line 2 (id 'sum')" in failing[0] and "0 of 2 tests passed" in failing[0]
    assert "1 bad rows; 2 canonical solutions scored, 1 below reward 1.0" in lines[-1]

    config = code_config(tmp_path, [good, SUM])  # the passing canonical solution alone
    result = invoke("verify", config, "--problems")
    assert result.exit_code == 0, result.output
    assert "0 bad rows; 1 canonical solutions scored, 0 below reward 1.0" in result.output


def test_sandbox_none_warns(tmp_path):
    config = code_config(tmp_path, [ADD], sandbox="none")  # only a benign program runs unisolated
    responses = write_jsonl(tmp_path / "responses.jsonl", RESPONSES[:3])
    result = invoke("verify", config, "--responses", responses, "--limit", "1")  # the first only
    assert result.exit_code == 0, result.output
    assert "warning: reward.sandbox is none: model-written programs run WITHOUT isolation" in result.output
    assert "1 response: mean reward 1.000, 1 of 1 successes" in result.output


def test_an_unmatched_response_is_one_error_line(tmp_path):
    config = code_config(tmp_path, [ADD])
    responses = write_jsonl(
        tmp_path / "responses.jsonl", [RESPONSES[0], {"id": "nope", "response": "def f(): pass"}]
    )
    result = invoke("verify", config, "--responses", responses)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {responses} line 2: no problem with id 'nope' in data.train ({tmp_path / 'problems.jsonl'}); "
        "give the id (or the exact problem text) of a row of those files"
    ]
    by_text = write_jsonl(tmp_path / "by_text.jsonl", [{"problem": "Something else.", "response": "x"}])
    result = invoke("verify", config, "--responses", by_text)
    assert result.exit_code == 2 and "line 1: no problem with this problem text" in result.output
    result = invoke("verify", config)  # neither --responses nor --problems
    assert result.exit_code == 2 and "give --responses FILE" in result.output
