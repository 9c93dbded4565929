"""The embedded tasks by name: the ``worked`` task's generator, format and verifier path, and the
selection of a task in the warm-start, the demo settings and the CLI."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from graftrl.embedded.task import (
    DEFAULT_TASK,
    RESPONSE_FORMAT,
    TASKS,
    get_task,
    make_problems,
    make_split,
    supervised_text,
    worked_solution,
)
from graftrl.models.rewards import MathVerifier, extract_last_boxed

WORKED = TASKS["worked"]


def _regroups(problem: str) -> bool:
    a, b = (int(x) for x in re.split(r"[+-]", problem))
    return (a % 10 + b >= 10) if "+" in problem else (a % 10 < b)


def test_worked_problems_deterministic_distinct_and_by_family():
    a = make_problems(None, 400, seed=3, task="worked")
    assert a == make_problems(None, 400, seed=3, task="worked")
    assert a != make_problems(None, 400, seed=4, task="worked")
    assert len({p.id for p in a}) == 400
    assert {p.family for p in a} == set(WORKED.families) == {"add", "add_carry", "sub", "sub_borrow"}
    for p in a:
        assert str(eval(p.problem)) == p.answer  # plain integer expressions
        assert ("+" in p.problem) == p.family.startswith("add")
        assert _regroups(p.problem) == (p.family in ("add_carry", "sub_borrow")), p
        left = int(re.split(r"[+-]", p.problem)[0])
        assert 10 <= left <= 199 and int(p.answer) >= 10  # no leading-zero answers
    only = make_problems(["sub_borrow"], 50, seed=1, task="worked")
    assert {p.family for p in only} == {"sub_borrow"}


def test_the_arith_stream_is_unchanged_by_task_selection():
    assert make_problems(None, 50, seed=7) == make_problems(None, 50, seed=7, task="arith")
    assert make_split(0, 100, 40) == make_split(0, 100, 40, task="arith")
    assert supervised_text(make_problems(None, 1, seed=0)[0]).startswith("The answer is \\boxed{")


def test_worked_split_disjoint_and_covers_every_family():
    train, heldout = make_split(seed=0, n_train=1200, n_eval=256, task="worked")
    assert len(train) == 1200 and len(heldout) == 256
    assert not {p.id for p in train} & {p.id for p in heldout}
    assert {p.family for p in heldout} == set(WORKED.families)


@pytest.mark.parametrize(
    ("problem", "text"),
    [
        ("37+5", "ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{42}."),
        ("32+5", "ones 2+5=7, write 7 carry 0; tens 3+0=3. The answer is \\boxed{37}."),
        ("195+7", "ones 5+7=12, write 2 carry 1; tens 19+1=20. The answer is \\boxed{202}."),
        ("37-5", "ones 7-5=2, write 2 borrow 0; tens 3-0=3. The answer is \\boxed{32}."),
        ("132-5", "ones 12-5=7, write 7 borrow 1; tens 13-1=12. The answer is \\boxed{127}."),
        ("20-9", "ones 10-9=1, write 1 borrow 1; tens 2-1=1. The answer is \\boxed{11}."),
    ],
)
def test_worked_solution_format(problem, text):
    assert worked_solution(problem) == text


def test_worked_answers_are_what_the_verifier_extracts():
    problems = make_problems(None, 60, seed=2, task="worked")
    texts = [supervised_text(p, "worked") for p in problems]
    for text, p in zip(texts, problems, strict=True):
        assert extract_last_boxed(text) == p.answer
        assert text.endswith(RESPONSE_FORMAT.format(answer=p.answer))
    golds = [p.answer for p in problems]
    with MathVerifier() as verifier:
        assert verifier.score(texts, golds) == [1.0] * len(problems)
        # a wrong final answer scores 0 even though the working is right
        wrong = [
            t.replace("{" + g + "}", "{" + str(int(g) + 1) + "}") for t, g in zip(texts, golds, strict=True)
        ]
        assert verifier.score(wrong, golds) == [0.0] * len(problems)


def test_worked_responses_carry_working_and_fit_the_limits():
    pytest.importorskip("torch")
    from graftrl.embedded.models import MODEL_SPECS, build_spec
    from graftrl.embedded.warmstart import _corpus

    problems = make_problems(None, 300, seed=5, task="worked")
    for name, spec in MODEL_SPECS.items():
        _, tok = build_spec(name, _corpus(spec["template"], 0, "worked"), max_positions=WORKED.max_positions)
        for p in problems:
            text = supervised_text(p, "worked")
            working = text[: text.index("\\boxed")]
            # at least ~15 tokens of working before the boxed answer, on both tokenizers
            assert len(tok.encode(working, add_special_tokens=False)) >= 15, (name, text)
            n_response = len(tok.encode(text, add_special_tokens=False))
            n_prompt = len(tok.encode(spec["template"].format(problem=p.problem), add_special_tokens=False))
            assert n_response + 1 <= WORKED.max_new_tokens  # with EOS
            assert n_prompt + n_response + 1 <= WORKED.max_positions


def test_get_task_names_the_known_tasks():
    assert get_task("worked") is WORKED and DEFAULT_TASK in TASKS
    with pytest.raises(KeyError, match="known: arith, code, worked"):
        get_task("algebra")
    with pytest.raises(KeyError, match="unknown family"):
        make_problems(["add_carry"], 5, seed=0, task="arith")


def test_fingerprint_includes_the_task():
    from graftrl.embedded.warmstart import TASK_MIXES, fingerprint

    mix = {"add": 0.5, "sub": 0.5}  # family names both tasks have
    arith = fingerprint("llama-char", mix, 0, "arith", target_accuracy=0.65)
    worked = fingerprint("llama-char", mix, 0, "worked", target_accuracy=0.65)
    assert arith != worked
    assert arith == fingerprint("llama-char", mix, 0, target_accuracy=0.65)  # arith is the default
    assert set(TASK_MIXES) == set(TASKS)
    for task, mixes in TASK_MIXES.items():
        for mix in mixes.values():
            assert set(mix) <= set(TASKS[task].families)


def test_demo_settings_take_the_tasks_response_limit():
    from graftrl.experiments.compare.task import DEFAULT, demo_settings

    assert DEFAULT.task == DEFAULT_TASK and DEFAULT.max_new_tokens == get_task(DEFAULT_TASK).max_new_tokens
    worked = demo_settings("worked")
    assert worked.task == "worked" and worked.max_new_tokens == WORKED.max_new_tokens
    assert demo_settings("worked", quick=True).steps < worked.steps
    assert demo_settings("arith").max_new_tokens == TASKS["arith"].max_new_tokens


def test_tiny_worked_warm_start_report(tmp_path):
    pytest.importorskip("torch")
    from graftrl.embedded.warmstart import REPORT_NAME, warm_start

    # 3 steps and one check: the task reaches the model size, the report and the check's verifier
    report = warm_start(
        "gpt2-bpe",
        {"add_carry": 1.0},
        tmp_path / "m",
        target_accuracy=1.1,
        max_steps=3,
        check_every_steps=3,
        check_problems=4,
        task="worked",
    )
    saved = json.loads((tmp_path / "m" / REPORT_NAME).read_text())
    assert saved["task"] == "worked" and report["steps"] == 3
    assert set(saved["accuracy"]) == {"add_carry", "all"}
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["n_positions"] == WORKED.max_positions


@pytest.mark.parametrize("command", ["demo", "compare"])
def test_cli_rejects_an_unknown_task(command):
    from graftrl.cli import app

    result = CliRunner().invoke(app, [command, "--task", "algebra"])
    assert result.exit_code == 2
    assert "not an embedded task" in result.output and "worked" in result.output


def test_demo_diagnostics_report_the_all_fail_share():
    from graftrl.reporting.diagnostics import summarize_exchange
    from graftrl.reporting.render import diagnostics_table

    rows = [
        {
            "model": "a",
            "all_fail_frac": 0.25,
            "complementarity/b": 0.5,
            "peer_responses": 8,
            "peer_admitted": 6,
        },
        {
            "model": "a",
            "all_fail_frac": 0.75,
            "complementarity/b": None,
            "peer_responses": 0,
            "peer_admitted": 0,
        },
    ]
    summary = summarize_exchange({"graft seed 0": rows})["graft"]["a"]
    assert summary["all_fail_mean"] == 0.5 and summary["complementarity_mean"] == 0.5
    assert summary["admit_rate"] == 0.75
    assert "all-fail share" in [c.header for c in diagnostics_table({"graft": {"a": summary}}).columns]


def test_compare_builds_the_named_embedded_task(tmp_path, monkeypatch):
    from graftrl.experiments.compare import command as compare

    seen: list[tuple] = []

    def fake_embedded_task(out_dir, cache_dir, quick, console, name=DEFAULT_TASK):
        seen.append((quick, name))
        raise compare.CompareError("stop after the task is chosen")

    monkeypatch.setattr(compare, "embedded_task", fake_embedded_task)
    other = next(name for name in TASKS if name != DEFAULT_TASK)
    for name in (other, DEFAULT_TASK):
        with pytest.raises(compare.CompareError, match="stop after"):
            compare.run_compare(tmp_path / name, "table1", quick=True, embedded=name)
    assert seen == [(True, other), (True, DEFAULT_TASK)]


# ----- the error classifier and the fact drills (issue 21) -------------------------------------


@pytest.mark.parametrize(
    ("problem", "response", "outcome"),
    [
        ("37+5", "ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{42}.", "correct"),
        ("37+5", "ones 7+5=12, write 2 carry 0; tens 3+0=3. The answer is \\boxed{32}.", "regrouping"),
        ("37+5", "ones 7+5=12, write 2 carry 1; tens 3+0=3. The answer is \\boxed{32}.", "regrouping"),
        ("37+5", "ones 7+5=12, write 2 carry 1; tens 3+1=5. The answer is \\boxed{52}.", "regrouping"),
        ("37+5", "ones 7+5=11, write 1 carry 1; tens 3+1=4. The answer is \\boxed{41}.", "fact"),
        ("37+5", "ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{24}.", "copy"),
        ("37+5", "ones 7+6=13, write 3 carry 1; tens 3+1=4. The answer is \\boxed{43}.", "copy"),
        ("32+5", "ones 2+5=7, write 7 carry 1; tens 3+1=4. The answer is \\boxed{47}.", "regrouping"),
        ("132-5", "ones 12-5=7, write 7 borrow 1; tens 13-1=12. The answer is \\boxed{127}.", "correct"),
        ("132-5", "ones 2-5=7, write 7 borrow 1; tens 13-1=12. The answer is \\boxed{127}.", "regrouping"),
        ("132-5", "ones 12-5=7, write 7 borrow 0; tens 13-0=13. The answer is \\boxed{137}.", "regrouping"),
        ("132-5", "ones 12-5=6, write 6 borrow 1; tens 13-1=12. The answer is \\boxed{126}.", "fact"),
        ("132-5", "ones 12-5=7. The answer is \\boxed{7}.", "format"),
        ("132-5", "", "format"),
    ],
)
def test_classify_worked_names_the_first_wrong_step(problem, response, outcome):
    from graftrl.embedded.task import classify_worked

    assert classify_worked(problem, response) == outcome


def test_every_supervised_solution_classifies_as_correct():
    from graftrl.embedded.task import classify_worked

    for p in make_problems(None, 400, seed=11, task="worked"):
        assert classify_worked(p.problem, supervised_text(p, "worked")) == "correct", p


def test_fact_drills_are_warm_start_only_and_never_a_real_problem():
    """Drills are drawn only when a mix names them; their problems never occur in the families."""
    drills = make_problems({"add_fact": 1, "sub_fact": 1}, 80, seed=2, task="worked")  # of 90
    assert {p.family for p in drills} == {"add_fact", "sub_fact"}
    real = {p.problem for p in make_problems(None, 3000, seed=2, task="worked")}
    for p in drills:
        assert p.problem not in real and str(eval(p.problem)) == p.answer
        assert (
            supervised_text(p, "worked")
            == f"ones {p.problem}={p.answer}. The answer is \\boxed{{{p.answer}}}."
        )
        left, right = (int(x) for x in re.split(r"[+-]", p.problem))
        assert (left % 10 + right >= 10) if "+" in p.problem else (left - 10 < right and 10 <= left <= 19)
    assert "add_fact" not in {p.family for p in make_problems(None, 2000, seed=3, task="worked")}
