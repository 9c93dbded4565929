"""`graftrl compare` decides: per-problem results beside each cell, intervals over seeds and
problems (seeds only for older cells), the family's correction, the seeds planned (`--plan`) and
seeds added in rounds (`--seeds auto`), on the tiny task and on a user's `--base` config."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_sums
from test_compare_base import base_config, matrix_file
from typer.testing import CliRunner

import graftrl.experiments.compare.command as compare
from graftrl.cli import app
from graftrl.evaluation.decisions import Sequential
from graftrl.experiments.paired_decisions import CROSSED_SCOPE
from graftrl.reporting.problem_results import PER_PROBLEM, read_problem_results


@pytest.fixture
def tiny(tiny_task, tmp_path, monkeypatch):
    """The compare arguments on the tiny task (the embedded task's report layout), but --seeds."""
    monkeypatch.setattr(compare, "embedded_task", lambda out_dir, cache_dir, quick, console: tiny_task)
    out = tmp_path / "cmp"
    return out, ["compare", "--preset", "demo", "--quick", "--out", str(out), "--cache", str(tmp_path / "c")]


def invoke(*args: str) -> str:
    """The command's stdout (it must succeed)."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_cells_keep_per_problem_results_and_the_report_decides_over_seeds_and_problems(tiny):
    out, args = tiny
    invoke(*args, "--seeds", "2")
    for cell in ("grpo-seed0", "graft-seed1"):
        run = out / "runs" / cell
        done = json.loads((run / "done.json").read_text())
        assert set(done) >= {"digest", "rows"} and "per_problem" not in json.dumps(done)  # an addition
        rates = read_problem_results(run)
        assert rates is not None and json.loads((run / PER_PROBLEM).read_text())["samples"] == 2
        for row in done["rows"]:  # the cell's pass@1 is the mean of its problems' correct rates
            assert np.mean(rates[row["model"]]["heldout"]) == pytest.approx(row["pass_at_1"])
    report = (out / "report.md").read_text()
    assert "seeds × problems" in report and "Family: the 2 paired comparisons" in report
    assert "Holm's step-down" in report and "seeds needed (observed Δ, 80% power)" in report
    assert "Every interval is over seeds only" not in report
    # what the interval is about, said once, and what a fixed benchmark changes
    assert report.count(CROSSED_SCOPE) == 1 and "new seeds and new problems" in CROSSED_SCOPE
    assert "a fixed benchmark" in CROSSED_SCOPE and "--seed-intervals" in CROSSED_SCOPE

    # a cell from before per-problem results: its rows fall back to the interval over seeds
    (out / "runs" / "graft-seed1" / PER_PROBLEM).unlink()
    invoke(*args, "--seeds", "2", "--report-only", "--correction", "bh")
    report = (out / "report.md").read_text()
    assert "Every interval is over seeds only" in report and "Benjamini-Hochberg" in report
    assert CROSSED_SCOPE not in report

    plan = invoke("compare", "--plan", str(out), "--mde", "5")
    assert "a difference of 5 points" in plan and "| graft | grpo |" in plan
    bad = CliRunner().invoke(app, ["compare", "--plan", str(out / "runs"), "--mde", "5"])
    assert bad.exit_code != 0 and "no compare results there" in bad.output
    bad = CliRunner().invoke(app, [*args, "--seeds", "2", "--correction", "sidak"])
    assert bad.exit_code != 0 and "--correction must be one of holm, bh, none" in bad.output


def test_seeds_auto_adds_rounds_until_each_comparison_is_resolved(tiny, monkeypatch):
    out, args = tiny
    invoke(*args, "--seeds", "auto", "--max-seeds", "4")  # nothing resolves after one step: to K
    results = json.loads((out / "results.json").read_text())
    looks = results["rounds"]["looks"]
    assert [look["seeds"] for look in looks] == [3, 4] and results["rounds"]["schedule"] == [3, 4]
    assert {(r["variant"], r["seed"]) for r in results["rows"] if r["variant"] != "warm-start"} == {
        (v, s) for v in ("grpo", "graft") for s in range(4)
    }
    assert "## Seeds added until resolved" in (out / "report.md").read_text()

    # a comparison that crosses its level at the first look stops both variants at 3 seeds
    monkeypatch.setattr(Sequential, "rejects", lambda self, look, p: p is not None)
    fresh = out.parent / "resolved"
    listed = invoke(
        *[a if a != str(out) else str(fresh) for a in args],
        "--seeds",
        "auto",
        "--max-seeds",
        "4",
        "--list-cells",
    )
    assert listed.split() == [f"{v}-seed{s}" for s in range(3) for v in ("grpo", "graft")]
    invoke(*[a if a != str(out) else str(fresh) for a in args], "--seeds", "auto", "--max-seeds", "4")
    results = json.loads((fresh / "results.json").read_text())
    assert len(results["rounds"]["looks"]) == 1 and not (fresh / "runs" / "grpo-seed3").exists()
    assert results["rounds"]["looks"][0]["resolved"]


def test_seeds_auto_on_a_users_config(qwen2_llama_pair, tmp_path):
    base = base_config(qwen2_llama_pair, tmp_path, steps=1)
    bench = write_sums(tmp_path / "bench.jsonl", 6, 1, "b")
    other = write_sums(tmp_path / "other.jsonl", 4, 2, "o")
    out = tmp_path / "cmp"
    args = ["compare", "--base", str(base), "--matrix", str(matrix_file(tmp_path))]
    args += ["--bench", f"sums={bench}", "--bench", f"other={other}"]
    invoke(*args, "--eval-samples", "2", "--seeds", "auto", "--max-seeds", "3", "--out", str(out))
    results = json.loads((out / "results.json").read_text())
    assert results["rounds"]["schedule"] == [3] and len(results["rounds"]["looks"]) == 1
    report = (out / "report.md").read_text()
    assert "seeds × problems" in report and "columns: sums, other, Avg.)" in report
    rates = read_problem_results(out / "runs" / "graft-seed2")
    assert rates is not None and {len(r) for r in rates["qwen"].values()} == {6, 4}
    bad = CliRunner().invoke(app, [*args, "--seeds", "3", "--max-seeds", "4", "--out", str(out)])
    assert bad.exit_code != 0 and "--max-seeds goes with --seeds auto" in bad.output


@pytest.mark.faults
def test_seeds_auto_killed_between_rounds_finishes_as_the_uninterrupted_run(qwen2_llama_pair, tmp_path):
    """kill -9 of `--seeds auto` once its first round (seeds 0-2) is done; the rerun reuses those
    cells, takes the same looks and writes the decisions the uninterrupted run writes."""
    from test_compare_cells import finish, graftrl, kill_group, outcome, wait_for

    base = base_config(qwen2_llama_pair, tmp_path, steps=2)
    bench = write_sums(tmp_path / "bench.jsonl", 6, 1, "b")
    args = [
        "compare",
        "--base",
        str(base),
        "--matrix",
        str(matrix_file(tmp_path)),
        "--bench",
        f"sums={bench}",
    ]
    args += ["--eval-samples", "2", "--seeds", "auto", "--max-seeds", "4"]
    finish(graftrl(*args, "--out", str(tmp_path / "control")))
    out = tmp_path / "killed"
    proc = graftrl(*args, "--out", str(out))
    first_round = [out / "runs" / f"{v}-seed2" / "done.json" for v in ("grpo", "graft")]
    wait_for(lambda: all(marker.exists() for marker in first_round), proc)
    kill_group(proc)
    assert not all((out / "runs" / f"{v}-seed3" / "done.json").exists() for v in ("grpo", "graft"))
    rerun = finish(graftrl(*args, "--out", str(out)))
    assert "grpo seed 0: finished earlier, skipped" in rerun

    def decided(folder):
        results = json.loads((folder / "results.json").read_text())
        report = (folder / "report.md").read_text().splitlines()
        paired = [line for line in report if line.endswith("| seeds × problems |")]
        looks = [line for line in report if line.startswith(("| 1 |", "| 2 |", "Resolved:"))]
        return results["rounds"], paired, looks

    assert decided(out) == decided(tmp_path / "control") and outcome(out) == outcome(tmp_path / "control")


@pytest.mark.slow
def test_seeds_auto_on_the_embedded_base_config(tmp_path):
    """The real embedded task (`--quick`, warm-started models), one step per cell, in rounds."""
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "demo", "--quick", "--steps", "1", "--seeds", "auto", "--max-seeds", "3"]
    invoke(*args, "--out", str(out), "--cache", str(tmp_path / "cache"))
    results = json.loads((out / "results.json").read_text())
    assert results["rounds"]["schedule"] == [3] and results["rounds"]["family"] == 2
    assert read_problem_results(out / "runs" / "graft-seed2") is not None
    assert "seeds × problems" in (out / "report.md").read_text()
