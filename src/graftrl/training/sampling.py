"""A policy's rollout phase of a step: sample, verify, GRPO advantages, dynamic sampling, records.

``sample_step`` is what ``PolicyWorker.rollout`` runs; it sees the policy only through
``generate`` and ``score`` (which the worker makes data-parallel aware), so the phase reads
top to bottom without the worker's state.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from graftrl.config import Config
from graftrl.core import group_outcome_fractions, grpo_advantages
from graftrl.methods import GroupOutcomes
from graftrl.models.rollout import RolloutBatch
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.storage.records import TrajectoryRecord
from graftrl.training.randomness import sampling_stream, step_seed
from graftrl.training.trajectories import rollout_records, stored_rows


@dataclass
class PolicyRollout:
    """One policy's scored groups at a step: what the driver needs, no token ids or tensors of
    log-probs (those stay with the worker for its update)."""

    problems: list[MathProblem]
    """The prompts it trains on (the shared batch, unless dynamic sampling replaced some)."""
    outcomes: GroupOutcomes
    records: list[TrajectoryRecord]
    shared: GroupOutcomes
    """Its outcomes on the step's shared prompt batch (the first round), for complementarity."""
    info: dict[str, Any]
    """Dynamic-sampling metrics ({} when off) and the mean response length."""
    timings: dict[str, float]
    store_rows: list[Any] = field(default_factory=list)
    """Trajectory-store rows of the kept groups (only when the run records)."""


def with_suffix(problem: str, suffix: str | None) -> str:
    return f"{problem} {suffix}" if suffix else problem


def select_groups(parts: Sequence[tuple[RolloutBatch, Sequence[int]]], n: int) -> RolloutBatch:
    """The chosen groups (prompt indices) of one or more rollout batches, in order, as one batch."""
    rows = [(batch, g * n + i) for batch, groups in parts for g in groups for i in range(n)]
    return RolloutBatch(
        prompt_ids=[batch.prompt_ids[g] for batch, groups in parts for g in groups],
        response_ids=[batch.response_ids[r] for batch, r in rows],
        behaviour_logprobs=[batch.behaviour_logprobs[r] for batch, r in rows],
        finished=[batch.finished[r] for batch, r in rows],
        texts=[batch.texts[r] for batch, r in rows],
        n=n,
    )


def verifier_counts(verifier: Any) -> dict[str, int]:
    """The verifier's running counts that go into each step's metrics (as differences)."""
    stats = verifier.stats() if hasattr(verifier, "stats") else {}
    failures = verifier.failure_counts() if hasattr(verifier, "failure_counts") else {}
    return {
        "verifier_timeouts": int(stats.get("timeouts", 0)) + int(stats.get("deadline_skips", 0)),
        "verifier_restarts": int(stats.get("worker_restarts", 0)),
        **{f"failures/{name}": int(count) for name, count in failures.items()},
    }


def sample_step(
    config: Config,
    index: int,
    name: str,
    step: int,
    problems: list[MathProblem],
    *,
    generate: Callable[[list[str], int], RolloutBatch],
    score: Callable[[list[str], list[MathProblem]], list[float]],
    extra_sampler: PromptSampler,
    verifier: Any,
    tokenizer_id: str = "",
) -> tuple[PolicyRollout, RolloutBatch]:
    """Sample, score and compute GRPO advantages on the step's prompts for policy ``index``.

    With ``rollout.dynamic_sampling`` (DAPO, algorithm.md §3) the policy keeps only groups whose rewards
    are not all equal; round r >= 1 draws ``batch_prompts`` more prompts from the auxiliary
    stream at slot (step, policy, r), which depends only on (seed, step, policy, round) so
    resume stays exact, skipping prompts already drawn at this step. It stops once
    ``batch_prompts`` informative groups are kept (the surplus of the last round is cut, in
    draw order) or after ``max_sampling_rounds`` rounds, and then trains on what it kept: fewer
    groups, or none (no optimizer step for this policy at this step).

    Returns the driver's view of the kept groups and the rollout batch the update trains on.
    """
    n = config.rollout.n
    dynamic = config.rollout.dynamic_sampling
    rounds = config.rollout.max_sampling_rounds if dynamic else 1
    target = config.train.batch_prompts
    seen = {p.id for p in problems}
    batch = problems
    parts: list[tuple[RolloutBatch, list[int]]] = []
    kept_problems: list[MathProblem] = []
    kept_rewards: list[Tensor] = []
    first_rewards: Tensor | None = None
    timings = {"time_rollout": 0.0, "time_reward": 0.0}
    rounds_run = prompts_sampled = 0
    verifier_before = verifier_counts(verifier)
    for round_ in range(rounds):
        if round_:
            slot = (step * len(config.policies) + index) * (rounds - 1) + round_ - 1
            batch = []
            for problem in extra_sampler.batch(slot):
                if problem.id not in seen:
                    seen.add(problem.id)
                    batch.append(problem)
            if not batch:
                continue
        start = time.perf_counter()
        prompts = [with_suffix(p.problem, config.data.prompt_suffix) for p in batch]
        rollout = generate(prompts, step_seed(config.seed, step, sampling_stream(index, round_)))
        timings["time_rollout"] += time.perf_counter() - start

        start = time.perf_counter()
        each = [p for p in batch for _ in range(n)]  # each response's problem row (the verifier's)
        rewards = torch.tensor(score(rollout.texts, each), dtype=torch.float32)
        rewards = rewards.view(len(batch), n)
        timings["time_reward"] += time.perf_counter() - start
        first_rewards = rewards if first_rewards is None else first_rewards
        rounds_run += 1
        prompts_sampled += len(batch)
        keep = list(range(len(batch)))
        if dynamic:
            informative = [p for p in keep if bool((rewards[p] != rewards[p, 0]).any())]
            keep = informative[: target - len(kept_problems)]
        parts.append((rollout, keep))
        kept_problems += [batch[p] for p in keep]
        kept_rewards.append(rewards[keep])
        if len(kept_problems) >= target:
            break

    start = time.perf_counter()
    if len(parts) == 1 and len(parts[0][1]) == len(parts[0][0].prompt_ids):
        rollout = parts[0][0]  # every group kept: the batch as generated
    else:
        rollout = select_groups(parts, n)
    rewards = torch.cat(kept_rewards)
    advantages = (
        grpo_advantages(rewards, config.train.adv_eps, config.train.adv_std_unbiased)
        if len(rewards)
        else torch.zeros_like(rewards)  # every group dropped
    )
    threshold = config.reward.success_threshold
    outcomes = GroupOutcomes(rewards, advantages, threshold)
    records = rollout_records(step, name, kept_problems, rollout, rewards, advantages)
    shared, info = outcomes, {}
    if dynamic:
        assert first_rewards is not None
        all_fail, all_pass = group_outcome_fractions(first_rewards, threshold)
        shared = GroupOutcomes(first_rewards, torch.zeros_like(first_rewards), threshold)
        info = {
            "sampling_rounds": rounds_run,
            "prompts_sampled": prompts_sampled,
            "groups_kept": len(kept_problems),
            "shared_reward_mean": float(first_rewards.mean()),
            "shared_all_fail_frac": float(all_fail),
            "shared_all_pass_frac": float(all_pass),
        }
    counted = {key: after - verifier_before.get(key, 0) for key, after in verifier_counts(verifier).items()}
    # a failure class is logged at the steps it occurs (a resumed run's verifier counts afresh)
    info.update({key: value for key, value in counted.items() if value or not key.startswith("failures/")})
    info["response_length"] = (
        statistics.fmean(rollout.content_length(r) for r in range(len(rollout.response_ids)))
        if rollout.response_ids
        else None
    )
    timings["time_reward"] += time.perf_counter() - start
    store_rows = []
    if config.store.record:
        prompt_texts = [with_suffix(p.problem, config.data.prompt_suffix) for p in kept_problems]
        store_rows = stored_rows(records, rollout, prompt_texts, tokenizer_id)
    return PolicyRollout(kept_problems, outcomes, records, shared, info, timings, store_rows), rollout
