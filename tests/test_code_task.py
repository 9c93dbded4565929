"""The embedded code task: its problems, programs, tests and rows, checked by the real verifier."""

from __future__ import annotations

import random
import re

import pytest

from graftrl.config.rewards import RewardConfig
from graftrl.embedded.base import demo_config, demo_settings, write_problems
from graftrl.embedded.code_task import (
    CODE_FAMILIES,
    TEST_INPUTS,
    classify_code,
    code_program,
    code_tests,
    reference_function,
)
from graftrl.embedded.task import get_task, make_split
from graftrl.storage.data import load_problems
from graftrl.verifiers.registry import build_verifier


def test_programs_compute_what_the_spec_says() -> None:
    assert code_program("add 3 mod 5") == "def f(x):\n    # add 3 mod 5\n    return (x+3)%5"
    assert code_program("sub 40 mod 7").endswith("\n    return (x-40)%7")
    assert code_program("mul 4 if odd else add 9").endswith("\n    return x*4 if x%2 else x+9")
    assert code_program("add 81 sub 32").endswith("\n    return x+81-32")
    assert [reference_function("add 9 if odd else mul 3")(x) for x in (0, 1, 2)] == [0, 10, 6]
    assert code_tests("sub 40 mod 7") == [f"assert f({x}) == {(x - 40) % 7}" for x in TEST_INPUTS]
    with pytest.raises(ValueError, match="not a code-task spec"):
        code_program("add 3 and launch")


def test_families_draw_their_own_shape() -> None:
    rng = random.Random(0)
    shapes = {
        "lin": r"x\+\d+-\d+",
        "mod": r"\(x[+-]\d+\)%[2-9]",
        "cond": r"x\+\d+ if x%2 else x\*[2-9]|x\*[2-9] if x%2 else x\+\d+",
    }
    for name, (_, spec) in CODE_FAMILIES.items():
        for _ in range(50):
            text = spec(rng)
            body = code_program(text).removeprefix(f"def f(x):\n    # {text}\n    return ")
            assert re.fullmatch(shapes[name], body), (name, text, body)
            assert classify_code(text, code_program(text)) == "correct"


def test_split_is_disjoint_and_weighted_to_the_steps() -> None:
    train, heldout = make_split(seed=0, n_train=1200, n_eval=256, task="code")
    assert not {p.id for p in train} & {p.id for p in heldout}
    share = {f: sum(p.family == f for p in train) / len(train) for f in CODE_FAMILIES}
    assert share["mod"] > 0.4 and share["cond"] > 0.4 and 0.05 < share["lin"] < 0.15


def test_outcome_classes() -> None:
    spec = "add 5 if odd else mul 3"
    head = f"def f(x):\n    # {spec}\n    return "
    assert classify_code(spec, head + "x+5 if x%2 else x*3") == "correct"
    assert classify_code(spec, head + "x+5 if x%2 else x*4") == "constant"
    assert classify_code(spec, head + "x+5") == "step"
    assert classify_code(spec, "def f(x):\n    return x+5 if x%2 else x*3") == "format"
    assert classify_code("add 3 mod 5", "def f(x):\n    # add 3 mod 5\n    return x+3%5") == "step"


def test_rows_load_and_score_in_the_sandbox(tmp_path) -> None:
    """The rows the embedded base writes are code rows: the canonical program scores 1, a program
    without the conditional gets the share of tests its one branch passes, and a wrong constant 0."""
    train, _ = make_split(seed=0, n_train=60, n_eval=8, task="code")
    path = tmp_path / "train.jsonl"
    write_problems(train, path, "code")
    reward = RewardConfig(**get_task("code").run_config["reward"])
    verifier = build_verifier(reward)
    try:
        verifier.start()
        problems = load_problems(path, check=verifier.check_problem)
        canonical = [p.extra["canonical_solution"] for p in problems]
        assert verifier.rewards(canonical, problems) == [1.0] * len(problems)
        cond = next(p for p in problems if p.family == "cond" and p.problem.startswith("add"))
        branch = cond.problem.split(" if ")[0].split()  # "add A": the odd branch alone
        one_branch = f"def f(x):\n    # {cond.problem}\n    return x+{branch[1]}"
        expected = sum(reference_function(cond.problem)(x) == x + int(branch[1]) for x in TEST_INPUTS) / len(
            TEST_INPUTS
        )
        assert verifier.rewards([one_branch], [cond]) == [pytest.approx(expected)]
        assert expected >= 0.5
    finally:
        verifier.close()


def test_demo_config_runs_the_code_verifier() -> None:
    from graftrl.config import config_from_dict

    settings = demo_settings("code", quick=True)
    raw = demo_config({"llama-char": "/m/a", "gpt2-bpe": "/m/b"}, "/d/train.jsonl", "hint", 0, settings)
    config = config_from_dict(raw)
    assert config.reward.kind == "code" and config.reward.sandbox == "bwrap"
    assert config.hint.form == "prefix"
    # the arithmetic tasks' configs are as they were: no reward or hint section
    assert "reward" not in demo_config(
        {"llama-char": "/m/a"}, "/d/t.jsonl", "grpo", 0, demo_settings("worked")
    )


def test_verl_copy_reads_back_as_the_same_problems(tmp_path) -> None:
    """`graftrl embedded --task code` writes verl's Parquet beside the JSONL: a row verl's
    RLHFDataset reads (prompt messages, reward_model.ground_truth, extra_info.index) and graftrl
    reads back as the same problem with the same tests."""
    import pyarrow.parquet as pq

    from graftrl.embedded.base import verl_copy

    train, _ = make_split(seed=0, n_train=12, n_eval=4, task="code")
    jsonl = tmp_path / "train.jsonl"
    write_problems(train, jsonl, "code")
    parquet = verl_copy(jsonl, train, "code")
    row = pq.read_table(parquet).to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": train[0].problem}]
    assert row["data_source"] == "graftrl/embedded-code" and row["ability"] == "code"
    assert row["extra_info"] == {"index": 0, "split": "train"}
    from_jsonl, from_parquet = load_problems(jsonl), load_problems(parquet)
    assert [(p.id, p.problem, p.family, p.extra["tests"]) for p in from_parquet] == [
        (p.id, p.problem, p.family, p.extra["tests"]) for p in from_jsonl
    ]


def test_exposure_knob_moves_only_the_steps() -> None:
    from graftrl.embedded.mixes import TASK_MIXES, exposure_mixes

    for exposure in (0.01, 0.03, 0.1):
        mixes = exposure_mixes("code", exposure)
        for name, mix in mixes.items():
            default = TASK_MIXES["code"][name]
            deficit = min(("mod", "cond"), key=lambda f: default[f])
            own = max(("mod", "cond"), key=lambda f: default[f])
            assert mix[deficit] == exposure
            assert sum(mix.values()) == pytest.approx(sum(default.values()))
            assert mix["lin"] == default["lin"] and mix[own] > 0
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        exposure_mixes("code", 0.0)
    with pytest.raises(ValueError, match="nothing of its own step"):
        exposure_mixes("code", 0.9)


def test_a_hinted_prompt_and_its_response_fit_the_context() -> None:
    """On the character tokenizer (one token a character, the longer of the two): every response
    fits max_new_tokens with its EOS, and the hint's prompt (the task's hint form, a whole peer
    program's first 80%) plus a response fits the models' positions."""
    from graftrl.embedded.models import MODEL_SPECS, build_char_tokenizer
    from graftrl.methods.hint import DEFAULT_TEMPLATE, hint_text, hinted_problem

    task = get_task("code")
    hint = task.run_config["hint"]
    tok = build_char_tokenizer()
    template = MODEL_SPECS["llama-char"]["template"]
    longest = 0
    for name in CODE_FAMILIES:
        for problem in make_split(seed=1, n_train=300, n_eval=1, families=[name], task="code")[0]:
            response = len(tok.encode(problem.answer, add_special_tokens=False)) + 1
            hinted = hinted_problem(
                DEFAULT_TEMPLATE, problem.problem, hint_text(problem.answer, hint["form"], hint["fraction"])
            )
            prompt = len(tok.encode(template.format(problem=hinted), add_special_tokens=False))
            assert response <= task.max_new_tokens
            longest = max(longest, prompt + response)
    assert longest <= task.max_positions
