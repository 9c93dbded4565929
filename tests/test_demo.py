"""`graftrl demo` end to end: warm-start (cached), GRPO and GRAFT, held-out pass@1, plots."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.embedded.shipped import REBUILD_ENV

ROW_KEYS = {"method", "model", "seed", "n", "pass_at_1", "steps", "wall_s"}
PLOTS = ("training_curves.png", "complementarity.png", "compatibility_hist.png", "pass_at_1.png")


def run_demo_cli(tmp_path, *args, cache=None):
    out = tmp_path / "demo"
    cache = cache or tmp_path / "cache"
    result = CliRunner().invoke(app, ["demo", "--out", str(out), "--cache", str(cache), *args])
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "results.json").read_text()), result.output


def check_outputs(out, results, seeds):
    rows = results["rows"]
    assert all(set(row) >= ROW_KEYS for row in rows)
    assert {(r["method"], r["model"], r["seed"]) for r in rows if r["method"] != "warm-start"} == {
        (m, model, s) for m in ("grpo", "graft") for model in ("llama-char", "gpt2-bpe") for s in range(seeds)
    }
    assert all(0.0 <= r["pass_at_1"] <= 1.0 for r in rows)
    for name in PLOTS:
        assert (out / name).stat().st_size > 1000, name
    for seed in range(seeds):
        for method in ("grpo", "graft"):
            assert (out / "runs" / f"{method}-seed{seed}" / "metrics.jsonl").exists()


def test_quick_demo(tmp_path):
    # the original task, by name (its families are add and sub)
    out, results, output = run_demo_cli(tmp_path, "--quick", "--task", "arith")
    check_outputs(out, results, seeds=1)
    assert "held-out pass@1" in output
    # the embedded problems carry their family: pass@1 and training reward per family
    assert "held-out pass@1 per problem family" in output
    for row in results["rows"]:
        assert set(row["per_family"]) == {"add", "sub"} and all(
            0 <= v <= 1 for v in row["per_family"].values()
        )
    # a row of panels per model, a panel per family: 2 x 2 panels of 5 x 3.6 inches at 120 dpi
    assert plt.imread(out / "family_curves.png").shape[:2] == (2 * 432, 2 * 600)
    metrics = [
        json.loads(line) for line in (out / "runs" / "graft-seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all({"family_reward/add", "family_reward/sub"} <= set(m) for m in metrics)
    # a second run reuses the cached warm-started models
    first = sorted(p.name for p in (tmp_path / "cache").iterdir())
    run_demo_cli(tmp_path, "--quick", "--task", "arith")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == first


@pytest.mark.slow
def test_full_demo_shows_an_exchange(tmp_path, fresh_embedded_cache, monkeypatch):
    # the session's cache: the default pair is warm-started once for the slow tier (here, or in
    # the provenance test when it ran first), not installed from the shipped copy, so that the
    # provenance test checks a warm-start of this code's
    monkeypatch.setenv(REBUILD_ENV, "1")
    out, results, _ = run_demo_cli(tmp_path, "--seeds", "1", cache=fresh_embedded_cache)
    check_outputs(out, results, seeds=1)
    graft = results["diagnostics"]["graft"]
    for model in ("llama-char", "gpt2-bpe"):
        # both directions have complementary prompts, and the gate admits some of the transfers
        assert graft[model]["complementarity_mean"] > 0
        assert graft[model]["transferred_responses"] > 0
        assert 0 < graft[model]["admitted_responses"] <= graft[model]["transferred_responses"]
