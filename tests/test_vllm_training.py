"""GRAFT with `rollout.engine: vllm` behaves like the HF engine (vLLM tier, its own environment).

Run: `bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -m vllm`.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from conftest import FIXTURES, TextRewards, make_config

from graftrl.config import config_from_dict
from graftrl.models.rollout import HFRolloutEngine
from graftrl.storage.rundir import read_metrics
from graftrl.storage.store import TrajectoryStore
from graftrl.training.trainer import Trainer

pytestmark = pytest.mark.vllm


def run(checkpoints: dict[str, Path], out: Path, engine: str) -> Path:
    raw = make_config(checkpoints, steps=3, batch_prompts=12, minibatch_prompts=6, micro_batch_size=32)
    raw["rollout"] = {"n": 16, "max_new_tokens": 12, "temperature": 0.9, "engine": engine}
    if engine == "vllm":
        raw["rollout"]["tis_cap"] = 2.0
    raw["optim"] = {"lr": 1e-4}  # small steps: both runs stay near the same distribution
    raw["graft"] = {"balance": False}
    raw["store"] = {"record": True}
    Trainer(config_from_dict(raw), out, verifier=TextRewards()).train()
    return out


def per_model(store: TrajectoryStore, field: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for step in store.steps():
        for row in store.read_step(step, token_logprobs=False):
            record = row.to_record()
            values.setdefault(record.source, []).append(float(getattr(record, field)))
    return values


def test_graft_with_vllm_matches_the_hf_engine_statistically(vllm_checkpoints, tmp_path):
    hf = run(vllm_checkpoints, tmp_path / "hf", "hf")
    vllm = run(vllm_checkpoints, tmp_path / "vllm", "vllm")
    for field in ("mean_logprob", "num_tokens"):
        reference, candidate = (per_model(TrajectoryStore(r / "store"), field) for r in (hf, vllm))
        for model, values in reference.items():
            other = candidate[model]
            assert len(values) == len(other) == 3 * 12 * 16
            # Two samples of (nearly) one distribution: the means agree within 4 standard errors.
            se = math.sqrt(
                statistics.pvariance(values) / len(values) + statistics.pvariance(other) / len(other)
            )
            gap = abs(statistics.fmean(values) - statistics.fmean(other))
            assert gap <= 4 * se + 1e-6, f"{model} {field}: gap {gap:.4f} > 4 SE ({se:.4f})"
    rows = read_metrics(vllm)
    assert sum(r["peer_responses"] for r in rows) > 0, "the run should graft peer groups"
    # Engine and trainer compute the same log-probs: the TIS weights stay ~1, none truncated.
    for row in rows:
        assert row["tis_weight_mean"] == pytest.approx(1.0, abs=0.02)
        assert row["tis_truncated_frac"] == 0.0
        assert "time_weight_sync" in row


def validated_run(checkpoints: dict[str, Path], out: Path, backend: str) -> list[dict]:
    """Two steps with `rollout.engine: vllm` and a validation after each; the validation rows."""
    raw = make_config(checkpoints, steps=2)
    raw["rollout"] = {"n": 4, "max_new_tokens": 8, "engine": "vllm", "vllm": {"kv_cache_space_gib": 0.125}}
    raw["validation"] = {
        "files": {"small": str(FIXTURES / "math_small.jsonl")},
        "every": 1,
        "samples": 4,
        "max_problems": 6,
    }
    raw["checkpoint"] = {"every": 0}
    if backend == "ray":
        raw.update(backend="ray", ray={"num_cpus": 2})
    Trainer(config_from_dict(raw), out, verifier=TextRewards()).train()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time_")}
        for line in (out / "validation.jsonl").read_text().splitlines()
    ]


def test_validation_samples_with_each_policys_vllm_engine_under_both_backends(
    vllm_checkpoints, tmp_path, monkeypatch, ray_ships_test_helpers
):
    """Validation goes through the same engine protocol as training: each policy's own vLLM engine
    (an engine serves one policy and refuses another), in the trainer's process or in its actor."""

    def no_hf_sampling(*args, **kwargs):
        raise AssertionError("validation fell back to the HF engine")

    with monkeypatch.context() as patch:  # the local backend's workers live in this process
        patch.setattr(HFRolloutEngine, "generate", no_hf_sampling)
        local = validated_run(vllm_checkpoints, tmp_path / "local", "local")
    assert [(row["step"], row["model"]) for row in local] == [
        (0, "llama"),
        (0, "gpt2"),
        (1, "llama"),
        (1, "gpt2"),
    ]
    for row in local:
        assert 0.0 <= row["pass_at_1/small"] <= 1.0
        assert row["aggregate"] == row["pass_at_1/small"]
    assert any(row["pass_at_1/small"] > 0 for row in local), "TextRewards passes about 1 in 4"
    for name in ("llama", "gpt2"):
        assert (tmp_path / "local" / "best" / name / "model.safetensors").exists()

    ray = validated_run(vllm_checkpoints, tmp_path / "ray", "ray")
    assert ray == local  # the same seeds and weights sample the same responses in an actor
    best = json.loads((tmp_path / "local" / "best" / "best.json").read_text())
    assert json.loads((tmp_path / "ray" / "best" / "best.json").read_text()) == best
