"""GRAFT with `rollout.engine: vllm` behaves like the HF engine (vLLM tier, its own environment).

Run: `bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -m vllm`.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
from conftest import TextRewards, make_config

from graftrl.config import config_from_dict
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
