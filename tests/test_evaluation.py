"""`graftrl eval`: estimators, benchmarks, reports, validation during training, best checkpoints."""

from __future__ import annotations

import json
import math
import statistics
import sys
import types
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict
from graftrl.evaluation.benchmarks import (
    BUILTIN_BENCHMARKS,
    BenchmarkError,
    load_benchmark,
    load_benchmarks,
    parse_benchmark_spec,
    write_problems,
)
from graftrl.evaluation.evaluate import (
    EvalProtocol,
    ModelTarget,
    _aggregate,
    evaluate_pass_at_1,
    evaluate_targets,
    markdown_table,
    mean_std,
    pass_at_k,
    resolve_targets,
    summarize_benchmark,
    write_report,
)
from graftrl.storage.data import load_problems
from graftrl.training.trainer import Trainer

PROBLEMS = load_problems(FIXTURES / "math_small.jsonl")


class AnswerVerifier:
    """Scores 1.0 exactly when the gold answer is in ``correct`` (whatever the model wrote)."""

    def __init__(self, correct: set[str]) -> None:
        self.correct = correct
        self.answers = 0

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        self.answers += len(responses)
        return [1.0 if a in self.correct else 0.0 for a in answers]

    def stats(self) -> dict[str, float]:
        return {"answers": self.answers, "seconds": 0.5, "timeouts": 0, "verified": 0, "errors": 0}


# ----- estimators ---------------------------------------------------------------------------


def test_pass_at_k_hand_computed():
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - math.comb(6, 2) / math.comb(8, 2))  # 1 - 15/28
    assert pass_at_k(8, 2, 2) == pytest.approx(13 / 28)
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 5, 4) == 1.0  # fewer than k failures: every k-subset holds a success
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(8, 2, 9)
    with pytest.raises(ValueError):
        pass_at_k(8, 9, 1)


def test_summarize_benchmark_pass_at_1_and_k():
    correct = [[1, 1, 0, 0, 0, 0, 0, 0], [1] * 8, [0] * 8, [1, 0, 0, 0, 0, 0, 0, 0]]
    summary = summarize_benchmark(correct)
    assert summary["pass_at_1"] == pytest.approx((2 / 8 + 1 + 0 + 1 / 8) / 4)
    assert summary["pass_at_k"]["1"] == pytest.approx(summary["pass_at_1"])
    expected_2 = (pass_at_k(8, 2, 2) + 1 + 0 + pass_at_k(8, 1, 2)) / 4
    assert summary["pass_at_k"]["2"] == pytest.approx(expected_2)
    assert summary["pass_at_k"]["8"] == pytest.approx(3 / 4)
    assert list(summary["pass_at_k"]) == [str(k) for k in range(1, 9)]


def test_mean_std_over_runs_and_unweighted_aggregate():
    stat = mean_std([0.30, 0.34, 0.32, 0.36, 0.28])
    assert stat["mean"] == pytest.approx(0.32)
    assert stat["std"] == pytest.approx(statistics.stdev([0.30, 0.34, 0.32, 0.36, 0.28]))
    assert mean_std([0.5])["std"] == 0.0
    # Two benchmarks of very different sizes: the aggregate ignores the sizes.
    big = [summarize_benchmark([[1, 0]] * 100), summarize_benchmark([[0, 0]] * 100)]  # 0.5, 0.0
    small = [summarize_benchmark([[1, 1]]), summarize_benchmark([[1, 0]])]  # 1.0, 0.5
    per_bench = {"big": {"runs": big}, "small": {"runs": small}}
    agg = _aggregate(per_bench, runs=2)
    assert agg["pass_at_1"]["runs"] == pytest.approx([0.75, 0.25])
    assert agg["pass_at_1"]["mean"] == pytest.approx(0.5)
    assert agg["pass_at_1"]["std"] == pytest.approx(statistics.stdev([0.75, 0.25]))
    assert agg["pass_at_k"]["2"]["runs"] == pytest.approx([(1.0 + 1.0) / 2, (0.0 + 1.0) / 2])


# ----- benchmarks ---------------------------------------------------------------------------


def test_benchmark_specs(tmp_path):
    source = parse_benchmark_spec(f"MATH500={FIXTURES / 'math_small.jsonl'}")
    assert source.name == "MATH500" and source.path == FIXTURES / "math_small.jsonl"
    assert parse_benchmark_spec(str(FIXTURES / "math_small.parquet")).name == "math_small"
    for alias in ("MATH500", "math-500", "math500"):
        assert parse_benchmark_spec(alias).hub == BUILTIN_BENCHMARKS["MATH500"]
    assert parse_benchmark_spec("aime24").name == "AIME2024"
    assert parse_benchmark_spec("minerva_math").name == "Minerva"
    hub = parse_benchmark_spec("mine=someone/set:validation").hub
    assert hub is not None and (hub.dataset, hub.split) == ("someone/set", "validation")
    with pytest.raises(BenchmarkError, match="unknown benchmark 'nonsense'"):
        parse_benchmark_spec("nonsense")
    with pytest.raises(BenchmarkError, match="not found"):
        load_benchmark(f"x={tmp_path / 'missing.jsonl'}")
    loaded = load_benchmark(f"small={FIXTURES / 'math_small.parquet'}", max_problems=3)
    assert loaded.name == "small" and [p.id for p in loaded.problems] == ["add-1", "frac-1", "neg-1"]
    with pytest.raises(BenchmarkError, match="unique"):
        load_benchmarks([str(FIXTURES / "math_small.jsonl"), str(FIXTURES / "math_small.parquet")])


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_builtin_name_offline_error_says_how_to_pass_a_file(monkeypatch, variable):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv(variable, "1")
    with pytest.raises(BenchmarkError) as info:
        load_benchmark("MATH500")
    message = str(info.value)
    assert "offline" in message and "HuggingFaceH4/MATH-500" in message
    assert "--benchmark MATH500=path/to/math500.jsonl" in message


def test_missing_datasets_package_and_failed_download(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(BenchmarkError, match=r"pip install -e '\.\[hub\]'.*--benchmark AMC23="):
        load_benchmark("AMC23")

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(BenchmarkError, match=r"could not be loaded.*--benchmark AIME2025="):
        load_benchmark("AIME2025")


def test_hub_fields_are_mapped(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return [{"id": 7, "question": "What is 13 + 14?", "answer": 27.0, "url": "u"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    benchmark = load_benchmark("AMC23")
    assert calls == [("math-ai/amc23", None, "test")]
    assert benchmark.name == "AMC23" and benchmark.source == "hf://math-ai/amc23:test"
    (problem,) = benchmark.problems
    assert (problem.id, problem.problem, problem.answer) == ("AMC23-7", "What is 13 + 14?", "27")


# ----- whole evaluation path on the tiny checkpoints -----------------------------------------


def _targets(paths) -> list[ModelTarget]:
    return [
        ModelTarget("llama", str(paths["llama"]), "llama", template="{problem}="),
        ModelTarget("gpt2", str(paths["gpt2"]), "gpt2", template="Q: {problem}\nA: "),
    ]


def test_report_layout_table_and_plot(tiny_checkpoints, tmp_path):
    a = write_problems(PROBLEMS[:4], tmp_path / "a.jsonl")  # one of four has the answer 57
    b = write_problems([PROBLEMS[0], PROBLEMS[2]], tmp_path / "b.jsonl")  # one of two
    benchmarks = load_benchmarks([f"A={a}", f"B={b}"])
    protocol = EvalProtocol(samples=3, max_new_tokens=3, runs=2, seed=5, prompt_suffix=None)
    report = evaluate_targets(
        _targets(tiny_checkpoints), benchmarks, AnswerVerifier({"57"}), protocol, progress=False
    )
    assert list(report["models"]) == ["llama", "gpt2"]
    assert report["protocol"]["seeds"] == [5, 6] and report["protocol"]["ks"] == [1, 2, 3]
    assert [b["name"] for b in report["benchmarks"]] == ["A", "B"]
    assert report["ids"]["B"] == ["add-1", "neg-1"]
    model = report["models"]["gpt2"]
    assert model["path"] == str(tiny_checkpoints["gpt2"])
    bench = model["benchmarks"]["A"]
    assert [run["seed"] for run in bench["runs"]] == [5, 6]
    assert bench["runs"][0]["correct"] == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert bench["pass_at_1"] == {"mean": 0.25, "std": 0.0, "runs": [0.25, 0.25]}
    assert set(bench["pass_at_k"]) == {"1", "2", "3"}
    assert model["benchmarks"]["B"]["pass_at_1"]["mean"] == 0.5
    # Unweighted over benchmarks (a problem-weighted mean would be 2/6).
    assert model["aggregate"]["pass_at_1"]["mean"] == pytest.approx(0.375)
    assert report["verification"]["answers"] == 2 * 2 * (4 + 2) * 3

    paths = write_report(report, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["models"]["llama"]["aggregate"]["pass_at_1"]["mean"] == 0.375
    table = paths["markdown"].read_text().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| Model |"))
    assert table[header] == "| Model | A | B | Avg. |"
    assert table[header + 1] == "|---|---|---|---|"
    assert table[header + 2] == "| llama | 25.00 ± 0.00 | 50.00 ± 0.00 | 37.50 ± 0.00 |"
    assert table[header + 3] == "| gpt2 | 25.00 ± 0.00 | 50.00 ± 0.00 | 37.50 ± 0.00 |"
    assert "| Model | pass@1 | pass@2 | pass@3 |" in table
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_cells_are_mean_pm_std_in_percent():
    report = {
        "protocol": {
            "samples": 8,
            "temperature": 0.6,
            "top_p": 0.95,
            "max_new_tokens": 4096,
            "runs": 5,
            "ks": [1],
        },
        "benchmarks": [{"name": "MATH500"}, {"name": "AIME2024"}],
        "models": {
            "smollm3 (best, step 85)": {
                "benchmarks": {
                    "MATH500": {"pass_at_1": {"mean": 0.7686, "std": 0.0032}},
                    "AIME2024": {"pass_at_1": {"mean": 0.14416, "std": 0.01494}},
                },
                "aggregate": {
                    "pass_at_1": {"mean": 0.45638, "std": 0.0067},
                    "pass_at_k": {"1": {"mean": 0.45638, "std": 0.0067}},
                },
            }
        },
    }
    lines = markdown_table(report).splitlines()
    assert "| Model | MATH500 | AIME2024 | Avg. |" in lines
    assert "| smollm3 (best, step 85) | 76.86 ± 0.32 | 14.42 ± 1.49 | 45.64 ± 0.67 |" in lines


def test_evaluate_pass_at_1_is_unchanged_for_the_demo(tiny_checkpoints):
    from graftrl.models.policy import Policy

    policy = Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]), template="{problem}=")
    protocol = EvalProtocol(samples=2, max_new_tokens=3)
    result = evaluate_pass_at_1(policy, PROBLEMS[:3], AnswerVerifier({"57", "-5"}), protocol, seed=1)
    assert result == {"pass_at_1": pytest.approx(2 / 3), "per_problem": [1.0, 0.0, 1.0]}


# ----- validation during training, --best ---------------------------------------------------


def _training_config(paths, tmp_path: Path) -> dict:
    small = write_problems(PROBLEMS[:3], tmp_path / "val_small.jsonl")
    return {
        "method": "grpo",
        "seed": 1,
        "policies": [
            {"name": "llama", "path": str(paths["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(paths["gpt2"]), "template": "Q: {problem}\nA: "},
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "train": {"steps": 2, "batch_prompts": 3, "minibatch_prompts": 3, "micro_batch_size": 6},
        "optim": {"lr": 1e-2},
        "logging": {"progress": False, "log_samples": 0},
        "validation": {"files": {"small": str(small)}, "every": 1, "samples": 2, "max_new_tokens": 4},
    }


def test_validation_writes_rows_and_best_then_eval_best(tiny_checkpoints, tmp_path, monkeypatch):
    config = config_from_dict(_training_config(tiny_checkpoints, tmp_path))
    verifier = AnswerVerifier({"57"})  # validation problems: 57, 3/4, -5 -> aggregate 1/3
    seen_at_callback: list[list[int]] = []

    def callback(step, metrics):
        path = tmp_path / "run" / "validation.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        seen_at_callback.append(sorted({r["step"] for r in rows}))
        if step == 1:
            verifier.correct.add("-5")  # the second validation scores 2/3: a new best

    trainer = Trainer(config, tmp_path / "run", verifier=verifier, step_callback=callback)
    assert trainer.validator is not None
    trainer.train()
    # The validator runs right after the step callback: at step 1's callback only step 0 is in.
    assert seen_at_callback == [[], [0]]

    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "validation.jsonl").read_text().splitlines()]
    assert [(r["step"], r["model"]) for r in rows] == [(0, "llama"), (0, "gpt2"), (1, "llama"), (1, "gpt2")]
    assert [r["aggregate"] for r in rows] == pytest.approx([1 / 3, 1 / 3, 2 / 3, 2 / 3])
    assert all(r["pass_at_1/small"] == r["aggregate"] and r["time_validation"] > 0 for r in rows)
    assert [r["best"] for r in rows] == [True, True, True, True]
    best = json.loads((run / "best" / "best.json").read_text())
    assert best == {
        name: {"step": 1, "completed_steps": 2, "aggregate": pytest.approx(2 / 3)}
        for name in ("llama", "gpt2")
    }
    from safetensors.torch import load_file

    for policy in trainer.policies:  # the best (replaced at step 1) holds the final weights
        folder = run / "best" / policy.name
        assert (folder / "config.json").is_file()
        saved = {k: v for shard in folder.glob("*.safetensors") for k, v in load_file(str(shard)).items()}
        assert saved and all(torch.equal(v, policy.model.state_dict()[k]) for k, v in saved.items())
    assert sorted(p.name for p in (run / "best").iterdir()) == ["best.json", "gpt2", "llama"]
    # Validation is outside the step: the step's own timings do not include it.
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("time_validation" not in m for m in metrics)

    # An equal aggregate never replaces the best (the same rule for every method).
    again = trainer.validator.validate(1, trainer.policies)
    assert [r["best"] for r in again] == [False, False]

    plan = resolve_targets(run, best=True)
    assert [t.label for t in plan.targets] == ["llama (best, 2 steps)", "gpt2 (best, 2 steps)"]
    assert plan.targets[1].template == "Q: {problem}\nA: " and plan.config is not None
    assert plan.default_out == run / "eval-best"
    latest = resolve_targets(run)
    assert [t.completed_steps for t in latest.targets] == [2, 2]
    assert latest.targets[0].path == str(run / "checkpoints" / "step_000002" / "llama")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(run),
            "--best",
            "--benchmark",
            f"small={tmp_path / 'val_small.jsonl'}",
            "--max-problems",
            "2",
            "--runs",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "4",
            "--workers",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "answers/s" in result.output or "answers in" in result.output
    report = json.loads((out / "eval.json").read_text())
    assert list(report["models"]) == ["llama (best, 2 steps)", "gpt2 (best, 2 steps)"]
    assert report["protocol"]["runs"] == 2 and report["protocol"]["max_new_tokens"] == 4
    assert report["protocol"]["prompt_suffix"] is None  # the run's own data suffix
    assert report["verification"]["answers"] == 2 * 2 * 2 * 2  # models x runs x problems x samples
    assert (out / "eval.md").is_file() and (out / "eval.png").is_file()


def test_eval_cli_errors(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runner = CliRunner()
    result = runner.invoke(app, ["eval", str(tiny_checkpoints["llama"]), "--benchmark", "MATH500"])
    assert result.exit_code == 2
    assert "--benchmark MATH500=" in " ".join(result.output.split())
    result = runner.invoke(app, ["eval", str(tmp_path), "--benchmark", str(FIXTURES / "math_small.jsonl")])
    assert result.exit_code == 2 and "neither a run directory" in " ".join(result.output.split())
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        json.dumps(
            {
                "method": "grpo",
                "policies": [{"name": "a", "path": "x"}],
                "data": {"train": "missing.jsonl"},
            }
        )
    )
    result = runner.invoke(app, ["eval", str(run), "--best", "-b", str(FIXTURES / "math_small.jsonl")])
    assert result.exit_code == 2 and "validation.files" in " ".join(result.output.split())


def test_pass_at_1_by_family_hand_values():
    from graftrl.evaluation.evaluate import pass_at_1_by_family
    from graftrl.storage.data import MathProblem

    problems = [
        MathProblem("p0", "1+1", "2", family="add"),
        MathProblem("p1", "2+2", "4", family="add"),
        MathProblem("p2", "3-1", "2", family="sub"),
        MathProblem("p3", "5*5", "25"),  # no family: in the overall score only
    ]
    assert pass_at_1_by_family(problems, [1.0, 0.5, 0.25, 1.0]) == {"add": 0.75, "sub": 0.25}
    assert pass_at_1_by_family(problems[3:], [1.0]) == {}
