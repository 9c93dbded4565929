"""Problem rows in the formats users already have: graftrl's own rows, verl's Parquet rows, TRL's
``prompt`` column, and code rows with tests. ``row_to_problem`` turns one row into a ``Problem``.

**Prompt text.** ``problem`` (a string: graftrl's rows); else ``prompt``, either a string (TRL's
standard format) or chat messages ``[{"role": ..., "content": ...}]`` (TRL's conversational
format, verl's rows). Messages fold into ONE string, because graftrl renders one user turn per
prompt with each policy's own template or chat template (``fold_messages``):

- the last message has role ``user``;
- one leading ``system`` message may come before it and is put first, a blank line apart:
  ``"{system}\\n\\n{user}"`` (a blank system message is dropped);
- any other shape (assistant turns, several user turns, content that is not a string) is
  refused with one line naming the file, the row and the field ``prompt``. Fold few-shot
  examples into the user message's text.

**Gold answer** (``_gold_field``, the one place for this rule). ``answer``; else, in a row whose
text comes from ``prompt``, ``solution`` (TRL's GRPO examples use either); else verl's
``reward_model.ground_truth`` when it is a string or a number. Strings and numbers are read with
``str``. The answer is required, as it always was, unless the row has ``tests`` or
``reward_model.ground_truth``: then it may be absent (or blank) and is ``""``, as when the
ground truth is a list or an object (code tests kept in ``extra``).

**id.** ``id``; else verl's ``extra_info.index``; else ``{file stem}-{record index}`` (0-based,
so the same data gives the same ids in JSONL and Parquet). **family.** ``family``, optional.

**extra.** Every other field of the row as read (JSON/Parquet values: lists, dicts, numbers):
all fields but ``id``, ``problem``, ``answer``, ``family`` and the ``prompt`` the text came from;
null fields are left out (a Parquet file with several kinds of rows fills the fields a row lacks
with null). Two are added or rewritten:

- ``ground_truth``: verl's ``reward_model.ground_truth`` as read (``reward_model`` stays too);
- ``tests``, normalised (``normalise_tests``) to one of two forms: a list of assert statements
  (HumanEval/MBPP style, with an optional ``entry_point``), or a list of
  ``{"input": str, "output": str}`` stdin/stdout pairs (APPS/CodeContests style).
  ``{"inputs": [...], "outputs": [...]}`` (APPS) and ``{"input": [...], "output": [...]}``
  (CodeContests) become the list of pairs; a string holding any of these as JSON is parsed.

Code rows may also give ``entry_point`` and ``canonical_solution`` (strings) and ``setup`` and
``imports`` (a string or a list of strings), kept in ``extra`` as read. Errors name the file,
the row and the field, and say how to fix it, on one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graftrl.storage.problems import DataError, Problem

__all__ = ["fold_messages", "id_field", "normalise_tests", "row_to_problem", "verl_row"]

OWN_FIELDS = ("id", "problem", "answer", "family")
"""Fields read into ``Problem``'s own attributes, so not kept in ``extra``."""
GROUND_TRUTH = "reward_model.ground_truth"
CODE_STRING_FIELDS = ("entry_point", "canonical_solution")
CODE_TEXT_FIELDS = ("setup", "imports")
"""A string, or a list of strings (MBPP's ``test_imports`` is a list)."""
TESTS_FORMS = (
    "a list of assert statements, a list of {'input': ..., 'output': ...} stdin/stdout pairs, "
    "or {'inputs': [...], 'outputs': [...]}"
)


def row_to_problem(path: Path, where: str, index: int, record: Any) -> Problem:
    """One row of ``path`` (at ``where``: ``line N``, ``record N`` or ``row N``; ``index`` is
    its 0-based record index) as a ``Problem``; raises ``DataError`` naming the field."""
    loc = f"{path} {where}"
    if not isinstance(record, dict):
        raise DataError(f"{loc}: expected an object with 'problem' and 'answer', got {type(record).__name__}")
    # Presence first, then types, in the order the math-only reader always reported them.
    text_field = _text_field(loc, record)
    ground_truth = _ground_truth(loc, record)
    gold_field = _gold_field(loc, record, text_field, ground_truth)
    problem = _text(loc, text_field, record[text_field])
    if gold_field is None:
        answer = ""
    elif gold_field == GROUND_TRUTH:
        answer = _scalar_to_str(loc, GROUND_TRUTH, ground_truth)
    else:
        answer = _scalar_to_str(loc, gold_field, record[gold_field])

    source = id_field(record)
    if source == "id":
        pid = _scalar_to_str(loc, "id", record["id"])
    elif source == "extra_info.index":
        pid = _scalar_to_str(loc, source, record["extra_info"]["index"])
    else:
        pid = f"{path.stem}-{index}"
    raw_family = record.get("family")
    family = None if raw_family is None else _scalar_to_str(loc, "family", raw_family)

    skip = {*OWN_FIELDS, text_field}
    extra = {name: value for name, value in record.items() if name not in skip and value is not None}
    if ground_truth is not None:
        extra["ground_truth"] = ground_truth
    if record.get("tests") is not None:
        try:
            extra["tests"] = normalise_tests(record["tests"])
        except ValueError as exc:
            raise DataError(f"{loc}: field 'tests' {exc}") from None
    for name in CODE_STRING_FIELDS:
        if name in extra and not isinstance(extra[name], str):
            raise DataError(f"{loc}: field {name!r} must be a string, got {type(extra[name]).__name__}")
    for name in CODE_TEXT_FIELDS:
        value = extra.get(name)
        if value is not None and not _is_text(value):
            raise DataError(
                f"{loc}: field {name!r} must be a string or a list of strings (lines of code), "
                f"got {type(value).__name__}"
            )
    return Problem(id=pid, problem=problem, answer=answer, family=family, extra=extra)


def id_field(record: Mapping[str, Any]) -> str | None:
    """Where a row's id comes from: ``"id"``, ``"extra_info.index"`` (verl), or None (generated)."""
    if record.get("id") is not None:
        return "id"
    info = record.get("extra_info")
    if isinstance(info, Mapping) and info.get("index") is not None:
        return "extra_info.index"
    return None


def fold_messages(messages: Any) -> str:
    """Chat messages as one prompt string (the rule is in the module docstring); raises
    ``ValueError`` saying what is wrong and how to fix it, to follow ``field 'prompt' ``."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(
            "must be a non-empty string or a non-empty list of chat messages "
            '[{"role": "user", "content": "..."}]'
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"message {i} is not a chat message (expected an object with string 'role' and "
                f"'content', got {type(message).__name__})"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"message {i} ({message['role']}) has {type(content).__name__} content, not a string "
                "(join its text parts into one string; images and other parts are not supported)"
            )
    roles = [m["role"] for m in messages]
    if roles not in (["user"], ["system", "user"]):
        raise ValueError(
            f"has messages with roles {roles}; graftrl takes one user message, optionally after one "
            "system message, because each policy renders a prompt as one user turn with its own "
            "template (put few-shot examples or earlier turns into the user message's text)"
        )
    user = messages[-1]["content"]
    if not user.strip():
        raise ValueError("has an empty user message (give the problem text, or remove the record)")
    system = messages[0]["content"] if len(messages) == 2 else ""
    return f"{system}\n\n{user}" if system.strip() else user


def normalise_tests(tests: Any) -> list[str] | list[dict[str, str]]:
    """A row's ``tests`` as a list of assert statements or a list of ``{"input", "output"}``
    string pairs (the forms are in the module docstring); raises ``ValueError`` saying what is
    wrong and how to fix it, to follow ``field 'tests' ``."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise ValueError(
                f"is a string that is not JSON; give {TESTS_FORMS} (wrap one assert statement in a list)"
            ) from None
    if isinstance(tests, Mapping):
        keys = ("inputs", "outputs") if "inputs" in tests or "outputs" in tests else ("input", "output")
        inputs, outputs = tests.get(keys[0]), tests.get(keys[1])
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError(
                f"is an object without the lists {keys[0]!r} and {keys[1]!r}; give {TESTS_FORMS}"
            )
        if len(inputs) != len(outputs):
            raise ValueError(
                f"has {len(inputs)} {keys[0]} but {len(outputs)} {keys[1]} (pair each input with its output)"
            )
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(tests, list):
        raise ValueError(f"must be {TESTS_FORMS}; got {type(tests).__name__}")
    if not tests:
        raise ValueError("is empty (give at least one test, or remove the field)")
    if all(isinstance(test, str) for test in tests):
        for i, test in enumerate(tests):
            if not test.strip():
                raise ValueError(f"has an empty test at index {i} (remove it)")
        return list(tests)
    if all(isinstance(test, Mapping) for test in tests):
        pairs = []
        for i, test in enumerate(tests):
            given, expected = test.get("input"), test.get("output")
            if not isinstance(given, str) or not isinstance(expected, str):
                raise ValueError(
                    f"test {i} needs a string 'input' (stdin) and a string 'output' (expected stdout), "
                    f"got {type(given).__name__} and {type(expected).__name__} (call-based tests, as "
                    "APPS' 'fn_name' problems have, go in as assert statements)"
                )
            pairs.append({"input": given, "output": expected})
        return pairs
    raise ValueError(
        f"must be {TESTS_FORMS}, all tests of one kind; got a list of "
        f"{sorted({type(test).__name__ for test in tests})}"
    )


# --------------------------------------------------------------------------------------------
# The parts of a row
# --------------------------------------------------------------------------------------------


def _text_field(loc: str, record: Mapping[str, Any]) -> str:
    """``problem``, else ``prompt`` (TRL, verl); a row with neither fails as it always did."""
    if record.get("problem") is None and record.get("prompt") is not None:
        return "prompt"
    if "problem" not in record and "prompt" in record:
        raise DataError(f"{loc}: field 'prompt' is null (give it a value or remove the record)")
    if "problem" not in record:
        raise DataError(f"{loc}: missing field 'problem' (each record needs 'problem' and 'answer')")
    if record["problem"] is None:
        raise DataError(f"{loc}: field 'problem' is null (give it a value or remove the record)")
    return "problem"


def _ground_truth(loc: str, record: Mapping[str, Any]) -> Any:
    """verl's ``reward_model.ground_truth`` (None when the row has none)."""
    reward_model = record.get("reward_model")
    if reward_model is None:
        return None
    if not isinstance(reward_model, Mapping):
        raise DataError(
            f"{loc}: field 'reward_model' must be an object like verl's "
            f'{{"style": "rule", "ground_truth": ...}}, got {type(reward_model).__name__}'
        )
    return reward_model.get("ground_truth")


def _gold_field(loc: str, record: Mapping[str, Any], text_field: str, ground_truth: Any) -> str | None:
    """The field the gold answer is read from: ``answer``, ``solution`` (``prompt`` rows only) or
    ``reward_model.ground_truth`` (a string or a number); None for a row that needs no answer
    (it has ``tests`` or a list/object ground truth). Raises for a row that needs one."""
    optional = record.get("tests") is not None or ground_truth is not None
    names = ("answer", "solution") if text_field == "prompt" else ("answer",)
    for name in names:
        value = record.get(name)
        if value is None or (optional and isinstance(value, str) and not value.strip()):
            continue
        return name
    if ground_truth is not None:
        return GROUND_TRUTH if _is_scalar(ground_truth) else None
    if optional:
        return None
    if record.get("answer", 0) is None:
        raise DataError(f"{loc}: field 'answer' is null (give it a value or remove the record)")
    if text_field == "problem":
        raise DataError(f"{loc}: missing field 'answer' (each record needs 'problem' and 'answer')")
    raise DataError(
        f"{loc}: missing field 'answer' (a 'prompt' row gives its gold answer in 'answer' or "
        f"'solution', or in verl's '{GROUND_TRUTH}'; a code row gives 'tests' instead)"
    )


def _text(loc: str, name: str, value: Any) -> str:
    if name == "prompt" and not isinstance(value, str):
        try:
            return fold_messages(value)
        except ValueError as exc:
            raise DataError(f"{loc}: field 'prompt' {exc}") from None
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{loc}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _scalar_to_str(loc: str, name: str, value: Any) -> str:
    """Accept strings and numbers (JSON/Parquet often store answers and ids as numbers)."""
    if not _is_scalar(value):
        raise DataError(f"{loc}: field {name!r} must be a string or a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{loc}: field {name!r} is {value!r}; write the answer as a string instead")
    text = str(value).strip()
    if not text:
        raise DataError(f"{loc}: field {name!r} is empty")
    return text


def verl_row(row: Mapping[str, Any], index: int, data_source: str, split: str) -> dict[str, Any]:
    """graftrl's row (``{id, problem, answer | tests, family, ...}``) as a row of verl's
    ``RLHFDataset`` Parquet: the problem as one user message, the gold answer (or the tests, as a
    JSON list) in ``reward_model.ground_truth``, ``extra_info.index``; ``id``, ``family`` and a code
    row's fields stay as columns of their own, so ``row_to_problem`` reads it back as the same
    problem."""
    tests = row.get("tests")
    ground_truth = json.dumps(tests) if tests is not None else str(row["answer"])
    kept = {k: v for k, v in row.items() if k not in ("problem", "answer")}
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": row["problem"]}],
        "ability": "code" if tests is not None else "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"index": index, "split": split},
        **kept,
    }
