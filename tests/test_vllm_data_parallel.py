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
# tensor_parallel_size 2 splits each of the engine's matmuls over the ranks and all-reduces the
# halves: behaviour log-probs differ from one engine's in the last float bits (~1e-7), which
# enter the loss (TIS weights); AdamW at lr 1e-2 turns that into a visible update of the odd
# parameter whose gradient is near zero (measured: 1 of llama's 6,464 embedding weights moved
# 2.6e-4 more over 2 steps, every other weight within WEIGHT_ATOL). Still 1/40 of what 2 steps move a weight.
TP_WEIGHT_ATOL = 5e-4


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


def samples(run: Path) -> tuple[list[tuple], list[float]]:
    """Every recorded trajectory (who sampled what for which prompt, its reward), and its
    behaviour lbar (the engine's log-probs)."""
    store = TrajectoryStore(run / "store")
    records = [
        row.to_record() for step in store.steps() for row in store.read_step(step, token_logprobs=False)
    ]
    return (
        [(r.step, r.source, r.prompt_id, r.index, r.response, r.reward, r.finished) for r in records],
        [r.mean_logprob for r in records],
    )


def assert_runs_match(run: Path, reference: Path, names: list[str], atol: float = WEIGHT_ATOL) -> None:
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
            torch.testing.assert_close(
                weights[key], value, atol=atol, rtol=0, msg=lambda m, k=f"{name}.{key}": f"{k}: {m}"
            )


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
    # The same requests with the same seeds: identical samples and rewards. Behaviour log-probs
    # agree to float tolerance: after an update the weights differ in the last bits (gradient
    # reduction order), and an engine's batch (half the prompts) or tp=2's all-reduce sums differently.
    (trajectories, lbar), (expected, expected_lbar) = samples(run), samples(reference)
    assert trajectories == expected
    assert len(trajectories) == STEPS * 4 * 4 * (2 if method == "graft" else 1)
    assert lbar == pytest.approx(expected_lbar, abs=1e-4)
    rows = read_metrics(run)
    if method == "graft":
        assert sum(r["peer_responses"] for r in rows) > 0, "the run should exchange"
    for row in rows:  # engine log-probs = the trainer's after every weight sync
        assert row["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3), (row["step"], row["model"])
        assert row["tis_truncated_frac"] == 0.0
    names = ["llama", "gpt2"] if method == "graft" else ["llama"]
    assert_runs_match(run, reference, names, WEIGHT_ATOL if tp == 1 else TP_WEIGHT_ATOL)


def test_tensor_parallel_size_must_divide_the_ranks(vllm_checkpoints):
    raw = vllm_config(vllm_checkpoints, "grpo", 2, tp=2)
    assert config_from_dict(raw).rollout.vllm.tensor_parallel_size == 2
    raw["policies"][0]["parallel"] = {"data": 3}
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size \(2\) must divide"):
        config_from_dict(raw)
