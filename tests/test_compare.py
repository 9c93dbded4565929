"""`graftrl compare`: matrices, presets, table arithmetic, outputs and resuming a partial matrix."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import yaml
from conftest import make_config, task_of
from typer.testing import CliRunner

import graftrl.experiments.compare.command as compare
from graftrl.cli import app
from graftrl.config import apply_overrides
from graftrl.evaluation.stats import deltas, summarize
from graftrl.experiments import cells
from graftrl.experiments.cells import cell_config
from graftrl.experiments.compare import exchange as compare_exchange
from graftrl.experiments.compare import report as compare_report
from graftrl.experiments.compare.report import ROW_KEYS
from graftrl.experiments.matrix import (
    CompareError,
    Matrix,
    Variant,
    check_methods,
    parse_matrix,
    preset_matrix,
)
from graftrl.methods import METHODS
from graftrl.reporting.provenance import results_provenance, written_by
from graftrl.reporting.render import table_markdown
from graftrl.storage.rundir import ExperimentDir
from graftrl.training.trainer import Trainer

PLOTS = ("training_curves.png", "pass_at_1.png")


# ----- tables --------------------------------------------------------------------------------

SYNTHETIC = [
    {"variant": "grpo-n8", "method": "grpo", "model": "a", "seed": 0, "pass_at_1": 0.30, "wall_s": 10.0},
    {"variant": "grpo-n8", "method": "grpo", "model": "a", "seed": 1, "pass_at_1": 0.40, "wall_s": 12.0},
    {"variant": "grpo-n8", "method": "grpo", "model": "b", "seed": 0, "pass_at_1": 0.10, "wall_s": 10.0},
    {"variant": "grpo-n8", "method": "grpo", "model": "b", "seed": 1, "pass_at_1": 0.20, "wall_s": 12.0},
    {"variant": "graft", "method": "graft", "model": "a", "seed": 0, "pass_at_1": 0.50, "wall_s": 20.0},
    {"variant": "graft", "method": "graft", "model": "a", "seed": 1, "pass_at_1": 0.60, "wall_s": 22.0},
    {"variant": "graft", "method": "graft", "model": "b", "seed": 0, "pass_at_1": 0.05, "wall_s": 20.0},
    {"variant": "no-gate", "method": "graft", "model": "a", "seed": 0, "pass_at_1": 0.45, "wall_s": 21.0},
]


@pytest.fixture
def trained(monkeypatch) -> list[str]:
    """The run folder names ``Trainer.train`` is called on, in call order (training still runs)."""
    names: list[str] = []
    original_train = Trainer.train

    def counting_train(self, *args, **kwargs):
        names.append(self.run_dir.name)
        return original_train(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train", counting_train)
    return names


def test_table_arithmetic_against_hand_values():
    summary = summarize(SYNTHETIC)
    a = summary["grpo-n8"]["a"]
    assert a["mean"] == pytest.approx(0.35) and a["std"] == pytest.approx(0.0707107, abs=1e-6)
    assert a["seeds"] == 2 and a["wall_s"] == pytest.approx(11.0)
    assert summary["graft"]["b"] == pytest.approx({"mean": 0.05, "std": 0.0, "seeds": 1, "wall_s": 20.0})
    vs_grpo = deltas(summary, "grpo-n8")
    assert vs_grpo["graft"]["a"] == pytest.approx(0.20) and vs_grpo["graft"]["b"] == pytest.approx(-0.10)
    assert vs_grpo["grpo-n8"]["a"] == 0.0
    vs_graft = deltas(summary, "graft")
    assert vs_graft["no-gate"]["a"] == pytest.approx(-0.10)
    assert deltas(summary, None)["graft"]["a"] is None

    table = table_markdown(summary, "grpo-n8", ["grpo-n8", "graft", "no-gate"], {"graft": {"wall": "21.0"}})
    lines = table.splitlines()
    assert lines[0] == "| variant | a pass@1 (%) | Δ a | b pass@1 (%) | Δ b | wall |"
    assert lines[2] == "| **grpo-n8** | 35.00 ± 7.07 | — | 15.00 ± 7.07 | — |  |"
    assert lines[3] == "| graft | 55.00 ± 7.07 | +20.00 | 5.00 ± 0.00 | -10.00 | 21.0 |"
    assert lines[4] == "| no-gate | 45.00 ± 0.00 | +10.00 |  |  |  |"


# ----- matrices ------------------------------------------------------------------------------


def test_parse_matrix_forms_and_errors():
    rows = [
        {"variant": "base", "method": "grpo"},
        {"variant": "g7", "method": "graft", "set": {"graft.delta": 0.7}},
    ]
    plain = parse_matrix(rows)
    assert [v.name for v in plain.variants] == ["base", "g7"] and plain.variants[1].set == {
        "graft.delta": 0.7
    }
    assert plain.baseline_name == "base" and plain.reference_name is None  # no plain graft row
    full = parse_matrix({"variants": rows, "baseline": "base", "reference": "g7"})
    assert (full.baseline_name, full.reference_name) == ("base", "g7")
    bad = [
        ([{"variant": "x", "method": "grpo", "sett": {}}], r"variant 'x': unknown key"),
        ([{"variant": "x y", "method": "grpo"}], r"'variant' must be a name"),
        ([{"variant": "x", "method": "grpo"}, {"variant": "x", "method": "graft"}], "duplicate variant"),
        ([{"variant": "x", "method": "grpo", "set": {"seed": 3}}], r"variant 'x': 'set' may not hold 'seed'"),
        ({"variants": rows, "baseline": "nope"}, "baseline 'nope' is not one of"),
        ([], "non-empty list"),
    ]
    for raw, message in bad:
        with pytest.raises(CompareError, match=message):
            parse_matrix(raw)


def test_presets_and_overrides_build_valid_configs(tiny_task):
    table1 = preset_matrix("table1", batch_prompts=32)
    assert [v.name for v in table1.variants] == ["grpo-n8", "grpo-n16", "grpo-n32", "sgt", "hacpo", "graft"]
    assert table1.variants[1].set == {"rollout.n": 16}
    assert table1.variants[4].set["train.minibatch_prompts"] == 16  # HACPO.recipe, written out
    table2 = preset_matrix("table2")
    assert table2.reference_name == "graft" and len(table2.variants) == 15
    # every preset row whose method is registered yields a valid config on a real task
    for matrix in (preset_matrix("table1", batch_prompts=4), table2):
        for variant in matrix.variants:
            if variant.method in METHODS:
                config = cell_config(tiny_task, variant, seed=2, steps=5)
                assert config.method == variant.method and config.seed == 2 and config.train.steps == 5
    assert cell_config(tiny_task, table1.variants[2], 0, None).rollout.n == 32
    assert cell_config(tiny_task, table1.variants[0], 0, None).rollout.n == 4  # the task's n
    with pytest.raises(CompareError, match="unknown preset"):
        preset_matrix("table3")


def test_unknown_methods_and_keys_name_the_variant(tiny_task, tmp_path):
    with pytest.raises(CompareError, match=r"variant 'mystery': method 'no-such-method' is not registered"):
        check_methods(Matrix([Variant("grpo", "grpo"), Variant("mystery", "no-such-method")]))
    with pytest.raises(CompareError, match=r"(?s)variant 'typo'.*graft\.dleta: unknown key"):
        cell_config(tiny_task, Variant("typo", "graft", {"graft.dleta": 0.5}), 0, None)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump([{"variant": "later", "method": "not-yet-merged"}]))
    result = CliRunner().invoke(app, ["compare", "--matrix", str(matrix), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "variant 'later'" in result.output and "not registered" in result.output
    # values keep their YAML type through apply_overrides, including exponent-only floats
    raw = apply_overrides(
        {}, Variant("v", "grpo", {"a.b": 1e-10, "a.c": False, "a.d": "x y", "a.e": 3}).overrides()
    )
    assert raw == {"a": {"b": 1e-10, "c": False, "d": "x y", "e": 3}}


# ----- the harness ---------------------------------------------------------------------------


def test_compare_writes_everything_and_resumes(tiny_task, tiny_checkpoints, tmp_path, monkeypatch, trained):
    calls = trained
    quick_flags: list[bool] = []

    def fake_embedded_task(out_dir, cache_dir, quick, console):
        quick_flags.append(quick)
        return tiny_task

    monkeypatch.setattr(compare, "embedded_task", fake_embedded_task)
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        yaml.safe_dump(
            [
                {"variant": "grpo-n4", "method": "grpo", "set": {"rollout.n": 4}},
                {"variant": "graft", "method": "graft"},
            ]
        )
    )
    out = tmp_path / "cmp"
    args = ["compare", "--matrix", str(matrix), "--quick", "--seeds", "1", "--out", str(out)]
    args += ["--cache", str(tmp_path / "cache")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert quick_flags == [True]
    assert sorted(calls) == ["graft-seed0", "grpo-n4-seed0"]

    results = json.loads((out / "results.json").read_text())
    assert results["provenance"] == tiny_task.provenance  # the code's commit and starting weights
    rows = results["rows"]
    assert all(set(row) == set(ROW_KEYS) for row in rows)
    assert {(r["variant"], r["method"], r["model"]) for r in rows} == {
        (v, m, model)
        for v, m in (("warm-start", "warm-start"), ("grpo-n4", "grpo"), ("graft", "graft"))
        for model in ("llama", "gpt2")
    }
    trained = [r for r in rows if r["variant"] != "warm-start"]
    assert all(r["n"] == 4 and r["steps"] == 1 and r["seed"] == 0 and r["wall_s"] > 0 for r in trained)
    assert all(0.0 <= r["pass_at_1"] <= 1.0 for r in rows)
    assert results["baseline"] == "grpo-n4" and results["reference"] == "graft"
    with (out / "results.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == list(ROW_KEYS) and len(table) == len(rows)
    report = (out / "report.md").read_text()
    assert "Table 1: pass@1 per model, Δ vs grpo-n4" in report
    assert "Table 2" not in report  # it would mirror Table 1 (see the test below)
    assert "train wall-clock (s/seed)" in report and "rollouts/model" in report
    assert "rows trained/model" in report and "optimizer steps/model" in report
    assert "## Regime and exchange diagnostics" in report and "| graft | llama |" in report
    assert report.splitlines()[2].startswith(written_by(tiny_task.provenance))  # command and commit
    cell = json.loads((out / "runs" / "grpo-n4-seed0" / "done.json").read_text())
    assert cell["optimizer_steps_per_model"] >= 1 and cell["rows_trained_per_model"] >= 1
    for name in PLOTS:
        assert (out / name).stat().st_size > 1000, name
    # the demo's exchange figure for the baseline and the reference variant
    assert (out / "complementarity.png").stat().st_size > 1000
    assert "`complementarity.png` (share of all-fail prompts the peer solves, graft and grpo-n4)" in report

    # a finished cell is skipped; an unfinished one continues from its last checkpoint (here the
    # final one: evaluated again, the same scores), or without one starts over
    grpo_metrics = out / "runs" / "grpo-n4-seed0" / "metrics.jsonl"
    grpo_mtime = grpo_metrics.stat().st_mtime_ns
    graft_dir = out / "runs" / "graft-seed0"

    def measured_apart(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]

    for checkpoints, kept in ((True, True), (False, False)):
        (graft_dir / "done.json").unlink()
        (graft_dir / "leftover.txt").write_text("from the interrupted run")
        if not checkpoints:
            shutil.rmtree(graft_dir / "checkpoints")
        calls.clear()
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert calls == ["graft-seed0"]
        assert ("continuing from its last checkpoint" in result.output) == kept
        assert grpo_metrics.stat().st_mtime_ns == grpo_mtime
        assert (graft_dir / "leftover.txt").exists() == kept and (graft_dir / "done.json").exists()
        rerun = json.loads((out / "results.json").read_text())
        assert rerun["ran"] == ["graft-seed0"]
        assert measured_apart(rerun["rows"]) == measured_apart(rows)
        assert [r for r in rerun["rows"] if r["variant"] == "grpo-n4"] == [
            r for r in rows if r["variant"] == "grpo-n4"
        ]

    # the finished matrix, copied with its models to other folders (a fresh clone, another cache),
    # is recognised there: cells are keyed by the models' and data's content, not their paths
    moved = {
        name: shutil.copytree(path, tmp_path / "moved" / name) for name, path in tiny_checkpoints.items()
    }
    base = make_config(moved, steps=1)
    del base["method"], base["seed"]
    moved_task = task_of(base, tiny_task.evaluation.problems, tiny_task.settings, results_provenance(moved))
    monkeypatch.setattr(compare, "embedded_task", lambda out_dir, cache_dir, quick, console: moved_task)
    shutil.copytree(out, tmp_path / "cmp-moved")
    calls.clear()
    moved_args = [
        *args[: args.index("--out")],
        "--out",
        str(tmp_path / "cmp-moved"),
        *args[args.index("--out") + 2 :],
    ]
    result = CliRunner().invoke(app, moved_args)
    assert result.exit_code == 0, result.output
    assert calls == []


def test_demo_is_the_demo_preset_with_its_own_outputs(tiny_task, tmp_path, monkeypatch, trained):
    """`graftrl demo` runs compare's cells (demo preset) but trains afresh and writes the demo's files."""
    import io

    from rich.console import Console

    from graftrl.experiments.demo import run_demo

    calls = trained
    monkeypatch.setattr(compare, "embedded_task", lambda out_dir, cache_dir, quick, console: tiny_task)
    demo = preset_matrix("demo")
    assert [(v.name, v.method, v.set) for v in demo.variants] == [
        ("grpo", "grpo", {}),
        ("graft", "graft", {}),
    ]
    assert (demo.baseline_name, demo.reference_name) == ("grpo", "graft")

    out = tmp_path / "demo"
    printed = io.StringIO()
    results = run_demo(
        out, quick=True, cache_dir=tmp_path / "cache", console=Console(file=printed, width=200)
    )
    assert set(results) == {"rows", "settings", "diagnostics", "paired_vs_grpo", "total_wall_s", "provenance"}
    # where the numbers came from: the code's commit and each starting model's weights
    assert results["provenance"]["models"].keys() == {"llama", "gpt2"}
    assert all(len(m["weights_sha256"]) == 64 for m in results["provenance"]["models"].values())
    assert json.loads((out / "results.json").read_text()) == results
    rows = results["rows"]
    # run order (warm-start, then each method), the demo's keys (no "variant")
    assert [r["method"] for r in rows] == ["warm-start"] * 2 + ["grpo"] * 2 + ["graft"] * 2
    assert all(
        list(r) == ["method", "model", "seed", "n", "pass_at_1", "per_family", "steps", "wall_s"]
        for r in rows
    )
    assert set(results["diagnostics"]) == {"grpo", "graft"}
    assert set(results["paired_vs_grpo"]) == {"graft"}
    assert results["settings"]["eval_samples"] == tiny_task.settings.eval_samples
    for name in ("training_curves.png", "complementarity.png", "compatibility_hist.png", "pass_at_1.png"):
        assert (out / name).stat().st_size > 1000, name
    assert "graftrl demo" in printed.getvalue() and "exchange diagnostics" in printed.getvalue()
    # compare's files and markers are not the demo's
    assert not (out / "report.md").exists() and not (out / "results.csv").exists()
    assert not (out / "runs" / "warm-start").exists() and not list(out.glob("runs/*/done.json"))
    # a second demo trains every cell again
    run_demo(out, quick=True, cache_dir=tmp_path / "cache", console=Console(file=io.StringIO()))
    assert calls == ["grpo-seed0", "graft-seed0"] * 2


@pytest.mark.slow
def test_quick_compare_on_the_embedded_task(tmp_path):
    """The real `--quick` path: warm-started embedded models, two variants, one seed."""
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        yaml.safe_dump(
            [
                {"variant": "grpo-n4", "method": "grpo", "set": {"rollout.n": 4}},
                {"variant": "graft", "method": "graft"},
            ]
        )
    )
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--matrix",
        str(matrix),
        "--quick",
        "--out",
        str(out),
        "--cache",
        str(tmp_path / "cache"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"warm-start", "grpo-n4", "graft"}
    assert {r["model"] for r in rows} == {"llama-char", "gpt2-bpe"}
    for name in ("report.md", "results.csv", *PLOTS):
        assert (out / name).exists(), name


def test_compute_columns_total_each_models_rollouts_rows_and_optimizer_steps(tmp_path):
    """HACPO trains twice GRPO's rows at equal rollouts: the report shows both, per model."""
    rows = [
        {
            "step": 0,
            "model": "a",
            "train_rows": 64,
            "optimizer_steps": 4,
            "time_step": 2.0,
            "time_reward": 0.5,
        },
        {
            "step": 0,
            "model": "b",
            "train_rows": 32,
            "optimizer_steps": 2,
            "prompts_sampled": 6,
            "time_step": 1.0,
        },
        {
            "step": 1,
            "model": "a",
            "train_rows": 64,
            "optimizer_steps": 4,
            "time_step": 2.0,
            "time_reward": 0.5,
        },
        {
            "step": 1,
            "model": "b",
            "train_rows": 32,
            "optimizer_steps": 2,
            "time_step": 1.0,
            "time_reward": 0.2,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    totals = cells._compute_per_model(tmp_path, batch_prompts=4, n=8)
    assert totals == {
        "rollouts_per_model": ((4 + 4) * 8 + (6 + 4) * 8) / 2,
        "rows_trained_per_model": (128 + 64) / 2,
        "optimizer_steps_per_model": (8 + 4) / 2,
        # seconds of the steps and of their verifying (what a code task's sandbox costs)
        "step_s_per_model": (4.0 + 2.0) / 2,
        "reward_s_per_model": (1.0 + 0.2) / 2,
    }


def test_the_warm_start_scores_do_not_depend_on_the_thread_count(tiny_task, tmp_path):
    """run_compare(jobs > 1) evaluates the warm-start in a worker with its share of the torch
    threads, one after the other with them all: the same scores either way."""
    import io

    import torch
    from rich.console import Console

    threads = torch.get_num_threads()
    quiet = Console(file=io.StringIO())
    scores = []
    try:
        with cells.Verifiers() as verifiers:
            for count in (1, 2):
                torch.set_num_threads(count)
                done = cells.warm_start_cell(tiny_task, tmp_path / str(count), verifiers, quiet, resume=True)
                scores.append(done["rows"])
    finally:
        torch.set_num_threads(threads)
    assert scores[0] == scores[1] and {row["model"] for row in scores[0]} == {
        p["name"] for p in tiny_task.base_config["policies"]
    }
    assert cells.finished_warm_start(tiny_task, tmp_path / "1")["rows"] == scores[0]
    assert cells.finished_warm_start(tiny_task, tmp_path / "none") is None


def test_cells_side_by_side_match_cells_one_after_the_other(tiny_task, tmp_path):
    """--jobs 2 trains cells in two spawned processes: the same rows as one after the other at
    the same thread count, every cell marked done, and a rerun reuses them without a process."""
    import io

    import torch
    from rich.console import Console

    from graftrl.experiments.compare.command import run_compare

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the children get 1 // 2 -> 1 thread: the same reductions
    try:
        matrix = Matrix([Variant("grpo", "grpo"), Variant("graft", "graft")])
        quiet = Console(file=io.StringIO())
        one = run_compare(tmp_path / "one", matrix, seeds=2, task=tiny_task, console=quiet)
        two = run_compare(tmp_path / "two", matrix, seeds=2, task=tiny_task, console=quiet, jobs=2)
        again = run_compare(tmp_path / "two", matrix, seeds=2, task=tiny_task, console=quiet, jobs=2)
    finally:
        torch.set_num_threads(threads)

    def results(run):
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in run["rows"]]

    assert results(two) == results(one) and len(results(one)) == 2 + 2 * 2 * 2
    assert (
        sorted(two["ran"]) == sorted(one["ran"]) == ["graft-seed0", "graft-seed1", "grpo-seed0", "grpo-seed1"]
    )
    assert again["ran"] == [] and results(again) == results(one)
    with pytest.raises(CompareError, match="--jobs"):
        run_compare(tmp_path / "three", matrix, task=tiny_task, console=quiet, jobs=0)


def test_reuse_copies_a_finished_cell_of_the_same_digest_under_its_new_name(
    tiny_task, tmp_path, monkeypatch, trained
):
    import io

    from rich.console import Console

    from graftrl.experiments.compare.command import run_compare

    quiet = Console(file=io.StringIO())
    first = run_compare(tmp_path / "a", Matrix([Variant("grpo-n8", "grpo")]), task=tiny_task, console=quiet)
    trained.clear()
    # the same cell under another name, and one whose config differs (it must train)
    matrix = Matrix([Variant("grpo", "grpo"), Variant("graft", "graft")])
    second = run_compare(tmp_path / "b", matrix, task=tiny_task, console=quiet, reuse=[tmp_path / "a"])
    assert trained == ["graft-seed0"]
    reused = [r for r in second["rows"] if r["variant"] == "grpo"]
    original = [r for r in first["rows"] if r["variant"] == "grpo-n8"]
    assert reused == [{**r, "variant": "grpo"} for r in original] and len(reused) == 2
    copied = tmp_path / "b" / "runs" / "grpo-seed0"
    assert (copied / "metrics.jsonl").read_bytes() == (
        tmp_path / "a" / "runs" / "grpo-n8-seed0" / "metrics.jsonl"
    ).read_bytes()
    assert not (copied / "checkpoints").exists()
    with pytest.raises(CompareError, match="--reuse"):
        run_compare(tmp_path / "c", matrix, task=tiny_task, console=quiet, reuse=[tmp_path / "missing"])


def test_a_cells_digest_ignores_fields_at_their_defaults(tiny_task):
    """A config field added later, at a default that keeps today's behaviour, leaves finished cells
    valid; a value that changes the cell, or CELL_VERSION, changes the digest."""
    from graftrl.experiments.cells import _cell_digest

    plain = Variant("graft", "graft")
    digest = _cell_digest(tiny_task, cell_config(tiny_task, plain, 0, None))
    spelled_out = Variant("graft", "graft", {"rollout.vllm.tensor_parallel_size": 1, "graft.delta": 0.8})
    assert _cell_digest(tiny_task, cell_config(tiny_task, spelled_out, 0, None)) == digest
    changed = Variant("graft", "graft", {"graft.delta": 0.9})
    assert _cell_digest(tiny_task, cell_config(tiny_task, changed, 0, None)) != digest
    assert _cell_digest(tiny_task, cell_config(tiny_task, plain, 1, None)) != digest
    cells.CELL_VERSION += 1
    try:
        assert _cell_digest(tiny_task, cell_config(tiny_task, plain, 0, None)) != digest
    finally:
        cells.CELL_VERSION -= 1


def test_table_2_only_when_ablations_sit_beside_the_reference(tiny_task, tmp_path):
    """With only the baseline beside GRAFT (the demo preset) Table 2 would mirror Table 1."""
    pass_at_1 = {"grpo": 0.50, "graft": 0.55, "no-gate": 0.60}

    def report(variants: list[str]) -> str:
        matrix = Matrix([Variant(v, "grpo" if v == "grpo" else "graft") for v in variants], "grpo", "graft")
        rows = [
            {"variant": v, "method": "x", "model": model, "seed": 0, "pass_at_1": pass_at_1[v], "wall_s": 1.0}
            for v in variants
            for model in ("llama", "gpt2")
        ]
        out = tmp_path / "-".join(variants)
        out.mkdir(exist_ok=True)
        return compare_report.write_report(out, matrix, rows, {}, tiny_task, 1, None, 0.0).read_text()

    assert "## Table 1" in report(["grpo", "graft"]) and "## Table 2" not in report(["grpo", "graft"])
    with_ablation = report(["grpo", "graft", "no-gate"])
    assert "## Table 2: ablations, Δ vs full GRAFT (graft)" in with_ablation
    assert "| no-gate | 60.00 ± 0.00 | +5.00 |" in with_ablation


def test_exchange_tables_gate_every_transfer_and_rebuild_the_advantages_of_whole_groups(tiny_task, tmp_path):
    # n = 4 in the tiny task; one moved group per variant: 3 of 4 correct, every s above the gate
    record = {"step": 0, "receiver": "gpt2", "source": ["llama"] * 4, "s": [0.9] * 4, "reward": [1, 1, 1, 0]}
    matrix = Matrix(
        [
            Variant("graft", "graft"),
            Variant("no-gate", "graft", {"graft.gate": False}),
            Variant("pooled", "graft", {"graft.groups": "pooled"}),
            Variant("success-only", "graft", {"graft.transfer": "success_only"}),
            Variant("hacpo", "hacpo"),
        ]
    )
    for variant in matrix.variants:
        run = ExperimentDir(tmp_path).run(variant.name, 0).root
        run.mkdir(parents=True)
        (run / "compatibility.jsonl").write_text(json.dumps(record) + "\n")
    tables = compare_exchange.exchange_tables(tmp_path, matrix, tiny_task, seeds=1, steps=None)
    gates, masses = tables.gates, tables.masses
    assert list(gates) == [variant.name for variant in matrix.variants]  # every variant logged a transfer
    assert list(masses) == ["graft", "no-gate"]  # pooled / success-only / HACPO train other weights
    assert masses["graft"]["gpt2"].net == pytest.approx(0.0, abs=1e-6)  # one weight for all: sum stays 0
    assert masses["graft"]["gpt2"].correct == pytest.approx(0.9 * masses["no-gate"]["gpt2"].correct)
    assert masses["no-gate"]["gpt2"].net == pytest.approx(0.0, abs=1e-6)
    # the log predates the applied weights: recomputed with each variant's rule, and said so
    assert tables.recomputed == [variant.name for variant in matrix.variants] and not tables.logged_masses
    assert gates["no-gate"]["gpt2"]["correct"].admitted == 3  # w = 1: all in, though the gate passes 3 too
    assert gates["hacpo"]["gpt2"]["wrong"].admitted == 1  # HACPO has no gate


def test_exchange_tables_read_the_logged_weights_of_any_rule(tiny_task, tmp_path):
    """A log with w and A (graftrl's, since issue 23): the tables read what was trained."""
    record = {
        "step": 0,
        "receiver": "gpt2",
        "source": ["llama"] * 4,
        "s": [0.9, 0.5, 0.95, 0.6],
        "reward": [1, 1, 0, 0],
        "w": [0.0, 0.5, 0.95, 0.0],  # random admission: 0.5 drawn in, 0.9 left out
        "admitted": [False, True, True, False],
        "advantage": [0.8, 0.8, -0.8, -0.8],
        "prompt_id": ["p0"] * 4,
    }
    matrix = Matrix([Variant("random-admission", "graft", {"graft.admission": "random"})])
    run = ExperimentDir(tmp_path).run("random-admission", 0).root
    run.mkdir(parents=True)
    (run / "compatibility.jsonl").write_text(json.dumps(record) + "\n")
    tables = compare_exchange.exchange_tables(tmp_path, matrix, tiny_task, seeds=1, steps=None)
    gate = tables.gates["random-admission"]["gpt2"]
    assert (gate["correct"].passed, gate["correct"].admitted) == (1, 1)  # s > 0.8: 0.9; admitted: 0.5
    assert (gate["wrong"].passed, gate["wrong"].admitted) == (1, 1)
    mass = tables.masses["random-admission"]["gpt2"]  # random admission: now from the log
    assert (mass.groups, mass.correct, mass.wrong) == (1, pytest.approx(0.4), pytest.approx(-0.76))
    assert tables.recomputed == [] and tables.logged_masses


def test_report_only_reports_the_finished_cells_and_trains_nothing(tiny_task, tmp_path, monkeypatch, trained):
    monkeypatch.setattr(compare, "embedded_task", lambda out_dir, cache_dir, quick, console: tiny_task)
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "demo", "--quick", "--out", str(out), "--cache", str(tmp_path / "c")]
    assert CliRunner().invoke(app, [*args, "--seeds", "1"]).exit_code == 0
    assert sorted(trained) == ["graft-seed0", "grpo-seed0"]

    trained.clear()  # seeds 1-2 are missing: reported as such, not trained
    result = CliRunner().invoke(app, [*args, "--seeds", "3", "--report-only"])
    assert result.exit_code == 0, result.output
    assert trained == []
    results = json.loads((out / "results.json").read_text())
    assert {r["seed"] for r in results["rows"] if r["variant"] != "warm-start"} == {0}
    report = (out / "report.md").read_text()
    assert "Seeds: 3 per variant (the `seeds` column counts those finished)" in report
    assert "(1 seed)" in report  # one pair: no interval yet
    assert not (out / "runs" / "grpo-seed1").exists()


def test_the_compare_package_still_gives_the_names_of_the_module_it_was():
    import graftrl.experiments.compare as package
    from graftrl.experiments.compare import (
        CompareError,
        CompareReport,
        CompareRun,
        cell_names,
        command,
        run_compare,
        task,
    )

    assert (CompareReport, CompareRun, cell_names, run_compare) == tuple(
        getattr(command, name) for name in package.__all__
    )
    assert CompareError is command.CompareError and package.embedded_task is task.embedded_task
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018
