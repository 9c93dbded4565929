"""GRPO baselines (algorithm.md §3): any n with a fixed minibatch, and DAPO dynamic sampling."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import FIXTURES, comparable_metrics, make_config, weights_of

from graftrl.config import ConfigError, config_from_dict
from graftrl.storage.data import load_problems
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer

ANSWERS = ["57", "\\frac{3}{4}", "-5", "2\\sqrt{3}", "16", "\\frac{1}{2}", "0.75", "1024", "7", "60"]


class AnswerRewards:
    """Rewards by gold answer, so they do not depend on call order (resume replays them exactly).

    A group whose answer is in ``mixed`` gets [1, 0, ..., 0]; in ``solved`` all 1; else all 0.
    Every call's size is recorded (one call per generation round).
    """

    def __init__(self, n: int, mixed: Sequence[str] = (), solved: Sequence[str] = ()) -> None:
        self.n, self.mixed, self.solved = n, set(mixed), set(solved)
        self.calls: list[int] = []

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        self.calls.append(len(responses))
        return [
            1.0 if a in self.solved or (a in self.mixed and i % self.n == 0) else 0.0
            for i, a in enumerate(answers)
        ]

    def close(self) -> None:
        pass


def dynamic_config(paths, rounds: int = 3, steps: int = 2, **extra) -> dict:
    raw = make_config(paths, method="grpo", steps=steps)
    raw["rollout"].update(dynamic_sampling=True, max_sampling_rounds=rounds)
    raw.update(extra)
    return raw


def record_minibatches(trainer: Trainer) -> dict[str, list[int]]:
    """Rows with a forward pass in each optimizer step, per policy."""
    sizes: dict[str, list[int]] = {p.name: [] for p in trainer.policies}
    for policy in trainer.policies:
        original = policy.micro_batches

        def spy(count, name=policy.name, original=original):
            sizes[name].append(count)
            return original(count)

        policy.micro_batches = spy
    return sizes


@pytest.mark.parametrize("n", [4, 16])
def test_grpo_n_changes_only_the_rollout_count(tiny_checkpoints, tmp_path, n):
    """n = 16: 16 rollouts per prompt, still batch/minibatch = 2 optimizer steps of 2 prompts each."""
    raw = make_config(tiny_checkpoints, method="grpo", steps=1)
    raw["rollout"]["n"] = n
    rewards = AnswerRewards(n, mixed=[*ANSWERS, "9\\pi", "2, 3"])  # every group mixed: all rows active
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=rewards)
    sizes = record_minibatches(trainer)
    trainer.train()
    assert rewards.calls == [4 * n, 4 * n]  # one generation of 4 prompts x n per policy
    for row in read_metrics(tmp_path / "run"):
        assert row["optimizer_steps"] == 4 // 2
        assert sizes[row["model"]] == [2 * n, 2 * n]  # minibatch_prompts * n rows each
        assert "sampling_rounds" not in row


def test_dynamic_sampling_keeps_mixed_groups_and_refills(tiny_checkpoints, tmp_path):
    rewards = AnswerRewards(4, mixed=ANSWERS[:6], solved=ANSWERS[6:8])
    trainer = Trainer(config_from_dict(dynamic_config(tiny_checkpoints)), tmp_path / "run", verifier=rewards)
    captured = []
    for worker in trainer.workers:

        def spy(request, worker=worker, original=worker.rollout):
            result = original(request)
            captured.append((request.step, worker.name, request.problems, result))
            return result

        worker.rollout = spy
    trainer.train()
    metrics = {(r["step"], r["model"]): r for r in read_metrics(tmp_path / "run")}
    assert len(captured) == 2 * 2
    for step, name, shared_batch, result in captured:
        row = metrics[(step, name)]
        kept = result.outcomes.rewards
        successes = kept.sum(-1)
        assert bool(((successes > 0) & (successes < 4)).all()), "a zero-variance group was kept"
        assert kept.shape[0] == len(result.problems) == row["groups_kept"] <= 4
        assert len({p.id for p in result.problems}) == len(result.problems)  # no prompt twice
        assert row["sampling_rounds"] <= 3 and (row["groups_kept"] == 4 or row["sampling_rounds"] == 3)
        assert 4 <= row["prompts_sampled"] <= 4 * row["sampling_rounds"]
        # the shared batch's informative prompts come first, in order
        first = [p.id for p in shared_batch if p.answer in rewards.mixed][:4]
        assert [p.id for p in result.problems[: len(first)]] == first
        assert row["optimizer_steps"] == -(-row["groups_kept"] // 2)
        assert row["all_fail_frac"] == 0.0 and row["all_pass_frac"] == 0.0
        assert row["shared_reward_mean"] == pytest.approx(float(result.shared.rewards.mean()))
        assert "complementarity/gpt2" in row or "complementarity/llama" in row
    # every generation round is one verifier call of (new prompts) x n responses
    rows = list(metrics.values())
    assert len(rewards.calls) == sum(r["sampling_rounds"] for r in rows)
    assert sum(rewards.calls) == 4 * sum(r["prompts_sampled"] for r in rows)
    assert any(r["sampling_rounds"] > 1 for r in rows), "the fixture should need a refill"


def test_dynamic_sampling_stops_at_the_round_cap(tiny_checkpoints, tmp_path):
    """No informative group anywhere: exactly `max_sampling_rounds` rounds, nothing to train on."""
    rewards = AnswerRewards(4, solved=ANSWERS[:3])
    raw = dynamic_config(tiny_checkpoints, rounds=2, steps=1)
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=rewards)
    before = weights_of(trainer)
    trainer.train()
    for row in read_metrics(tmp_path / "run"):
        assert row["sampling_rounds"] == 2
        assert row["groups_kept"] == 0 and row["optimizer_steps"] == 0
        assert 4 < row["prompts_sampled"] <= 8
    assert len(rewards.calls) == 2 * 2
    after = weights_of(trainer)
    assert all(torch.equal(value, after[key]) for key, value in before.items())


@pytest.mark.parametrize("informative", [1, 0])
def test_dynamic_sampling_draws_no_prompt_twice(tiny_checkpoints, tmp_path, informative):
    """Four problems, batch 4: the extra stream has nothing new, so only the first round runs."""
    problems = load_problems(FIXTURES / "math_small.jsonl")[:4]
    rewards = AnswerRewards(4, mixed=[p.answer for p in problems[:informative]])
    raw = dynamic_config(tiny_checkpoints, rounds=3, steps=1)
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", problems=problems, verifier=rewards)
    trainer.train()
    for row in read_metrics(tmp_path / "run"):
        assert (row["sampling_rounds"], row["prompts_sampled"], row["groups_kept"]) == (1, 4, informative)
        assert row["optimizer_steps"] == informative
    assert rewards.calls == [16, 16]


def test_dynamic_sampling_resume_is_exact(tiny_checkpoints, tmp_path):
    def rewards():
        return AnswerRewards(4, mixed=ANSWERS[:5], solved=ANSWERS[5:7])

    full = Trainer(
        config_from_dict(dynamic_config(tiny_checkpoints, steps=3)), tmp_path / "full", verifier=rewards()
    )
    full.train()
    cut = dynamic_config(tiny_checkpoints, steps=3, checkpoint={"every": 1, "keep_last": 5})
    first = Trainer(
        config_from_dict({**cut, "train": {**cut["train"], "steps": 2}}), tmp_path / "cut", verifier=rewards()
    )
    first.train()
    resumed = Trainer(config_from_dict(cut), tmp_path / "cut", verifier=rewards())
    resumed.train(resume=True)
    assert resumed.start_step == 2
    full_weights, resumed_weights = weights_of(full), weights_of(resumed)
    for key, value in full_weights.items():
        assert torch.equal(value, resumed_weights[key]), key

    assert comparable_metrics(tmp_path / "full") == comparable_metrics(tmp_path / "cut")
    assert any(r["sampling_rounds"] > 1 for r in comparable_metrics(tmp_path / "full"))


def test_dynamic_sampling_needs_grpo(tiny_checkpoints):
    raw = dynamic_config(tiny_checkpoints)
    raw["method"] = "graft"
    with pytest.raises(ConfigError, match=r"dynamic_sampling is only valid with method: grpo"):
        config_from_dict(raw)
    config = config_from_dict(make_config(tiny_checkpoints, method="grpo"))
    assert config.rollout.dynamic_sampling is False and config.rollout.max_sampling_rounds == 3
