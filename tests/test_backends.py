"""backend: ray (each policy in its own actor) gives the local backend's results, resume included."""

from __future__ import annotations

import sys

import conftest
import pytest
import ray
import torch
from conftest import TextRewards, comparable_metrics, make_config
from safetensors.torch import load_file

from graftrl.config import config_from_dict
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer

# Actors cannot import the test modules: ship the verifier classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(conftest)


def checkpoint_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    checkpoint = trainer.latest_checkpoint()
    assert checkpoint is not None
    return {
        f"{name}.{key}": value
        for name in trainer.names
        for key, value in load_file(str(checkpoint / name / "model.safetensors")).items()
    }


@pytest.mark.parametrize("method", ["graft", "hacpo"])
def test_ray_backend_matches_local_and_resumes(tiny_checkpoints, tmp_path, method):
    raw = make_config(tiny_checkpoints, method=method, steps=3)
    raw["checkpoint"] = {"every": 1, "keep_last": 5}
    raw["graft"] = {"balance": False}  # every candidate moves: exchanges in both directions
    local = Trainer(config_from_dict(raw), tmp_path / "local", verifier=TextRewards())
    local.train()
    rows = read_metrics(tmp_path / "local")
    if method == "graft":
        assert sum(r["peer_responses"] for r in rows) > 0, "the fixture should exchange groups"

    distributed = {**raw, "backend": "ray", "ray": {"num_cpus": 2}}
    first = Trainer(
        config_from_dict({**distributed, "train": {**raw["train"], "steps": 2}}),
        tmp_path / "ray",
        verifier=TextRewards(),
    )
    first.train()
    with pytest.raises(AttributeError, match="inside their actors"):
        _ = first.policies
    resumed = Trainer(config_from_dict(distributed), tmp_path / "ray", verifier=TextRewards())
    resumed.train(resume=True)
    assert resumed.start_step == 2

    assert comparable_metrics(tmp_path / "ray") == comparable_metrics(tmp_path / "local")
    local_weights, ray_weights = checkpoint_weights(local), checkpoint_weights(resumed)
    assert local_weights.keys() == ray_weights.keys()
    for key, value in local_weights.items():
        assert torch.equal(value, ray_weights[key]), key
    assert (tmp_path / "ray" / "compatibility.jsonl").read_text() == (
        tmp_path / "local" / "compatibility.jsonl"
    ).read_text()
    assert not ray.is_initialized(), "the trainer shuts down the Ray it started"


def test_ray_backend_rejects_in_memory_policies(tiny_checkpoints, tmp_path):
    from graftrl.models.policy import Policy

    raw = {**make_config(tiny_checkpoints), "backend": "ray", "ray": {"num_cpus": 1}}
    policy = Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]))
    with pytest.raises(ValueError, match="loads every policy inside its actor"):
        Trainer(config_from_dict(raw), tmp_path / "run", policies=[policy, policy], verifier=TextRewards())
