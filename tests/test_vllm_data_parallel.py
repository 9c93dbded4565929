"""`rollout.engine: vllm` under FSDP2 data parallelism (`policies[].parallel.data: 2`), vLLM tier.

Each rank of a policy runs its own vLLM engine in external-launcher mode inside the ranks' gloo
world: tensor_parallel_size 1 gives two data-parallel engines that each sample half of the
prompts, tensor_parallel_size 2 one engine sharded over both ranks. Every request keeps its
(seed, prompt, sample) seed, so the 2-rank runs sample what the 1-rank run samples. Run in the
vLLM venv: `.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_data_parallel.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TextRewards, comparable_metrics, make_config
from safetensors.torch import load_file
from test_data_parallel import METRIC_REL, WEIGHT_ATOL

from graftrl.config import ConfigError, config_from_dict
from graftrl.storage.rundir import read_metrics
from graftrl.storage.store import TrajectoryStore
from graftrl.training.trainer import Trainer

# Only `vllm`, not `distributed`: the distributed tier runs in the main venv, which has no vLLM.
pytestmark = pytest.mark.vllm

STEPS = 2


def vllm_config(paths: dict[str, Path], method: str, ranks: int, tp: int = 1) -> dict:
    raw = make_config(paths, method=method, steps=STEPS)
    raw["graft"] = {"balance": False}  # every candidate moves: exchanges in both directions
    raw["checkpoint"] = {"every": 1, "keep_last": 5}
    raw["store"] = {"record": True}
    raw["rollout"] = {
        **raw["rollout"],
        "engine": "vllm",
        # The trainer re-scores its own responses: TIS weights ~1 show each engine holds the
        # weights of the last update (lr 1e-2 moves them far), i.e. the sync from the shards works.
        "tis_cap": 2.0,
        "vllm": {"kv_cache_space_gib": 0.125, "tensor_parallel_size": tp},
    }
    if method == "grpo":
        raw["policies"] = raw["policies"][:1]
    for policy in raw["policies"]:
        policy["parallel"] = {"data": ranks}
    return raw


def train(raw: dict, out: Path) -> Path:
    Trainer(config_from_dict(raw), out, verifier=TextRewards()).train()
    return out


def samples(run: Path) -> list[tuple]:
    """Every recorded trajectory: who sampled what for which prompt, its reward and behaviour lbar."""
    store = TrajectoryStore(run / "store")
    return [
        (step, r.source, r.prompt_id, r.index, r.response, r.reward, r.finished, round(r.mean_logprob, 4))
        for step in store.steps()
        for r in (row.to_record() for row in store.read_step(step, token_logprobs=False))
    ]


def assert_runs_match(run: Path, reference: Path, names: list[str]) -> None:
    """Metrics within test_data_parallel's METRIC_REL, final weights within its WEIGHT_ATOL (same
    reasons: identical samples and rows, only the reduction order of gradients differs)."""
    rows, expected = comparable_metrics(run), comparable_metrics(reference)
    assert [r.keys() for r in rows] == [r.keys() for r in expected]
    for row, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            if isinstance(value, float):
                assert row[key] == pytest.approx(value, rel=METRIC_REL, abs=1e-6), (row["step"], key)
            else:
                assert row[key] == value, (row["step"], key)
    for name in names:
        weights, want = (
            load_file(str(r / "checkpoints" / f"step_{STEPS:06d}" / name / "model.safetensors"))
            for r in (run, reference)
        )
        assert weights.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(weights[key], value, atol=WEIGHT_ATOL, rtol=0, msg=f"{name}.{key}")


@pytest.fixture(scope="module")
def one_rank(vllm_checkpoints, tmp_path_factory) -> dict[str, Path]:
    return {
        method: train(vllm_config(vllm_checkpoints, method, 1), tmp_path_factory.mktemp(f"one_{method}"))
        for method in ("grpo", "graft")
    }


@pytest.mark.parametrize(("method", "tp"), [("grpo", 1), ("grpo", 2), ("graft", 1)])
def test_two_ranks_with_vllm_engines_match_one_rank(vllm_checkpoints, tmp_path, one_rank, method, tp):
    run = train(vllm_config(vllm_checkpoints, method, 2, tp), tmp_path / "two")
    reference = one_rank[method]
    # The same requests with the same seeds: identical samples, rewards and behaviour log-probs
    # (to 4 decimals: an engine's batch holds half the prompts, which may move the last bits).
    assert samples(run) == samples(reference)
    assert len(samples(run)) == STEPS * 4 * 4 * (2 if method == "graft" else 1)
    rows = read_metrics(run)
    if method == "graft":
        assert sum(r["peer_responses"] for r in rows) > 0, "the run should exchange"
    for row in rows:  # engine log-probs = the trainer's after every weight sync
        assert row["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3), (row["step"], row["model"])
        assert row["tis_truncated_frac"] == 0.0
    assert_runs_match(run, reference, ["llama", "gpt2"] if method == "graft" else ["llama"])


def test_tensor_parallel_size_must_divide_the_ranks(vllm_checkpoints):
    raw = vllm_config(vllm_checkpoints, "grpo", 2, tp=2)
    assert config_from_dict(raw).rollout.vllm.tensor_parallel_size == 2
    raw["policies"][0]["parallel"] = {"data": 3}
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size \(2\) must divide"):
        config_from_dict(raw)
