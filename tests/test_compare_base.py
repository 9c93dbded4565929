"""`graftrl compare --base CONFIG`: a matrix on any config, evaluated with the paper's protocol on
named benchmarks, reported in the paper's layout; bad input gets one line; cells by name.

The pair is real and heterogeneous (``conftest.build_qwen2_llama_pair``: a Qwen2 with a byte-level
BPE and a Llama with a Unigram tokenizer, both trained here), the data and benchmarks are JSONL
files and the verifier is graftrl's (math_verify extraction, so the random models' last number
is sometimes the sum and pass@1 is not 0).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from conftest import write_sums
from scipy.stats import t as student_t
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.experiments.cells import CLOCK

VARIANTS = [{"variant": "grpo", "method": "grpo"}, {"variant": "graft", "method": "graft"}]


def base_config(pair: dict[str, Path], root: Path, steps: int = 2, **sections) -> Path:
    """A two-policy run on the pair: n = 4, ``steps`` steps of 4 prompts, a checkpoint per step."""
    config = {
        "method": "grpo",
        "policies": [
            {"name": "qwen", "path": str(pair["qwen"]), "template": "Q: {problem}\nA: "},
            {"name": "llama", "path": str(pair["llama"]), "template": "{problem}="},
        ],
        "data": {"train": str(write_sums(root / "train.jsonl", 24, 0, "t")), "prompt_suffix": None},
        "rollout": {"n": 4, "max_new_tokens": 6},
        "train": {"steps": steps, "batch_prompts": 4, "minibatch_prompts": 2},
        "optim": {"lr": 1e-2},
        "reward": {"extraction": "math_verify"},
        "checkpoint": {"every": 1},
        "logging": {"progress": False, "log_samples": 1},
        **sections,
    }
    path = root / "base.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def matrix_file(root: Path, variants: list[dict] = VARIANTS) -> Path:
    path = root / "matrix.yaml"
    path.write_text(yaml.safe_dump({"variants": variants, "baseline": variants[0]["variant"]}))
    return path


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


def pct(values: list[float]) -> str:
    mean, std = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def paired(treatment: list[float], control: list[float]) -> str:
    """The paired t interval, written out here rather than taken from graftrl.evaluation.stats."""
    d = [a - b for a, b in zip(treatment, control, strict=True)]
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    half = float(student_t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
    star = " *" if mean - half > 0 or mean + half < 0 else ""
    return f"{100 * mean:+.2f} [{100 * (mean - half):+.2f}, {100 * (mean + half):+.2f}]{star}"


def test_a_two_by_two_matrix_on_a_base_config_gives_the_papers_table(qwen2_llama_pair, tmp_path):
    """2 variants x 2 seeds on two benchmarks: every number of the paper-layout table and its paired
    intervals equals a recount from the cells' done.json files; the compute columns sit beside."""
    benches = {
        "easy": write_sums(tmp_path / "easy.jsonl", 6, 1, "e"),
        "hard": write_sums(tmp_path / "hard.jsonl", 6, 2, "h"),
    }
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--base",
        str(base_config(qwen2_llama_pair, tmp_path)),
        "--matrix",
        str(matrix_file(tmp_path)),
    ]
    # the seed-only intervals, recounted below (the default's over seeds x problems: test_intervals.py)
    args += ["--seeds", "2", "--eval-samples", "4", "--out", str(out), "--seed-intervals"]
    args += [arg for name, path in benches.items() for arg in ("--bench", f"{name}={path}")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    done = {
        (variant, seed): json.loads((out / "runs" / f"{variant}-seed{seed}" / "done.json").read_text())
        for variant in ("grpo", "graft")
        for seed in (0, 1)
    }
    report = (out / "report.md").read_text()
    assert "## Table 1: pass@1 per benchmark and Avg., Δ vs grpo" in report
    assert "easy (6 problems), hard (6 problems): 4 samples per problem at T = 0.6, top-p 0.95" in report
    scores: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (variant, _), cell in sorted(done.items(), key=lambda item: item[0][1]):  # seed order
        for row in cell["rows"]:
            bench = row["per_benchmark"]
            assert row["pass_at_1"] == pytest.approx(statistics.fmean([bench["easy"], bench["hard"]]))
            by = scores.setdefault((row["model"], variant), {"easy": [], "hard": [], "avg": []})
            for column, value in (*bench.items(), ("avg", row["pass_at_1"])):
                by[column].append(value)
    assert any(v for by in scores.values() for values in by.values() for v in values), "every pass@1 is 0"
    for model in ("llama", "qwen"):
        grpo, graft = scores[(model, "grpo")], scores[(model, "graft")]
        gap = statistics.fmean(graft["avg"]) - statistics.fmean(grpo["avg"])
        rollouts = statistics.fmean(done[("graft", s)]["rollouts_per_model"] for s in (0, 1))
        cpu = statistics.fmean(done[("graft", s)]["train_cpu_s"] for s in (0, 1))
        row = f"| {model} | graft | {pct(graft['easy'])} | {pct(graft['hard'])} | {pct(graft['avg'])} | {100 * gap:+.2f} | graft |"
        assert row in report, (row, report)
        line = next(line for line in report.splitlines() if line.startswith(row))
        assert f"| {rollouts:,.0f} |" in line and f"| {cpu:.1f} |" in line
        # the verifier's share of a step, from the cells' logged time_reward / time_step
        seconds = [done[("graft", s)] for s in (0, 1)]
        share = sum(d["reward_s_per_model"] for d in seconds) / sum(d["step_s_per_model"] for d in seconds)
        assert line.endswith(f"| {100 * share:.1f} |")
        assert (
            f"| {model} | **grpo** | {pct(grpo['easy'])} | {pct(grpo['hard'])} | {pct(grpo['avg'])} | — |"
            in report
        )
        intervals = [paired(graft[c], grpo[c]) for c in ("easy", "hard", "avg")]
        assert f"| {model} | graft | {' | '.join(intervals)} | seeds |" in report
    header = next(line for line in report.splitlines() if line.startswith("| model | variant | easy (%)"))
    assert header.split(" | ")[2:5] == ["easy (%)", "hard (%)", "Avg. (%)"]
    assert "rollouts/model" in header and "optimizer steps/model" in header and "train CPU (s/seed)" in header
    results = json.loads((out / "results.json").read_text())
    assert results["base"]["config"].endswith("base.yaml") and set(results["settings"]["benchmarks"]) == {
        "easy",
        "hard",
    }
    assert "per_benchmark" in (out / "results.csv").read_text().splitlines()[0]
    # the clock that keeps a resumed cell's compute: a row per training step
    assert [
        row["step"]
        for row in map(json.loads, (out / "runs" / "graft-seed0" / CLOCK).read_text().splitlines())
    ] == [0, 1]


def test_a_validating_base_is_evaluated_on_each_policys_best_checkpoint(qwen2_llama_pair, tmp_path):
    """No --bench: the validation benchmarks; the best checkpoint by validation average
    (``RUN/best/``), the steps behind it recorded in the row."""
    from graftrl.evaluation.targets import ModelTarget
    from graftrl.experiments.cells import Verifiers, cell_config
    from graftrl.experiments.compare.task import base_task, evaluate_cell
    from graftrl.experiments.matrix import Variant

    check = write_sums(tmp_path / "check.jsonl", 6, 3, "c")
    validation = {"files": {"check": str(check)}, "every": 1, "samples": 4}
    base = base_config(qwen2_llama_pair, tmp_path, steps=3, validation=validation)
    matrix = matrix_file(tmp_path, VARIANTS[:1])
    out = tmp_path / "cmp"
    args = ["compare", "--base", str(base), "--matrix", str(matrix), "--eval-samples", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = out / "runs" / "grpo-seed0"
    best = json.loads((run / "best" / "best.json").read_text())
    rows = json.loads((run / "done.json").read_text())["rows"]
    assert {row["model"]: row["checkpoint_steps"] for row in rows} == {
        name: entry["completed_steps"] for name, entry in best.items()
    }
    task = base_task(base, eval_samples=4)
    config = cell_config(task, Variant("grpo", "grpo"), 0, None)
    policies = [ModelTarget.of_policy(p, path=str(run / "best" / p.name)).load() for p in config.policies]
    with Verifiers() as verifiers:
        again = evaluate_cell(policies, task.evaluation, config, verifiers(config.reward), seed=0)
    assert {row["model"]: row["pass_at_1"] for row in rows} == {m: s["pass_at_1"] for m, s in again.items()}
    assert "best checkpoint by validation average" in (out / "report.md").read_text()


def test_bad_input_is_one_line_naming_the_field_or_file_and_trains_nothing(qwen2_llama_pair, tmp_path):
    base = base_config(qwen2_llama_pair, tmp_path)
    out = tmp_path / "cmp"
    runner = CliRunner()

    nothing = runner.invoke(app, ["compare", "--base", str(base), "--preset", "demo", "--out", str(out)])
    assert nothing.exit_code == 2
    line = one_error_line(nothing.output)
    assert str(base) in line and "validation.files" in line and "--bench" in line

    bench = f"b={write_sums(tmp_path / 'b.jsonl', 4, 1, 'b')}"
    typo = matrix_file(
        tmp_path, [*VARIANTS, {"variant": "nope", "method": "graft", "set": {"graft.nope": 1}}]
    )
    wrong = runner.invoke(
        app, ["compare", "--base", str(base), "--matrix", str(typo), "--bench", bench, "--out", str(out)]
    )
    assert wrong.exit_code == 2
    line = one_error_line(wrong.output)
    assert "variant 'nope'" in line and "graft.nope: unknown key" in line

    missing = runner.invoke(
        app, ["compare", "--base", str(base), "--bench", "b=no/such.jsonl", "--out", str(out)]
    )
    assert missing.exit_code == 2 and "no/such.jsonl" in one_error_line(missing.output)

    matrix = matrix_file(tmp_path)
    common = ["compare", "--base", str(base), "--matrix", str(matrix), "--bench", bench, "--seeds", "2"]
    listed = runner.invoke(app, [*common, "--list-cells"])
    assert listed.exit_code == 0
    assert listed.output.split() == ["warm-start", "grpo-seed0", "graft-seed0", "grpo-seed1", "graft-seed1"]
    stray = runner.invoke(app, [*common, "--only-cell", "graft-seed2", "--out", str(out)])
    assert stray.exit_code == 2
    line = one_error_line(stray.output)
    assert "--only-cell 'graft-seed2'" in line and "--list-cells" in line
    assert not (out / "runs").exists()  # nothing trained, nothing evaluated


def test_a_slurm_array_trains_one_cell_per_job_and_the_report_only_job_aggregates(qwen2_llama_pair, tmp_path):
    bench = f"b={write_sums(tmp_path / 'b.jsonl', 4, 1, 'b')}"
    out = tmp_path / "cmp"
    common = ["compare", "--base", str(base_config(qwen2_llama_pair, tmp_path)), "--matrix"]
    common += [str(matrix_file(tmp_path)), "--bench", bench, "--eval-samples", "2", "--out", str(out)]
    runner = CliRunner()
    for cell in ("graft-seed0", "warm-start"):  # two jobs of the array
        result = runner.invoke(app, [*common, "--only-cell", cell])
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["graft-seed0", "warm-start"]
    assert not (out / "report.md").exists() and not (out / "results.json").exists()
    report = runner.invoke(app, [*common, "--report-only"])
    assert report.exit_code == 0, report.output
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(row["variant"], row["seed"]) for row in rows} == {("warm-start", 0), ("graft", 0)}
    assert "Not run yet: grpo." in (out / "report.md").read_text()
