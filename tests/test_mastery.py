"""`graftrl sweep --knob mastery` (issue 21): the drilled pairs' mixes, the map's cells and report."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

import graftrl.experiments.mastery as mastery
import graftrl.experiments.sweep as sweep
from graftrl.cli import app
from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.warmstart import (
    MASTERY_DEFICIT_SHARE,
    MASTERY_DRILL_SHARE,
    TASK_MIXES,
    fingerprint,
    mastery_mixes,
)
from graftrl.training.trainer import Trainer

LLAMA, GPT2 = MODEL_SPECS


def test_mastery_moves_each_models_own_regrouping_share_and_adds_the_drills():
    assert mastery_mixes("worked", "default") == TASK_MIXES["worked"]
    own = {LLAMA: "add_carry", GPT2: "sub_borrow"}  # the step the other model lacks
    deficit = {LLAMA: "sub_borrow", GPT2: "add_carry"}
    prints = set()
    for point in ("0.45", "0.08", "0.03"):
        mixes = mastery_mixes("worked", point)
        for name, mix in mixes.items():
            base = TASK_MIXES["worked"][name]
            assert mix[own[name]] == float(point) and mix[deficit[name]] == MASTERY_DEFICIT_SHARE
            assert MASTERY_DEFICIT_SHARE < 0.025  # below what taught a drilled model the step
            assert mix["add_fact"] == mix["sub_fact"] == MASTERY_DRILL_SHARE / 2
            # the no-regrouping families as in the task's pair
            assert {f: w for f, w in mix.items() if f in ("add", "sub")} == {
                f: w for f, w in base.items() if f in ("add", "sub")
            }
            prints.add(fingerprint(name, mix, 0, "worked"))
    assert len(prints) == 6  # every point warm-starts (and caches) its own pair
    for bad in ("0", "1.5", "x"):
        with pytest.raises(ValueError):
            mastery_mixes("worked", bad)
    with pytest.raises(ValueError, match="no fact drills"):
        mastery_mixes("arith", "0.1")


def test_points_are_ordered_and_checked():
    assert mastery.check_points(["0.04", "default", "0.45"]) == ["default", "0.45", "0.04"]
    for bad, says in ((["0.1", "0.1"], "each point once"), (["2"], "in (0, 1]"), ([], "at least one")):
        result = CliRunner().invoke(app, ["sweep", "--knob", "mastery", "--points", ",".join(bad)])
        assert result.exit_code == 2 and says in result.output, result.output
    result = CliRunner().invoke(app, ["sweep", "--knob", "skill"])
    assert result.exit_code == 2 and "--knob" in result.output


def test_the_map_trains_four_rules_per_point_reports_them_and_resumes(tiny_task, tmp_path, monkeypatch):
    trained: list[str] = []
    original_train = Trainer.train

    def counting_train(self, *args, **kwargs):
        trained.append(f"{self.run_dir.parents[1].name}/{self.run_dir.name}")
        return original_train(self, *args, **kwargs)

    mixes_asked: list[dict] = []

    def fake_embedded_task(out_dir, cache_dir, quick, console, name, mixes, warmstart, pin_dir):
        assert pin_dir == out_dir / mastery.PINNED_MODELS  # each point pins its starting weights
        mixes_asked.append(mixes)
        assert warmstart is None  # --quick: the quick warm-start, whatever the point
        return tiny_task

    monkeypatch.setattr(Trainer, "train", counting_train)
    monkeypatch.setattr(sweep, "embedded_task", fake_embedded_task)  # the sweeps' one driver
    out = tmp_path / "map"
    args = [
        "sweep",
        "--knob",
        "mastery",
        "--points",
        "0.08,default",
        "--seeds",
        "1",
        "--out",
        str(out),
        "--quick",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert mixes_asked == [mastery_mixes("worked", "default"), mastery_mixes("worked", "0.08")]
    assert trained == [
        f"mastery-{point}/{variant}-seed0"
        for point in ("default", "0.08")
        for variant in ("grpo", "graft", "success-only", "sgt")
    ]
    results = json.loads((out / "results.json").read_text())
    assert results["points"] == ["default", "0.08"]
    for summary in results["summaries"]:
        rows = json.loads((out / f"mastery-{summary['point']}" / "results.json").read_text())["rows"]
        for model, stats in summary["models"].items():
            score = {r["variant"]: r["pass_at_1"] for r in rows if r["model"] == model and r["seed"] == 0}
            assert stats["vs_grpo"]["graft"]["mean"] == pytest.approx(score["graft"] - score["grpo"])
            assert stats["vs_graft"]["success-only"]["mean"] == pytest.approx(
                score["success-only"] - score["graft"]
            )
            assert stats["vs_graft"]["sgt"]["mean"] == pytest.approx(score["sgt"] - score["graft"])
            assert 0.0 <= stats["all_fail_share"] <= 1.0
    # GRAFT's and success-only's cells log the transferred texts (the error classes read them)
    for variant, logs in (("graft", True), ("success-only", True), ("grpo", False), ("sgt", False)):
        config = yaml.safe_load(
            (out / "mastery-default" / "runs" / f"{variant}-seed0" / "config.yaml").read_text()
        )
        assert config["logging"]["log_transfers"] is logs, variant
    report = (out / "report.md").read_text()
    for heading in (
        "## Held-out pass@1",
        "## The receiver's deficit family",
        "## What the moved groups carried",
        "## The demo's default (issue 21's rule)",
    ):
        assert heading in report
    assert (out / "mastery.png").stat().st_size > 1000
    assert [row["point"] for row in results["demo_default"]["points"]] == ["default", "0.08"]

    trained.clear()
    assert CliRunner().invoke(app, args).exit_code == 0
    assert trained == []


def _receiver(all_fail=0.3, compl=0.9, admitted=0.6, regrouping=0.6, low=0.01):
    return {
        "all_fail_share": all_fail,
        "complementarity": compl,
        "admitted_share": admitted,
        "moved_errors": None if regrouping is None else {"regrouping": regrouping},
        "vs_grpo": {"graft": {"mean": low + 0.02, "low": low, "high": low + 0.04}},
    }


def test_the_demo_default_rule_reads_the_regime_first_and_needs_every_seed():
    good = {"point": "0.03", "models": {"a": _receiver(), "b": _receiver(regrouping=0.7)}}
    assert mastery.regime_misses(good["models"]["a"]) == []
    assert mastery.regime_misses(_receiver(all_fail=0.61, regrouping=None)) == [
        "all_fail_share",
        "regrouping_share",
    ]
    assert mastery.regime_misses(_receiver(admitted=0.4, regrouping=0.5)) == []  # bounds are inclusive

    decided = mastery.demo_default([good], seeds=5, seeds_planned=5)
    assert decided["point"] == "0.03" and decided["points"][0]["min_regrouping_share"] == 0.6
    assert mastery.demo_default([good], seeds=3, seeds_planned=5)["point"] is None  # pending
    pending = mastery.demo_default([good], seeds=2, seeds_planned=2)  # --seeds 2 does not decide it
    assert pending["point"] is None and pending["status"] == "pending: 2 of 5 seeds at every point"

    # a point that misses a regime target is never chosen, however far GRAFT is above GRPO
    gated = {"point": "0.45", "models": {"a": _receiver(admitted=0.32, low=0.2), "b": _receiver(low=0.2)}}
    decision = mastery.demo_default([gated], seeds=5, seeds_planned=5)
    assert decision["point"] is None and decision["points"][0]["regime_misses"]["a"] == ["admitted_share"]
    # an interval touching 0 on one model does not qualify
    touching = {"point": "0.08", "models": {"a": _receiver(), "b": _receiver(low=0.0)}}
    assert mastery.demo_default([touching], seeds=5, seeds_planned=5)["point"] is None
    # several qualifying points: the regime (smallest regrouping share, larger wins) decides, not pass@1
    sharper = {
        "point": "0.08",
        "models": {"a": _receiver(regrouping=0.8, low=0.001), "b": _receiver(regrouping=0.65)},
    }
    assert mastery.demo_default([good, sharper], seeds=5, seeds_planned=5)["point"] == "0.08"


def test_the_hint_preset_adds_hint_rows_corrected_together_across_the_line(tiny_task, tmp_path, monkeypatch):
    from graftrl.evaluation.decisions import holm

    monkeypatch.setattr(sweep, "embedded_task", lambda *args, **kwargs: tiny_task)
    out = tmp_path / "line"
    args = ["sweep", "--knob", "mastery", "--preset", "hint", "--points", "default,0.08"]
    result = CliRunner().invoke(app, [*args, "--seeds", "2", "--out", str(out), "--quick"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    family = []
    for summary in results["summaries"]:
        rows = json.loads((out / f"mastery-{summary['point']}" / "results.json").read_text())["rows"]
        score = {(r["variant"], r["model"], r["seed"]): r["pass_at_1"] for r in rows}
        vs = summary["hint"]["vs"]
        assert {(row["versus"], row["receiver"]) for row in vs} == {
            (ref, model) for ref in ("grpo", "graft", "success-only", "sgt") for model in summary["models"]
        }
        for row in vs:  # hint minus each reference, paired by seed
            deltas = [
                score[("hint", row["receiver"], s)] - score[(row["versus"], row["receiver"], s)]
                for s in (0, 1)
            ]
            assert row["mean"] == pytest.approx(sum(deltas) / 2) and row["n"] == 2
        family += vs
        assert set(summary["hint"]["rescue"]) <= set(summary["models"])
    # one family over the line: Holm's adjusted p-values of every hint row, together
    tested = [row for row in family if row["p"] is not None]
    assert tested
    assert [row["adjusted_p"] for row in tested] == pytest.approx(holm([row["p"] for row in tested]))
    assert all(row["survives"] == (row["adjusted_p"] <= 0.05) for row in tested)
    report = (out / "report.md").read_text()
    assert "## The peer in the prompt (hint) against the peer in the gradient" in report
    assert f"Holm-corrected over the line's {len(tested)} comparisons of the first four columns" in report


def test_the_rescue_summary_counts_the_rounds_and_classifies_the_wrong_hinted_responses(tmp_path):
    from graftrl.evaluation.benchmarks import write_problems
    from graftrl.experiments.mastery_hint import rescue_summary
    from graftrl.storage.data import MathProblem
    from graftrl.storage.rundir import RunDir

    problems = [MathProblem("p0", "37+5", "42"), MathProblem("p1", "50-3", "47")]
    write_problems(problems, tmp_path / "train.jsonl")
    run = RunDir(tmp_path / "hint-seed0")
    run.root.mkdir()
    run.config.write_text(yaml.safe_dump({"data": {"train": str(tmp_path / "train.jsonl")}}))
    metrics = [
        {"step": 0, "model": "a", "rescue_attempted": 2.0, "rescue_solved": 1.0, "rescue_truncated": 2.0,
         "rescue_skipped": 1.0},
        {"step": 1, "model": "a", "rescue_attempted": 0.0, "rescue_solved": 0.0, "rescue_truncated": 0.0,
         "rescue_skipped": 0.0},
    ]  # fmt: skip
    run.metrics.write_text("".join(json.dumps(row) + "\n" for row in metrics))
    carry_forgotten = "ones 7+5=12, write 2 carry 0; tens 3+0=3. The answer is \\boxed{32}."
    right = "ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{42}."
    responses = [("p0", carry_forgotten, 0.0), ("p0", right, 1.0), ("p1", "no idea", 0.0), ("p1", "?", 0.0)]
    run.rescues.write_text(
        "".join(
            json.dumps({"step": 0, "receiver": "a", "source": "b", "prompt_id": pid, "index": i, "reward": reward,
                        "hinted": "x\nHint: y\n", "response": text}) + "\n"
            for i, (pid, text, reward) in enumerate(responses)
        )
    )  # fmt: skip
    summary = rescue_summary([run.root])["a"]
    assert summary["prompts_per_step"] == 1.0  # 2 prompts over 2 steps
    assert summary["rescue_rate"] == 0.5 and summary["hinted_accuracy"] == 0.25
    assert summary["hint_cut_share"] == pytest.approx(2 / 3) and summary["skipped_share"] == pytest.approx(
        1 / 3
    )
    assert summary["wrong_responses"] == 3
    assert summary["wrong_errors"]["regrouping"] == pytest.approx(1 / 3)
    assert summary["wrong_errors"]["format"] == pytest.approx(2 / 3)


def test_prepare_writes_each_points_models_and_config_and_trains_nothing(tiny_task, tmp_path, monkeypatch):
    asked: list[str] = []
    trained: list[str] = []
    monkeypatch.setattr(Trainer, "train", lambda self, *a, **k: trained.append(self.run_dir.name))
    monkeypatch.setattr(
        sweep, "embedded_task", lambda out_dir, *args, **kwargs: asked.append(out_dir.name) or tiny_task
    )
    out = tmp_path / "new"
    args = ["sweep", "--knob", "mastery", "--points", "0.2,0.01", "--out", str(out), "--prepare"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert asked == ["mastery-0.2", "mastery-0.01"] and trained == []
    flat = result.output.replace("\n", "")
    for point in ("0.2", "0.01"):
        assert str(out / f"mastery-{point}" / "data" / "config.yaml") in flat
    assert not (out / "results.json").exists()


def test_the_rule_preset_is_the_mastery_presets_grpo_and_graft_cells():
    from graftrl.experiments.matrix import preset_matrix

    rule, full = preset_matrix("rule"), preset_matrix("mastery")
    # the same variants, so the same cells by digest: a later `--preset mastery` reuses them
    assert rule.variants == full.variants[:2] and [v.name for v in rule.variants] == ["grpo", "graft"]
    assert (rule.baseline, rule.reference) == (full.baseline, full.reference)
