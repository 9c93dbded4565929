"""A compare cell's identity is what it was trained from (docs/robustness.md, "Compare cells").

Every case edits the inputs of a finished (or interrupted) `graftrl compare --base` cell in place,
as a user would, and reruns the same command on the real Qwen2 / Llama pair
(``conftest.build_qwen2_llama_pair``, copied per test so it can be retrained in place): the cell is
retrained from step 0 when what it trains from changed, re-evaluated when only the benchmark
did, continued when a folder moved with its content unchanged, and each case says so in one line.
A retrained or re-evaluated cell equals a fresh compare on the new inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import comparable_metrics, write_sums
from test_compare_base import VARIANTS, base_config, matrix_file, one_error_line
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.experiments.cells import MEASURED_FIELDS

CELL = "grpo-seed0"


def setup(pair: dict[str, Path], root: Path, variants: list[dict] = VARIANTS[:1]) -> list[str]:
    """The pair copied under ``root``, a 2-step base config on it and the compare arguments
    (``--out root/cmp`` last)."""
    models = {name: shutil.copytree(path, root / "models" / name) for name, path in pair.items()}
    bench = write_sums(root / "bench.jsonl", 4, 1, "b")
    args = ["compare", "--base", str(base_config(models, root)), "--matrix", str(matrix_file(root, variants))]
    return [*args, "--bench", f"b={bench}", "--eval-samples", "2", "--out", str(root / "cmp")]


def run(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def outcome(out: Path, cell: str = CELL) -> dict:
    """What a cell's results are made of: its marker (wall-clock aside) and its training's metrics."""
    folder = out / "runs" / cell
    done = json.loads((folder / "done.json").read_text())
    done["rows"] = [{k: v for k, v in row.items() if k not in MEASURED_FIELDS} for row in done["rows"]]
    return {
        "done": {k: v for k, v in done.items() if k not in MEASURED_FIELDS},
        "metrics": comparable_metrics(folder),
    }


def fresh(args: list[str], root: Path, name: str = "control") -> dict:
    """The same compare into a new folder: the cell as it is when trained from the start."""
    out = root / name
    run([*args[:-1], str(out)])
    return outcome(out)


def test_a_policy_retrained_in_place_retrains_the_cell_from_step_0(qwen2_llama_pair, tmp_path):
    args = setup(qwen2_llama_pair, tmp_path)
    out = tmp_path / "cmp"
    run(args)
    before = outcome(out)
    # qwen retrained in place: its folder now holds the weights the cell trained it to
    trained = out / "runs" / CELL / "checkpoints" / "step_000002" / "qwen"
    for weights in trained.glob("*.safetensors"):
        shutil.copy(weights, tmp_path / "models" / "qwen" / weights.name)

    output = run(args)
    assert (
        "grpo seed 0: the starting weights of qwen changed since it was trained: retraining it from step 0"
        in output
    )
    assert "continuing" not in output
    assert json.loads((out / "results.json").read_text())["ran"] == [CELL]
    after = outcome(out)
    assert after != before
    assert after == fresh(args, tmp_path)  # a run from the new weights, not the old run restamped


def test_training_data_edited_in_place_retrains_the_cell_instead_of_a_dead_end(qwen2_llama_pair, tmp_path):
    args = setup(qwen2_llama_pair, tmp_path)
    out = tmp_path / "cmp"
    run(args)
    write_sums(tmp_path / "train.jsonl", 24, 5, "t")  # other problems, the same file

    output = run(args)  # was: error: --resume: data.train ... changed ...; ... or pass --force
    assert (
        "grpo seed 0: data.train's content changed since it was trained: retraining it from step 0" in output
    )
    assert "--force" not in output and "--resume" not in output
    assert outcome(out) == fresh(args, tmp_path)


def test_a_config_change_names_the_keys_and_a_cell_without_a_record_starts_over(qwen2_llama_pair, tmp_path):
    args = setup(qwen2_llama_pair, tmp_path)
    out = tmp_path / "cmp"
    run(args)
    output = run([*args, "--set", "optim.lr=0.02"])
    assert (
        "grpo seed 0: config key optim.lr changed since it was trained: retraining it from step 0" in output
    )
    # a cell folder that does not say what it was trained from (its record damaged) is never continued
    (out / "runs" / CELL / "cell.json").write_bytes(b"\xff{ damaged")
    (out / "runs" / CELL / "done.json").unlink()
    output = run([*args, "--set", "optim.lr=0.02"])
    assert "grpo seed 0: " in output and "does not record what it was trained from" in output
    assert "continuing" not in output
    assert json.loads((out / "results.json").read_text())["ran"] == [CELL]


def test_a_benchmark_only_change_re_evaluates_the_cell_without_retraining(qwen2_llama_pair, tmp_path):
    args = setup(qwen2_llama_pair, tmp_path)
    out = tmp_path / "cmp"
    run(args)
    cell = out / "runs" / CELL
    metrics, manifest = (
        (cell / "metrics.jsonl").read_bytes(),
        (cell / "checkpoints" / "step_000002" / "manifest.json").read_bytes(),
    )
    write_sums(tmp_path / "bench.jsonl", 4, 7, "b")  # the benchmark edited in place

    output = run(args)
    assert "grpo seed 0: its evaluation changed, its training did not: re-evaluating it" in output
    assert "retraining" not in output
    assert (cell / "metrics.jsonl").read_bytes() == metrics  # no step trained again
    assert (cell / "checkpoints" / "step_000002" / "manifest.json").read_bytes() == manifest
    assert outcome(out) == fresh(args, tmp_path)

    # a copy made by --reuse keeps no weights to evaluate again: it retrains, saying so
    copy = [*args[:-1], str(tmp_path / "copy")]
    assert "the same cell finished in" in run([*copy, "--reuse", str(out)])
    write_sums(tmp_path / "bench.jsonl", 4, 9, "b")
    output = run(copy)
    assert "grpo seed 0: " in output and "keeps no checkpoint to evaluate again" in output
    assert outcome(tmp_path / "copy") == fresh(args, tmp_path, "control-2")


def test_an_interrupted_matrix_moved_with_its_models_and_data_continues(qwen2_llama_pair, tmp_path):
    """Content digests, not paths: the models, data, benchmark and output folder all moved."""
    old, new = tmp_path / "old", tmp_path / "new"
    args = setup(qwen2_llama_pair, old)
    run(args)
    before = outcome(old / "cmp")
    cell = old / "cmp" / "runs" / CELL
    (cell / "done.json").unlink()  # killed after its first step's checkpoint
    shutil.rmtree(cell / "checkpoints" / "step_000002")
    shutil.move(old, new)
    base = new / "base.yaml"
    base.write_text(base.read_text().replace(str(old), str(new)))
    moved = [arg.replace(str(old), str(new)) for arg in args]

    output = run(moved)  # was: error: --resume: the config changes the run's identity ...; or pass --force
    assert "grpo seed 0: continuing from its last checkpoint" in output
    assert "retraining" not in output
    assert outcome(new / "cmp") == before
    assert "grpo seed 0: finished earlier, skipped" in run(moved)


def test_report_only_names_the_cells_not_finished_and_refuses_when_none_is(qwen2_llama_pair, tmp_path):
    args = setup(qwen2_llama_pair, tmp_path, VARIANTS)
    out = tmp_path / "cmp"
    nothing = CliRunner().invoke(app, [*args, "--report-only"])
    assert nothing.exit_code == 2, nothing.output
    line = one_error_line(nothing.output)
    assert "no cell has finished" in line and "grpo-seed0, graft-seed0" in line and "--only-cell" in line
    assert not (out / "report.md").exists() and not (out / "results.json").exists()

    run([*args, "--only-cell", "graft-seed0"])
    some = run([*args, "--report-only"])
    assert "--report-only: not finished: grpo-seed0 (missing from the report" in some
    assert (out / "report.md").exists()
    run([*args, "--only-cell", "grpo-seed0"])
    assert "--report-only: all 2 cells are finished" in run([*args, "--report-only"])


@pytest.mark.parametrize(
    "flags",
    [
        ["--quick"],
        ["--cache", "somewhere"],
        ["--task", "arith"],
        ["--task", "worked"],  # the embedded default, named: still not the --base config's task
        ["--tries", "3"],
        ["--launcher", "ray", "--jobs", "2"],
        ["--report-only", "--jobs", "2"],
        ["--only-cell", CELL, "--launcher", "ray"],
        ["--list-cells", "--report-only"],
    ],
)
def test_a_flag_compare_would_ignore_is_refused_in_one_line(qwen2_llama_pair, tmp_path, flags):
    args = setup(qwen2_llama_pair, tmp_path)
    result = CliRunner().invoke(app, [*args, *flags])
    assert result.exit_code == 2, result.output
    assert flags[0] in one_error_line(result.output) or flags[-2] in one_error_line(result.output)
    assert not (tmp_path / "cmp" / "runs").exists()


def test_a_cell_stopped_by_a_full_disk_names_the_compare_rerun_which_continues_it(
    qwen2_llama_pair, tmp_path, monkeypatch
):
    """The trainer's own remedy is `--resume`, which compare has not: a cell's message says to
    rerun the compare, and that rerun continues the cell to the uninterrupted result."""
    from graftrl.training.worker import PolicyWorker

    args = setup(qwen2_llama_pair, tmp_path)
    save = PolicyWorker.save
    saves: list = []

    def full_at_the_second_checkpoint(self, request):
        saves.append(request)
        if len(saves) <= 2:  # the two policies of checkpoint 1
            return save(self, request)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PolicyWorker, "save", full_at_the_second_checkpoint)
    stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code == 2, stopped.output
    errors = [line for line in stopped.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and stopped.output.rstrip().endswith(errors[0]), stopped.output
    line = errors[0]
    assert "no space left" in line and "step_000001 is intact" in line
    assert "rerun the same `graftrl compare`" in line and "--resume" not in line
    monkeypatch.setattr(PolicyWorker, "save", save)
    assert "grpo seed 0: continuing from its last checkpoint" in run(args)
    assert outcome(tmp_path / "cmp") == fresh(args, tmp_path)


def test_a_cell_whose_checkpoints_are_all_damaged_is_refused_with_a_compare_remedy(
    qwen2_llama_pair, tmp_path
):
    from conftest import flip_byte

    args = setup(qwen2_llama_pair, tmp_path)
    out = tmp_path / "cmp"
    run(args)
    cell = out / "runs" / CELL
    (cell / "done.json").unlink()  # interrupted after its last checkpoint
    for checkpoint in (cell / "checkpoints").iterdir():
        flip_byte(next(checkpoint.glob("qwen/*.safetensors")))
    stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code == 2, stopped.output
    line = one_error_line(stopped.output.split("grpo seed 0: continuing from its last checkpoint\n")[-1])
    assert "no intact checkpoint" in line and "--resume" not in line and "--out" not in line
    assert f"delete {cell} and rerun the same `graftrl compare`" in line
    shutil.rmtree(cell)  # the remedy
    assert "grpo seed 0: 2 steps" in run(args)
    assert outcome(out) == fresh(args, tmp_path)
