"""Config validation, overrides, and the CLI's error paths."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import FIXTURES
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import ConfigError, apply_overrides, config_from_dict, config_reference, load_config


def minimal(**extra) -> dict:
    return {
        "policies": [{"name": "a", "path": "/models/a"}, {"name": "b", "path": "/models/b"}],
        "data": {"train": str(FIXTURES / "math_small.jsonl")},
        **extra,
    }


def test_defaults_are_the_papers():
    config = config_from_dict(minimal())
    assert config.method == "graft"
    assert (config.train.batch_prompts, config.rollout.n, config.train.minibatch_prompts) == (128, 8, 32)
    assert config.train.update_epochs == 1 and config.optim.lr == 1e-6
    assert (config.train.eps_low, config.train.eps_high, config.graft.delta) == (0.2, 0.28, 0.8)
    assert config.graft.peer_position == "last" and config.graft.balance
    assert config.data.prompt_suffix.startswith("Let's think step by step")


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"train\.stpes: unknown key"):
        config_from_dict(minimal(train={"stpes": 3}))


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"rollout\.n"):
        config_from_dict(minimal(rollout={"n": 0}))
    with pytest.raises(ConfigError, match="at least two models"):
        config_from_dict({**minimal(), "policies": [{"name": "a", "path": "x"}]})
    with pytest.raises(ConfigError, match="peers: names must be unique"):
        config_from_dict(minimal(peers=[{"name": "a", "path": "store"}]))
    with pytest.raises(ConfigError, match="minibatch_prompts"):
        config_from_dict(minimal(train={"batch_prompts": 4, "minibatch_prompts": 8}))
    with pytest.raises(ConfigError, match="unique"):
        config_from_dict({**minimal(), "policies": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]})


def test_graft_accepts_a_stored_peer_or_more_policies():
    stored = config_from_dict(
        {**minimal(peers=[{"name": "b", "path": "runs/b/store"}]), "policies": [{"name": "a", "path": "x"}]}
    )
    assert stored.peers[0].match == "step"
    three = config_from_dict({**minimal(), "policies": [{"name": f"p{i}", "path": "x"} for i in range(3)]})
    assert len(three.policies) == 3


def test_grpo_accepts_any_number_of_policies():
    config = config_from_dict(
        {**minimal(method="grpo"), "policies": [{"name": f"p{i}", "path": "x"} for i in range(3)]}
    )
    assert len(config.policies) == 3


def test_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal()))
    config = load_config(path, ["train.steps=7", "graft.peer_position=first", "policies.1.lr=0.001"])
    assert (
        config.train.steps == 7 and config.graft.peer_position == "first" and config.policies[1].lr == 0.001
    )
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["train.steps"])


def test_config_reference_documents_every_field():
    rows = config_reference()
    keys = {key for key, _, _ in rows}
    assert {"train.batch_prompts", "graft.delta", "policies[].path", "rollout.n"} <= keys
    assert all(description for _, _, description in rows), [k for k, _, d in rows if not d]


def test_cli_reports_config_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(minimal(optim={"learning_rate": 1})))
    result = CliRunner().invoke(app, ["train", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "optim.learning_rate: unknown key" in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_refuses_to_overwrite_a_run(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(minimal()))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    result = CliRunner().invoke(app, ["train", str(path), "--out", str(run)])
    assert result.exit_code == 2 and "--resume" in result.output
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_cli_train_and_resume_on_checkpoints_by_path(tiny_checkpoints, tmp_path):
    config = {
        "method": "graft",
        "policies": [
            {"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(tiny_checkpoints["gpt2"])},
        ],
        "data": {"train": str(FIXTURES / "math_small.parquet")},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "train": {"steps": 2, "batch_prompts": 3, "minibatch_prompts": 2},
        "checkpoint": {"every": 1},
        "logging": {"progress": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(path), "--out", str(run), "--set", "train.steps=1"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 1
    result = CliRunner().invoke(app, ["train", str(path), "--out", str(run), "--resume"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 0, 1, 1]  # two models per step; step 0 not repeated after resume
    assert (run / "checkpoints" / "step_000002" / "gpt2" / "model.safetensors").exists()
