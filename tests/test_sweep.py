"""`graftrl sweep`: the skill-overlap knob, the seed-major resumable run and its outputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import graftrl.experiments.sweep as sweep
from graftrl.cli import app
from graftrl.embedded.mixes import TASK_MIXES, overlap_mixes
from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.warmstart import fingerprint
from graftrl.reporting.provenance import written_by
from graftrl.training.trainer import Trainer

LLAMA, GPT2 = MODEL_SPECS


@pytest.mark.parametrize("task", sorted(TASK_MIXES))
def test_overlap_moves_the_second_models_mix_towards_the_firsts(task):
    own = TASK_MIXES[task]
    # 0 is the task's own pair, value for value: the demo's cached models are the sweep's first point
    assert overlap_mixes(task, 0.0) == own
    assert fingerprint(GPT2, overlap_mixes(task, 0.0)[GPT2], 0, task) == fingerprint(GPT2, own[GPT2], 0, task)
    same = overlap_mixes(task, 1.0)
    assert same[LLAMA] == own[LLAMA] and same[GPT2] == own[LLAMA]
    for overlap in (0.33, 0.5, 0.67):
        mixes = overlap_mixes(task, overlap)
        assert mixes[LLAMA] == own[LLAMA]
        assert sum(mixes[GPT2].values()) == pytest.approx(1.0)
        for family, weight in mixes[GPT2].items():
            expected = (1 - overlap) * own[GPT2].get(family, 0.0) + overlap * own[LLAMA].get(family, 0.0)
            assert weight == pytest.approx(expected, abs=1e-6)
    # each point warm-starts (and caches) its own GPT-2
    prints = {fingerprint(GPT2, overlap_mixes(task, o)[GPT2], 0, task) for o in (0.0, 0.33, 0.67, 1.0)}
    assert len(prints) == 4
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        overlap_mixes(task, 1.5)


def test_sweep_runs_seed_major_reports_paired_differences_and_resumes(tiny_task, tmp_path, monkeypatch):
    trained: list[str] = []
    mixes_asked: list[dict] = []
    original_train = Trainer.train

    def counting_train(self, *args, **kwargs):
        trained.append(f"{self.run_dir.parents[1].name}/{self.run_dir.name}")
        return original_train(self, *args, **kwargs)

    def fake_embedded_task(out_dir, cache_dir, quick, console, name, mixes, warmstart=None):
        mixes_asked.append(mixes)
        return tiny_task

    written: list[int] = []
    original_write = sweep.write_sweep

    def recording_write(done):
        written.append(done.seeds_done)
        return original_write(done)

    monkeypatch.setattr(Trainer, "train", counting_train)
    monkeypatch.setattr(sweep, "embedded_task", fake_embedded_task)
    monkeypatch.setattr(sweep, "OVERLAP", dataclasses.replace(sweep.OVERLAP, write=recording_write))
    out = tmp_path / "sweep"
    args = ["sweep", "--overlaps", "1,0", "--seeds", "2", "--out", str(out), "--quick"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert mixes_asked == [overlap_mixes("worked", 0.0), overlap_mixes("worked", 1.0)]
    # seed 0 at every point before seed 1: an interrupted sweep already has a curve
    assert trained == [
        "overlap-0/grpo-seed0",
        "overlap-0/graft-seed0",
        "overlap-1/grpo-seed0",
        "overlap-1/graft-seed0",
        "overlap-0/grpo-seed1",
        "overlap-0/graft-seed1",
        "overlap-1/grpo-seed1",
        "overlap-1/graft-seed1",
    ]
    assert written == [1, 2]  # the figure after every round of seeds, not only at the end
    results = json.loads((out / "results.json").read_text())
    assert results["overlaps"] == [0.0, 1.0] and results["seeds"] == results["seeds_planned"] == 2
    assert [p["overlap"] for p in results["points"]] == [0.0, 1.0]
    for point in results["points"]:
        rows = json.loads((out / f"overlap-{point['overlap']:g}" / "results.json").read_text())["rows"]
        assert set(point["models"]) == {"llama", "gpt2"}
        for model, stats in point["models"].items():
            by_seed = {
                variant: {
                    r["seed"]: r["pass_at_1"] for r in rows if r["variant"] == variant and r["model"] == model
                }
                for variant in ("grpo", "graft")
            }
            diffs = [by_seed["graft"][s] - by_seed["grpo"][s] for s in (0, 1)]
            paired = stats["graft_minus_grpo"]
            assert paired["n"] == 2 and paired["mean"] == pytest.approx(sum(diffs) / 2)
            assert paired["low"] <= paired["mean"] <= paired["high"]
            assert stats["grpo_pass_at_1"]["mean"] == pytest.approx(sum(by_seed["grpo"].values()) / 2)
            assert 0.0 <= stats["all_fail_share"] <= 1.0
            assert stats["groups_moved_per_step"] >= 0.0
    report = (out / "report.md").read_text()
    assert report.count("| llama |") == 2 and report.count("| gpt2 |") == 2
    assert report.splitlines()[2] == written_by(results["provenance"]) + (
        "; each point's cells, starting weights and warm-start fingerprints are in its "
        "`overlap-<o>/results.json`."
    )
    assert (out / "sweep.png").stat().st_size > 1000

    trained.clear()  # everything finished: a rerun trains nothing and writes the same points
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert trained == []
    assert json.loads((out / "results.json").read_text())["points"] == results["points"]
