"""backend: ray (each policy in its own actor) gives the local backend's results, resume included."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from conftest import FIXTURES, TextRewards, comparable_metrics, make_config
from safetensors.torch import load_file

import graftrl.training.trainer as trainer_module
from graftrl.config import config_from_dict
from graftrl.storage.rundir import read_metrics
from graftrl.training.backends import LocalBackend, RayBackend, Worker, WorkerGroup
from graftrl.training.ranks import DataParallelWorker
from graftrl.training.trainer import Trainer
from graftrl.training.worker import PolicyWorker

# Actors cannot import the test modules: ship this module's and conftest's classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("ray_ships_test_helpers")


def checkpoint_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    checkpoint = trainer.checkpoints.latest()
    assert checkpoint is not None
    return {
        f"{name}.{key}": value
        for name in trainer.names
        for key, value in load_file(str(checkpoint / name / "model.safetensors")).items()
    }


@pytest.mark.parametrize("method", ["graft", "hacpo", pytest.param("hint", marks=pytest.mark.slow)])
def test_ray_backend_matches_local_and_resumes(tiny_checkpoints, tmp_path, method):
    raw = make_config(tiny_checkpoints, method=method, steps=3)
    raw["checkpoint"] = {"every": 1, "keep_last": 5}
    raw["graft"] = {"balance": False}  # every candidate moves: exchanges in both directions
    local = Trainer(config_from_dict(raw), tmp_path / "local", verifier=TextRewards())
    local.train()
    rows = read_metrics(tmp_path / "local")
    if method == "graft":
        assert sum(r["peer_responses"] for r in rows) > 0, "the fixture should exchange groups"
    if method == "hint":
        assert sum(r["rescue_attempted"] for r in rows) > 0, "the fixture should rescue prompts"

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
    for log in ("compatibility.jsonl", "rescues.jsonl"):  # hint scores no peers, GRAFT rescues nothing
        local_log, ray_log = tmp_path / "local" / log, tmp_path / "ray" / log
        assert local_log.exists() == ray_log.exists(), log
        assert not local_log.exists() or ray_log.read_text() == local_log.read_text(), log
    assert not ray.is_initialized(), "the trainer shuts down the Ray it started"


def test_ray_backend_rejects_in_memory_policies(tiny_checkpoints, tmp_path):
    from graftrl.models.policy import Policy

    raw = {**make_config(tiny_checkpoints), "backend": "ray", "ray": {"num_cpus": 1}}
    policy = Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]))
    with pytest.raises(ValueError, match="loads every policy inside its actor"):
        Trainer(config_from_dict(raw), tmp_path / "run", policies=[policy, policy], verifier=TextRewards())


def test_both_backends_implement_the_worker_group_and_both_workers_the_worker_protocol():
    for backend in (LocalBackend, RayBackend):
        assert issubclass(backend, WorkerGroup)
        assert not inspect.isabstract(backend), f"{backend.__name__} leaves {backend.__abstractmethods__}"
    # Structural: a DataParallelWorker stands in for a PolicyWorker under either backend (the
    # protocol's methods; `policy` and `verifier` are set on instances).
    methods = [name for name, value in vars(Worker).items() if inspect.isfunction(value) and name[0] != "_"]
    assert {"rollout", "update", "save", "load", "validation_scores", "close"} <= set(methods)

    def parameters(function: Any) -> list[str]:
        # Ray adds `_ray_trace_ctx` to the methods of a class it has made an actor class of.
        return [p for p in inspect.signature(function).parameters if not p.startswith("_ray")]

    for worker in (PolicyWorker, DataParallelWorker):
        for name in methods:
            assert callable(getattr(worker, name, None)), f"{worker.__name__} has no {name}"
            assert parameters(getattr(worker, name)) == parameters(getattr(Worker, name)), (
                f"{worker.__name__}.{name}"
            )


def opaque_group(inner: WorkerGroup, calls: list[str]) -> WorkerGroup:
    """A WorkerGroup the trainer has never heard of, forwarding to ``inner``: nothing but the
    interface's members to go by (any other attribute is an AttributeError)."""
    members: dict[str, Any] = {"name": "opaque"}
    for name in WorkerGroup.__abstractmethods__:
        if isinstance(getattr(WorkerGroup, name), property):
            members[name] = property(lambda self, name=name: getattr(inner, name))
        else:

            def forward(self, *args, name=name, **kwargs):
                calls.append(name)
                return getattr(inner, name)(*args, **kwargs)

            members[name] = forward
    return type("OpaqueGroup", (WorkerGroup,), members)()


def test_the_trainer_drives_workers_through_the_interface_only(tiny_checkpoints, tmp_path, monkeypatch):
    """No backend isinstance or private reach-in: a foreign WorkerGroup trains, validates, saves
    and resumes exactly as the local backend does."""
    raw = make_config(tiny_checkpoints, steps=3)
    raw["checkpoint"] = {"every": 1, "keep_last": 5}
    raw["graft"] = {"balance": False}
    raw["validation"] = {"files": {"small": str(FIXTURES / "math_small.jsonl")}, "every": 2, "samples": 2}
    Trainer(config_from_dict(raw), tmp_path / "local", verifier=TextRewards()).train()

    calls: list[str] = []
    monkeypatch.setattr(
        trainer_module, "make_backend", lambda *a, **k: opaque_group(LocalBackend(*a, **k), calls)
    )
    Trainer(
        config_from_dict({**raw, "train": {**raw["train"], "steps": 2}}),
        tmp_path / "opaque",
        verifier=TextRewards(),
    ).train()
    Trainer(config_from_dict(raw), tmp_path / "opaque", verifier=TextRewards()).train(resume=True)
    used = {"reset_peak_memory", "rollout", "update", "validation_scores", "save_policy", "save", "load"}
    assert used | {"nonfinite_state", "close"} <= set(calls)

    assert comparable_metrics(tmp_path / "opaque") == comparable_metrics(tmp_path / "local")

    def validations(run: Path) -> list[dict]:
        rows = [json.loads(line) for line in (run / "validation.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith("time_")} for row in rows]

    assert len(validations(tmp_path / "local")) == 4  # after steps 2 and 3, two policies
    assert validations(tmp_path / "opaque") == validations(tmp_path / "local")
    assert (tmp_path / "opaque" / "best" / "best.json").read_text() == (
        tmp_path / "local" / "best" / "best.json"
    ).read_text()
