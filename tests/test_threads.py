"""The CLI's torch thread choice: an equal share of the CPUs, `--threads` / GRAFTRL_THREADS to override."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from typer.testing import CliRunner

import graftrl.cli.common as cli_common
from graftrl.cli import app
from graftrl.machine import available_cpus, contention_note, torch_threads

FIXTURES = Path(__file__).parent / "fixtures"


def test_threads_are_an_equal_share_of_the_cpus():
    assert torch_threads(2) == 2
    assert torch_threads(2, processes=2) == 1
    assert torch_threads(16, processes=3) == 5
    assert torch_threads(2, processes=4) == 1  # never 0
    assert torch_threads(2, processes=2, requested=3) == 3  # --threads wins
    assert available_cpus() >= 1


def test_contention_note_only_when_threads_exceed_the_free_cpus():
    assert contention_note(threads=1, cpus=2, load=5.0) is None  # one thread cannot spin-wait
    assert contention_note(threads=2, cpus=2, load=0.2) is None  # idle machine
    assert contention_note(threads=4, cpus=16, load=3.0) is None
    note = contention_note(threads=2, cpus=2, load=1.1)
    assert note is not None and "--threads 1" in note and "GRAFTRL_THREADS=1" in note
    assert "--threads 2" in contention_note(threads=4, cpus=4, load=2.0)


def _bad_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"policies": [{"name": "a", "path": "/x"}], "optim": {"nope": 1}}))
    return str(path)


def test_cli_sets_the_requested_threads(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, ["--threads", "2", "train", _bad_config(tmp_path)])
        assert result.exit_code == 2 and "optim.nope" in result.output  # the config error, after setup
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("GRAFTRL_THREADS", "3")
        CliRunner().invoke(app, ["train", _bad_config(tmp_path)])
        assert torch.get_num_threads() == 3
        monkeypatch.delenv("GRAFTRL_THREADS")
        # The default never raises torch's own count (the test session runs 1 thread).
        torch.set_num_threads(1)
        CliRunner().invoke(app, ["train", _bad_config(tmp_path)])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_note_is_printed_once_the_run_starts(tiny_checkpoints, tmp_path, monkeypatch):
    """A bad config ends in its one error line; a run that starts prints the contention note first."""
    monkeypatch.delenv("GRAFTRL_THREADS", raising=False)  # a thread count set by hand silences the note
    monkeypatch.setattr(cli_common, "contention_note", lambda threads, cpus, load: "the CPUs are busy")
    result = CliRunner().invoke(app, ["train", _bad_config(tmp_path)])
    assert result.exit_code == 2 and "busy" not in result.output
    config = {
        "method": "grpo",
        "policies": [{"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="}],
        "data": {"train": str(FIXTURES / "math_small.parquet")},
        "rollout": {"n": 2, "max_new_tokens": 4},
        "train": {"steps": 1, "batch_prompts": 2, "minibatch_prompts": 2},
        "logging": {"progress": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["train", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "note: the CPUs are busy"
