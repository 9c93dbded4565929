"""The ``function`` verifier: the user's scorer (verl's ``compute_score`` unchanged, or
``(response, answer, row)``) in killable worker processes: returns, failures, timeouts, bad paths."""

from __future__ import annotations

import hashlib
import math
import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from graftrl.config.rewards import RewardConfig
from graftrl.errors import UserError
from graftrl.storage.data import Problem
from graftrl.verifiers.base import ERROR, TIMEOUT, WRONG, Verifier, VerifierError
from graftrl.verifiers.function import FunctionVerifier, parse_scorer_path, to_reward

# verl's documented custom reward function (docs: "Implement Reward Function for Dataset"),
# unchanged: a float, and the dict form with "score" and other keys.
VERL_SCORER = '''
def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match; the data source and extra_info must arrive as the row gave them."""
    if data_source != "my_set" or (extra_info or {}).get("split") != "train":
        return 0.0
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else -0.5, "acc": correct, "pred": solution_str}


def no_extra_info(data_source, solution_str, ground_truth):
    return solution_str == ground_truth
'''

PLAIN_SCORER = """
import os
import sys
import time

import numpy as np


def plain(response, answer, row):
    return response == answer


def row_fields(response, answer, row):
    # the row as a plain dict, and this call is not in the calling process
    expected = {"id", "problem", "answer", "family", "tests", "parent_pid"}
    return float(set(row) == expected and row["tests"] == [1, 2] and os.getpid() != row["parent_pid"])


def returns(response, answer, row):
    return {
        "true": True, "false": False, "int": 1, "half": 0.5, "two": 2.0, "np": np.float32(0.25),
        "dict": {"score": 0.75, "acc": True}, "nan": float("nan"), "text": "yes",
        "nodict": {"acc": 1.0}, "none": None,
    }[response]


def misbehave(response, answer, row):
    if response == "hang":
        time.sleep(60)
    if response == "exit":
        os._exit(3)
    if response == "raise":
        raise ValueError("cannot score\\nthis")
    if response == "sysexit":
        sys.exit(0)
    return 1.0
"""


@pytest.fixture(scope="module")
def scorers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("scorers")
    (folder / "verl_score.py").write_text(textwrap.dedent(VERL_SCORER))
    (folder / "plain_score.py").write_text(PLAIN_SCORER)
    (folder / "raises_on_import.py").write_text("raise RuntimeError('broken import')\n")
    (folder / "exits_on_import.py").write_text("import os\nos._exit(4)\n")
    (folder / "pkg_scorer_mod.py").write_text("def score(response, answer, row):\n    return 0.5\n")
    return folder


P = Problem("p1", "2+2?", "4", family="add")


def verl_problem(answer: str = "4") -> Problem:
    extra = {"data_source": "my_set", "ground_truth": answer, "extra_info": {"split": "train", "index": 0}}
    return Problem("v1", "2+2?", "", extra=extra)


def test_verl_scorer_called_as_verl_calls_it(scorers: Path) -> None:
    with FunctionVerifier(f"{scorers}/verl_score.py:compute_score") as v:
        assert isinstance(v, Verifier) and v.kind == "function"
        v.start()
        assert v.signature == "verl"
        out = v.verify(["4", " 4\n", "5"], [verl_problem()] * 3)
        assert [x.reward for x in out] == [1.0, 1.0, 0.0]
        assert out[0].failure is None and out[0].reason == "correct"
        assert out[2].failure == WRONG and out[2].reason == "scored 0"
        # the ground truth falls back to reward_model.ground_truth, then to the row's answer
        nested = Problem(
            "v2",
            "q",
            "",
            extra={
                "data_source": "my_set",
                "reward_model": {"ground_truth": "7"},
                "extra_info": {"split": "train"},
            },
        )
        fallback = Problem("v3", "q", "9", extra={"data_source": "my_set", "extra_info": {"split": "train"}})
        assert v.rewards(["7", "9"], [nested, fallback]) == [1.0, 1.0]
        assert v.rewards(["4"], [Problem("v4", "q", "4", extra={"data_source": "other"})]) == [0.0]


def test_verl_doc_examples_float_dict_and_no_extra_info(scorers: Path) -> None:
    with FunctionVerifier(f"{scorers}/verl_score.py:my_reward_fn") as v:
        assert v.rewards(["x" * 50], [verl_problem()]) == [0.5]
    with FunctionVerifier(f"{scorers}/verl_score.py:compute_score_dict") as v:
        out = v.verify(["4", "3"], [verl_problem()] * 2)
        assert [x.reward for x in out] == [1.0, -0.5]  # only "score" counts; a scale of the user's
        assert out[1].failure == WRONG and out[1].reason == "scored -0.5"
    with FunctionVerifier(f"{scorers}/verl_score.py:no_extra_info") as v:
        assert v.rewards(["4", "3"], [verl_problem()] * 2) == [1.0, 0.0]


def test_plain_scorer_gets_response_answer_and_row(scorers: Path) -> None:
    row = Problem("r1", "q", "4", family="add", extra={"tests": [1, 2], "parent_pid": os.getpid()})
    with FunctionVerifier(f"{scorers}/plain_score.py:plain", workers=2) as v:
        v.start()
        assert v.signature == "plain"
        assert v.rewards(["4", "5", "4"], [P, P, P]) == [1.0, 0.0, 1.0]
    with FunctionVerifier(f"{scorers}/plain_score.py:row_fields") as v:
        assert v.rewards(["x"], [row]) == [1.0]


def test_return_values(scorers: Path) -> None:
    names = ["true", "false", "int", "half", "two", "np", "dict", "nan", "text", "nodict", "none"]
    with FunctionVerifier(f"{scorers}/plain_score.py:returns", success_threshold=0.5) as v:
        out = dict(zip(names, v.verify(names, [P] * len(names)), strict=True))
    assert {k: out[k].reward for k in names} == {
        "true": 1.0, "false": 0.0, "int": 1.0, "half": 0.5, "two": 2.0, "np": 0.25, "dict": 0.75,
        "nan": 0.0, "text": 0.0, "nodict": 0.0, "none": 0.0,
    }  # fmt: skip
    # success means reward >= success_threshold (0.5 here), whatever the scale
    assert [out[k].failure for k in ("true", "half", "two", "dict")] == [None] * 4
    assert out["np"].failure == WRONG and out["false"].failure == WRONG
    for bad in ("nan", "text", "nodict", "none"):
        assert out[bad].failure == ERROR and out[bad].reason.startswith("scorer returned "), out[bad]
    assert "nan" in out["nan"].reason and "'score'" in out["nodict"].reason


def test_to_reward() -> None:
    assert to_reward(True) == 1.0 and to_reward(np.bool_(False)) == 0.0 and to_reward(3) == 3.0
    assert to_reward({"score": np.float64(0.5), "acc": 1}) == 0.5 and to_reward(np.array(0.25)) == 0.25
    for bad in (float("nan"), math.inf, "1", None, [1.0], {"acc": 1.0}, np.array([1.0, 2.0])):
        with pytest.raises(ValueError):
            to_reward(bad)


def test_hang_raise_and_exit_score_zero_and_the_next_call_works(scorers: Path) -> None:
    with FunctionVerifier(f"{scorers}/plain_score.py:misbehave", timeout_s=1.0, workers=1) as v:
        v.start()
        t0 = time.monotonic()
        out = v.verify(["ok", "hang", "raise", "exit", "sysexit", "ok2"], [P] * 6)
        assert time.monotonic() - t0 < 8
        assert [x.reward for x in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert out[1].failure == TIMEOUT and "reward.function.timeout_s" in out[1].reason
        assert out[2].failure == ERROR and out[2].reason == "scorer raised ValueError: cannot score this"
        assert out[3].failure == ERROR and "exit code 3" in out[3].reason
        assert out[4].failure == ERROR and out[4].reason.startswith("scorer raised SystemExit")
        stats = v.stats()
        assert stats["timeouts"] == 1 and stats["worker_restarts"] == 2 and stats["errors"] == 3
        assert v.rewards(["ok"], [P]) == [1.0]  # a fresh worker took the killed ones' place


def test_deadline_scores_the_rest_zero(scorers: Path) -> None:
    with FunctionVerifier(f"{scorers}/plain_score.py:misbehave", timeout_s=30.0, deadline_s=1.0) as v:
        v.start()
        t0 = time.monotonic()
        out = v.verify(["hang", "a", "b"], [P] * 3)
        assert time.monotonic() - t0 < 8
        assert [x.failure for x in out] == [TIMEOUT] * 3
        assert all("reward.deadline_s" in x.reason for x in out)
        assert v.stats()["deadline_skips"] == 3
        assert v.rewards(["a"], [P]) == [1.0]


def test_identical_pairs_scored_once(scorers: Path) -> None:
    q = Problem("p2", "q", "4")
    with FunctionVerifier(f"{scorers}/plain_score.py:plain") as v:
        assert v.rewards(["4", "4", "5", "4", "4"], [P, P, P, q, P]) == [1.0] * 2 + [0.0] + [1.0] * 2
        assert v.stats()["scored"] == 3 and v.stats()["duplicates"] == 2


def test_import_path_and_from_config(scorers: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(scorers))  # spawned workers get the parent's sys.path
    reward = RewardConfig(kind="function", function={"path": "pkg_scorer_mod:score", "timeout_s": 2.0},
                          workers=2, deadline_s=50.0, success_threshold=0.5)  # fmt: skip
    with FunctionVerifier.from_config(reward) as v:
        assert (v.timeout_s, v.num_workers, v.deadline_s, v.success_threshold) == (2.0, 2, 50.0, 0.5)
        assert v.file_digest() is None
        assert v.verify(["x"], [P])[0].failure is None
    with pytest.raises(ValueError, match="2 responses but 1 problems"):
        v.verify(["a", "b"], [P])


def test_parse_scorer_path(scorers: Path) -> None:
    assert parse_scorer_path("pkg.sub.mod:compute_score") == ("pkg.sub.mod", "compute_score", False)
    assert parse_scorer_path(f" {scorers}/plain_score.py:plain ") == (
        str(scorers / "plain_score.py"),
        "plain",
        True,
    )


def test_file_digest_and_relative_path(scorers: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(scorers)
    v = FunctionVerifier("plain_score.py:plain")
    assert v.target == str(scorers / "plain_score.py") and v.is_file
    assert v.file_digest() == hashlib.sha256((scorers / "plain_score.py").read_bytes()).hexdigest()
    v.close()


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("{d}/plain_score.py", "names no function"),
        ("{d}/missing.py:score", "no scorer file"),
        (
            "{d}/plain_score.py:nope",
            "has no function 'nope' (its functions: misbehave, plain, returns, row_fields)",
        ),
        ("{d}/plain_score.py:2bad", "is not a function name"),
        ("no_such_module_xyz:score", "cannot import 'no_such_module_xyz'"),
        ("not a module:score", "is no module name"),
        ("json:loads", "cannot be called as a scorer"),
        ("{d}/raises_on_import.py:f", "loading raises_on_import.py raised RuntimeError: broken import"),
        ("{d}/exits_on_import.py:f", "exited (code 4)"),
    ],
)
def test_bad_path_is_one_line_naming_the_setting(scorers: Path, path: str, says: str) -> None:
    with pytest.raises(VerifierError) as caught, FunctionVerifier(path.format(d=scorers)) as v:
        v.start()
    message = str(caught.value)
    assert isinstance(caught.value, UserError)
    assert message.startswith("reward.function.path: ") and "\n" not in message
    assert says in message, message


def test_config_requires_a_path() -> None:
    with pytest.raises(ValueError, match=r"reward\.function\.path"):
        RewardConfig(kind="function")
