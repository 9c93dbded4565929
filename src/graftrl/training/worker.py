"""One policy and everything that touches its weights: the unit a backend places.

A ``PolicyWorker`` owns a policy (model, tokenizer, optimizer), its rollout engine, its frozen
reference (for a KL penalty) and its copy of the method's loss. The trainer (the driver) asks it
to sample and score a step's prompts, then to update on the planned groups given every model's
tokenizer-neutral records. Nothing else crosses between models, so the same worker runs in the
trainer's process (``backend: local``) or in its own Ray actor (``backend: ray``) unchanged, and
both give the same results for the same seed: every random draw is derived from (seed, step,
policy index), never from the order in which workers run.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from graftrl.config import Config
from graftrl.core import group_outcome_fractions, grpo_advantages, truncated_is_weights
from graftrl.core.contrast import GroupContrast, contrast_metrics, group_contrast
from graftrl.errors import TrainingDivergedError
from graftrl.methods import ExchangePlan, GroupOutcomes, LossInputs, Method, PeerLikelihoods, build_method
from graftrl.models.policy import Policy
from graftrl.models.rollout import (
    HFRolloutEngine,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    content_mean_logprob,
)
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.storage.records import TrajectoryRecord
from graftrl.training.parallel import (
    all_gather_objects,
    broadcast_object,
    full_state_dict,
    gathered,
    rank_device,
    shard_model,
    split_rows,
    sum_across_ranks,
)
from graftrl.training.trajectories import rollout_records, stored_rows


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A seed derived from (run seed, step, stream): randomness needs no state to resume."""
    return (seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1)


# Streams of step_seed: 0 = the method's plan (driver); 1 + index + 1000 * round = a policy's
# sampling; UPDATE_STREAM + index = a policy's update (minibatch order, random admission).
UPDATE_STREAM = 500_000
EXTRA_PROMPT_STREAM = 999_983

DCP_FOLDER = "dcp"
"""A policy checkpoint's sharded weights + optimizer state (torch.distributed.checkpoint)."""

UPDATE_STATE = "update_state.json"
"""A policy checkpoint's in-process update state: which parameters hold a gradient tensor (so a
minibatch with no trained row steps AdamW exactly as it would have in the uninterrupted process)
and the count of non-finite optimizer steps in a row."""


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


def make_engine(config: Config, policy: Policy) -> RolloutEngine:
    """The configured rollout engine for one policy (``rollout.engine``)."""
    if config.rollout.engine == "hf":
        return HFRolloutEngine(config.rollout.max_batch_size)
    try:
        from graftrl.models.rollout_vllm import VLLMOptions, VLLMRolloutEngine
    except ImportError as error:
        raise RuntimeError(
            f"rollout.engine: vllm needs vLLM ({error}); install it with `bash scripts/setup_vllm.sh` "
            "or set rollout.engine: hf"
        ) from None
    options = VLLMOptions(**config.rollout.vllm.model_dump())
    return VLLMRolloutEngine(policy, options, seed=config.seed, max_batch_size=config.rollout.max_batch_size)


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


@dataclass(frozen=True)
class CompatibilityScores:
    """One receiver's compatibility scores at a step: a line of compatibility.jsonl."""

    step: int
    receiver: str
    source: list[str]
    """Source model of each scored peer response."""
    s: list[float]
    """Its compatibility score (eq. 7), rounded to 5 decimals."""
    reward: list[float]
    """Its reward."""
    w: list[float] = field(default_factory=list)
    """The weight applied to it (eq. 8, or the method's rule), rounded to 5 decimals."""
    advantage: list[float] = field(default_factory=list)
    """The advantage it was trained with (the source's), rounded to 5 decimals."""
    prompt_id: list[str] = field(default_factory=list)
    """Its prompt's id."""
    response: list[str] | None = None
    """Its text (``logging.log_transfers``; None when off)."""


@dataclass(frozen=True)
class UpdateResult:
    """What a policy's update returns to the driver."""

    metrics: dict[str, Any]
    """The policy's metrics row for this step (the driver adds the step-level ones)."""
    compatibility: CompatibilityScores | None = None
    """Scores of the transferred responses (None when nothing was scored)."""


@dataclass
class TrainingRows:
    """Everything one receiver optimises on this step, one entry per response row."""

    group: list[int] = field(default_factory=list)
    """Index of the row's group in the plan."""
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    old_logprobs: list[Tensor | None] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    is_peer: list[bool] = field(default_factory=list)
    is_nll: list[bool] = field(default_factory=list)
    source: list[str] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    """The response ended with EOS (its last token is outside lbar's content tokens)."""
    source_mean_logp: list[float] = field(default_factory=list)
    """lbar of the sampling policy on its own tokenization (the record's mean_logprob)."""
    tis_weights: list[Tensor | None] = field(default_factory=list)
    """Per-token truncated importance-sampling weights of own rows (``rollout.tis_cap``), else None."""
    compatibility: CompatibilityScores | None = None
    """The peer rows' compatibility scores, when the method scores peers."""

    def append(
        self,
        group: int,
        prompt: list[int],
        response: list[int],
        old: Tensor | None,
        advantage: float,
        peer: bool,
        nll: bool,
        source: str,
        finished: bool = False,
        source_mean_logp: float = 0.0,
    ) -> None:
        self.group.append(group)
        self.prompt_ids.append(prompt)
        self.response_ids.append(response)
        self.old_logprobs.append(old)
        self.advantages.append(advantage)
        # NLL rows are outside the surrogate (weight 0 there); the method's loss trains them.
        self.weights.append(0.0 if nll else 1.0)
        self.is_peer.append(peer)
        self.is_nll.append(nll)
        self.source.append(source)
        self.finished.append(finished)
        self.source_mean_logp.append(source_mean_logp)
        self.tis_weights.append(None)


def verifier_counts(verifier: Any) -> dict[str, int]:
    """The verifier's running counts that go into each step's metrics (as differences)."""
    stats = verifier.stats() if hasattr(verifier, "stats") else {}
    return {
        "verifier_timeouts": int(stats.get("timeouts", 0)) + int(stats.get("deadline_skips", 0)),
        "verifier_restarts": int(stats.get("worker_restarts", 0)),
    }


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or the process's peak RSS (Linux clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # 5 resets VmHWM to the current RSS; elsewhere the peak stays the process's lifetime peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since ``reset_peak_memory``: CUDA allocator peak, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


class _RankZeroVerifier:
    """A verifier for every rank of a sharded policy: rank 0 scores, every rank gets the rewards."""

    def __init__(self, score: Callable[[list[str], list[str]], list[float]]) -> None:
        self.score = score


class PolicyWorker:
    """Samples, scores and updates one policy; see the module docstring."""

    def __init__(
        self,
        config: Config,
        index: int,
        run_dir: str | Path,
        problems: Sequence[MathProblem],
        *,
        policy: Policy | None = None,
        verifier: Any = None,
        method: Method | None = None,
        threads: int | None = None,
    ) -> None:
        if threads is not None:  # a Ray actor: as many torch threads as the CPUs it reserved
            torch.set_num_threads(max(1, threads))
        self.config = config
        self.index = index
        self.run_dir = Path(run_dir)
        spec = config.policies[index]
        # Data-parallel ranks (parallel.data > 1): this process is one rank of the policy's group,
        # started by graftrl.training.ranks.DataParallelWorker.
        self.world = spec.parallel.data
        self.rank = 0
        if self.world > 1:
            if not dist.is_initialized() or dist.get_world_size() != self.world:
                raise RuntimeError(
                    f"policy {spec.name!r}: parallel.data = {self.world} runs through "
                    "graftrl.training.ranks.DataParallelWorker (one process per rank)"
                )
            if policy is not None:
                raise ValueError("parallel.data > 1 loads the policy inside each rank from `policies[].path`")
            self.rank = dist.get_rank()
        self.policy = policy or Policy.from_pretrained(
            spec.name,
            spec.path,
            dtype=spec.dtype,
            param_dtype=spec.param_dtype,
            device=rank_device(spec.device, self.rank) if self.world > 1 else spec.device,
            template=spec.template,
            chat_template=spec.chat_template,
        )
        self.name = self.policy.name
        self.policy.check_prompt_lengths(
            [(p.id, with_suffix(p.problem, config.data.prompt_suffix)) for p in problems],
            config.rollout.max_new_tokens,
        )
        self.policy.temperature = config.rollout.temperature
        self.policy.micro_batch_size = config.train.micro_batch_size
        self.policy.micro_batch_tokens = config.train.micro_batch_tokens
        self.policy.logprob_chunk_tokens = config.train.logprob_chunk_tokens
        if config.train.logprob_chunk_tokens is not None and not self.policy.chunks_logprobs:
            warnings.warn(
                f"train.logprob_chunk_tokens: policy {self.name!r} ({type(self.policy.model).__name__}) "
                "transforms its logits after the LM head or has no separate decoder; it keeps the "
                "unchunked log-prob",
                stacklevel=2,
            )
        if config.train.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.method = method or build_method(config.method, config)
        # A frozen copy of the initial policy, for a KL penalty (off unless train.kl_coef > 0);
        # unsharded under data parallelism (a full copy per rank).
        self.reference = self.policy.frozen_copy() if config.train.kl_coef > 0 else None
        # Built from the unsharded model in its compute dtype (sharding clears it); a vLLM engine
        # of a sharded policy is one of the world's external-launcher engines.
        self.engine: RolloutEngine = make_engine(config, self.policy)
        if self.world > 1:
            # FSDP2's mixed precision replaces autocast: bf16 all-gathered parameters, fp32 gradient
            # reduction, fp32 master weights and AdamW state (the shards).
            shard_model(self.policy.model, self.policy.compute_dtype)
            self.policy.compute_dtype = None
        if self.policy.optimizer is None:
            self.policy.configure_optimizer(
                spec.lr or config.optim.lr, config.optim.betas, config.optim.weight_decay
            )
        # Dynamic sampling's extra prompts: a second stream, one slot per (step, policy, round).
        self.extra_sampler = PromptSampler(
            list(problems), config.train.batch_prompts, step_seed(config.seed, 0, EXTRA_PROMPT_STREAM)
        )
        self.sampling = SamplingParams(
            n=config.rollout.n,
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        self._owns_verifier = verifier is None
        if verifier is None and self.rank == 0:  # rank 0 scores for every rank
            from graftrl.models.rewards import MathVerifier

            verifier = MathVerifier.from_config(config.reward)
        self.verifier = verifier
        self.tokenizer_id = ""
        if config.store.record:
            from graftrl.storage.store import tokenizer_id

            self.tokenizer_id = tokenizer_id(self.policy.tokenizer)
        self.validator = None  # built on first use (backend: ray scores validation here)
        self._rollout: RolloutBatch | None = None
        self._nonfinite_in_row = 0  # optimizer steps skipped in a row for a NaN/inf loss or grad norm

    # ----- sampling -------------------------------------------------------------------------
    def reset_peak_memory(self) -> None:
        """Called at the start of every step: ``memory_peak_mb`` is then the step's peak (the
        process's, so under the local backend all policies' together)."""
        reset_peak_memory(self.policy.device)

    def rollout(self, step: int, problems: list[MathProblem]) -> PolicyRollout:
        """Sample, score and compute GRPO advantages on the step's prompts.

        With ``rollout.dynamic_sampling`` (DAPO, algorithm.md §3) the policy keeps only groups whose rewards
        are not all equal; round r >= 1 draws ``batch_prompts`` more prompts from the auxiliary
        stream at slot (step, policy, r), which depends only on (seed, step, policy, round) so
        resume stays exact, skipping prompts already drawn at this step. It stops once
        ``batch_prompts`` informative groups are kept (the surplus of the last round is cut, in
        draw order) or after ``max_sampling_rounds`` rounds, and then trains on what it kept: fewer
        groups, or none (no optimizer step for this policy at this step).
        """
        config, n, index = self.config, self.sampling.n, self.index
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
        verifier_before = verifier_counts(self.verifier)
        for round_ in range(rounds):
            if round_:
                slot = (step * len(config.policies) + index) * (rounds - 1) + round_ - 1
                batch = []
                for problem in self.extra_sampler.batch(slot):
                    if problem.id not in seen:
                        seen.add(problem.id)
                        batch.append(problem)
                if not batch:
                    continue
            start = time.perf_counter()
            prompts = [with_suffix(p.problem, config.data.prompt_suffix) for p in batch]
            seed = step_seed(config.seed, step, 1 + index + 1000 * round_)
            rollout = self._generate(prompts, seed)
            timings["time_rollout"] += time.perf_counter() - start

            start = time.perf_counter()
            answers = [p.answer for p in batch for _ in range(n)]
            rewards = torch.tensor(self._score(rollout.texts, answers), dtype=torch.float32)
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
        outcomes = GroupOutcomes(rewards, advantages)
        records = rollout_records(step, self.name, kept_problems, rollout, rewards, advantages)
        shared, info = outcomes, {}
        if dynamic:
            assert first_rewards is not None
            all_fail, all_pass = group_outcome_fractions(first_rewards)
            shared = GroupOutcomes(first_rewards, torch.zeros_like(first_rewards))
            info = {
                "sampling_rounds": rounds_run,
                "prompts_sampled": prompts_sampled,
                "groups_kept": len(kept_problems),
                "shared_reward_mean": float(first_rewards.mean()),
                "shared_all_fail_frac": float(all_fail),
                "shared_all_pass_frac": float(all_pass),
            }
        info.update(
            {key: after - verifier_before[key] for key, after in verifier_counts(self.verifier).items()}
        )
        info["response_length"] = (
            statistics.fmean(rollout.content_length(r) for r in range(len(rollout.response_ids)))
            if rollout.response_ids
            else None
        )
        timings["time_reward"] += time.perf_counter() - start
        store_rows = []
        if config.store.record:
            prompt_texts = [with_suffix(p.problem, config.data.prompt_suffix) for p in kept_problems]
            store_rows = stored_rows(records, rollout, prompt_texts, self.tokenizer_id)
        self._rollout = rollout
        return PolicyRollout(kept_problems, outcomes, records, shared, info, timings, store_rows)

    def _generate(self, prompts: list[str], seed: int) -> RolloutBatch:
        """The engine's samples; under data parallelism each rank samples its share (HF: of the
        generate-call chunks, on the gathered weights; vLLM: its engine group's prompts), and every
        rank receives all of them."""
        if self.world == 1:
            return self.engine.generate(self.policy, prompts, self.sampling, seed)

        def gather(chunks: dict) -> dict:
            return {k: v for part in all_gather_objects(chunks) for k, v in part.items()}

        if not isinstance(self.engine, HFRolloutEngine):  # vLLM: each data-parallel engine its prompts
            return self.engine.generate(self.policy, prompts, self.sampling, seed, gather=gather)  # type: ignore[call-arg]
        with gathered(self.policy.model):
            return self.engine.generate(
                self.policy, prompts, self.sampling, seed, rank=self.rank, world=self.world, gather=gather
            )

    def _score(self, responses: list[str], answers: list[str]) -> list[float]:
        """The verifier's rewards; under data parallelism rank 0 scores and sends them to all."""
        if self.world == 1:
            return self.verifier.score(responses, answers)
        return broadcast_object(self.verifier.score(responses, answers) if self.rank == 0 else None)

    # ----- the update -----------------------------------------------------------------------
    def update(
        self,
        step: int,
        plan: ExchangePlan,
        records: dict[str, list[TrajectoryRecord]],
        method_state: dict[str, Any] | None = None,
    ) -> UpdateResult:
        """Train on the planned groups (own rollout of this step + peers' records).

        ``method_state``: the driver's method state after planning (a worker in another process
        holds its own copy of the method, e.g. HACPO's capability tracker); None when shared.
        """
        if self._rollout is None:
            raise RuntimeError(f"policy {self.name!r}: update() before rollout() at step {step}")
        if method_state is not None:
            self.method.load_state_dict(method_state)
        timings: dict[str, float] = {}
        generator = torch.Generator().manual_seed(
            step_seed(self.config.seed, step, UPDATE_STREAM + self.index)
        )
        # Every rank builds all rows (peer scoring on the gathered weights), so each knows every
        # minibatch's denominators and every rank's share without communicating.
        scores = self.config.rollout.tis_cap is not None or (
            self._scores_peers and any(g.peer and not g.nll for g in plan.groups)
        )
        with gathered(self.policy.model) if scores else contextlib.nullcontext():
            rows, info = self._training_rows(step, self._rollout, plan, records, timings, generator)
        info.update(self._optimize(rows, plan, timings, generator))
        self._rollout = None
        start = time.perf_counter()
        self._sync_engine()
        timings["time_weight_sync"] = time.perf_counter() - start
        info.update(timings)
        info["memory_peak_mb"] = peak_memory_mb(self.policy.device)
        if self.world > 1:  # the largest rank's peak: what each device must hold
            info["memory_peak_mb"] = max(all_gather_objects(info["memory_peak_mb"]))
        return UpdateResult(info, rows.compatibility)

    @property
    def _scores_peers(self) -> bool:
        """Peer rows get the receiver's old log-probs (one no-grad pass) for the method's loss or
        its compatibility scores; otherwise they enter with w = 1 and are never scored."""
        return self.method.needs_peer_old_logprobs or self.method.scores_peers

    def _training_rows(
        self,
        step: int,
        rollout: RolloutBatch,
        plan: ExchangePlan,
        records: dict[str, list[TrajectoryRecord]],
        timings: dict[str, float],
        generator: torch.Generator,
    ) -> tuple[TrainingRows, dict[str, Any]]:
        """The receiver's rows for every planned group; peer rows re-tokenized and re-scored."""
        policy, n = self.policy, rollout.n
        rows = TrainingRows()
        peer_rows: list[int] = []
        peer_records: list[TrajectoryRecord] = []
        own_rows: list[int] = []
        moved_rows: dict[tuple[int, int], int] = {}  # (group, response) -> row, of peer groups
        for group_index, group in enumerate(plan.groups):
            for i in range(n):
                if group.keep is not None and not bool(group.keep[i]):
                    continue
                flat = group.prompt * n + i
                if group.peer:
                    moved_rows[(group_index, i)] = len(rows.response_ids)
                    record = records[group.source][flat]
                    response = policy.encode_response(record.response, record.finished)
                    old: Tensor | None = torch.zeros(len(response))  # unused by NLL rows
                    if not group.nll:  # scored below, in one batched pass
                        peer_rows.append(len(rows.response_ids))
                        peer_records.append(record)
                    finished, mean_logp = record.finished, record.mean_logprob
                else:
                    own_rows.append(len(rows.response_ids))
                    response, old = rollout.response_ids[flat], rollout.behaviour_logprobs[flat]
                    finished, mean_logp = rollout.finished[flat], rollout.content_mean_logprob(flat)
                rows.append(
                    group_index,
                    rollout.prompt_ids[group.prompt],
                    response,
                    old,
                    float(group.advantages[i]),
                    group.peer,
                    group.nll,
                    group.source,
                    finished,
                    mean_logp,
                )
        info: dict[str, Any] = {"peer_responses": len(peer_rows)}
        cap = self.config.rollout.tis_cap
        if cap is not None and own_rows:
            # Truncated importance sampling: the trainer's own old log-probs replace the rollout
            # engine's in the ratio, and min(pi_trainer / pi_rollout, cap) weighs each token.
            start = time.perf_counter()
            trainer_old = policy.score(
                [rows.prompt_ids[r] for r in own_rows], [rows.response_ids[r] for r in own_rows]
            )
            for r, old in zip(own_rows, trainer_old, strict=True):
                behaviour = rows.old_logprobs[r]
                assert behaviour is not None
                rows.tis_weights[r] = truncated_is_weights(old, behaviour, cap)
                rows.old_logprobs[r] = old
            weights = torch.cat([rows.tis_weights[r] for r in own_rows])  # type: ignore[misc]
            info.update(
                tis_weight_mean=float(weights.mean()),
                tis_truncated_frac=float((weights >= cap).float().mean()),
            )
            timings["time_old_logprob"] = time.perf_counter() - start
        if not peer_rows:
            return rows, info
        if self._scores_peers:
            start = time.perf_counter()
            # The receiver's old policy on its own tokenization of every grafted response (eq. 9),
            # which also gives lbar for the compatibility score (eq. 7, EOS excluded on both sides).
            old_logprobs = policy.score(
                [rows.prompt_ids[r] for r in peer_rows], [rows.response_ids[r] for r in peer_rows]
            )
            for k, row in enumerate(peer_rows):
                rows.old_logprobs[row] = old_logprobs[k]
            timings["time_peer_logprob"] = time.perf_counter() - start
        if not self.method.scores_peers:  # every peer row keeps w = 1 (TrainingRows.append)
            info.update(peer_admitted=len(peer_rows), admit_rate=1.0, w_mean=1.0)
            info.update(self._contrast(plan, records, rows, moved_rows))
            return rows, info
        likelihoods = PeerLikelihoods(
            receiver_mean_logp=torch.tensor(
                [
                    content_mean_logprob(lp, rec.finished)
                    for lp, rec in zip(old_logprobs, peer_records, strict=True)
                ]
            ),
            receiver_tokens=torch.tensor(
                [len(lp) - int(rec.finished) for lp, rec in zip(old_logprobs, peer_records, strict=True)]
            ),
            source_mean_logp=torch.tensor([rec.mean_logprob for rec in peer_records]),
            source_tokens=torch.tensor([rec.num_tokens for rec in peer_records]),
            num_bytes=torch.tensor([max(rec.num_bytes, 1) for rec in peer_records]),
        )
        s = self.method.compatibility(likelihoods)
        w = self.method.peer_weights(s, generator)
        for k, row in enumerate(peer_rows):
            rows.weights[row] = float(w[k])
        info.update(
            peer_admitted=int((w > 0).sum()),
            admit_rate=float((w > 0).float().mean()),
            s_mean=float(s.mean()),
            s_median=float(s.median()),
            s_min=float(s.min()),
            s_max=float(s.max()),
            w_mean=float(w.mean()),
        )
        info.update(self._contrast(plan, records, rows, moved_rows))
        # The driver appends it to compatibility.jsonl (one writer, whatever the backend).
        rows.compatibility = CompatibilityScores(
            step=step,
            receiver=policy.name,
            source=[rec.source for rec in peer_records],
            s=[round(float(x), 5) for x in s],
            reward=[rec.reward for rec in peer_records],
            w=[round(float(x), 5) for x in w],
            advantage=[round(rows.advantages[row], 5) for row in peer_rows],
            prompt_id=[rec.prompt_id for rec in peer_records],
            response=[rec.response for rec in peer_records] if self.config.logging.log_transfers else None,
        )
        return rows, info

    def _contrast(
        self,
        plan: ExchangePlan,
        records: dict[str, list[TrajectoryRecord]],
        rows: TrainingRows,
        moved_rows: dict[tuple[int, int], int],
    ) -> dict[str, Any]:
        """The contrast metrics of the step's moved groups (``core.contrast``), on the receiver's
        tokenization: every response of each moved source group (one the receiver does not train
        on, e.g. a wrong one under success-only transfer, is tokenized here and pushes 0)."""
        if self.rank != 0:  # every rank holds the same rows; rank 0's metrics are the policy's
            return {}
        n, logging = self.sampling.n, self.config.logging
        total = GroupContrast()
        for group_index, group in enumerate(plan.groups):
            if not group.peer or group.nll:
                continue
            tokens, correct, push, logprobs = [], [], [], []
            for i in range(n):
                record = records[group.source][group.prompt * n + i]
                row = moved_rows.get((group_index, i))
                ids = (
                    rows.response_ids[row]
                    if row is not None
                    else self.policy.encode_response(record.response, record.finished)
                )
                tokens.append(ids[:-1] if record.finished else ids)  # content tokens, no EOS
                correct.append(record.reward > 0)
                push.append(rows.weights[row] * rows.advantages[row] if row is not None else 0.0)
                # the receiver's old log-probs of a scored row (peer rows of a scoring method)
                old = rows.old_logprobs[row] if row is not None and self._scores_peers else None
                logprobs.append(old.tolist() if old is not None else None)
            total += group_contrast(
                tokens, correct, push, logging.contrast_max_tokens, logging.contrast_max_pairs, logprobs
            )
        return contrast_metrics(total)

    def _optimize(
        self, rows: TrainingRows, plan: ExchangePlan, timings: dict[str, float], generator: torch.Generator
    ) -> dict[str, Any]:
        """The optimizer steps over the planned groups, in the method's minibatch order."""
        policy, train = self.policy, self.config.train
        start = time.perf_counter()
        order = self.method.order_minibatches(plan, train.minibatch_prompts, generator)
        rows_of_group: dict[int, list[int]] = defaultdict(list)
        for row, group in enumerate(rows.group):
            rows_of_group[group].append(row)
        assert policy.optimizer is not None
        policy.model.train()
        totals: dict[str, float] = defaultdict(float)
        losses, grad_norms = [], []
        skipped = 0  # minibatches whose loss or grad norm was NaN/inf (no optimizer step)
        signs_reported = False  # the method's loss splits clipped peer tokens by the advantage's sign
        minibatch_index = 0
        for _ in range(train.update_epochs):
            for groups in order:
                members = [r for g in groups.tolist() for r in rows_of_group[g]]
                kept = [r for r in members if rows.weights[r] > 0]
                nll_rows = [r for r in members if rows.is_nll[r]]
                normalizer = sum(len(rows.response_ids[r]) for r in kept)
                nll_normalizer = sum(len(rows.response_ids[r]) for r in nll_rows)
                totals["rows"] += len(kept) + len(nll_rows)
                # Rows with zero advantage add only to the denominator: their gradient is exactly
                # zero, so skipping their forward pass changes nothing but the cost — except own
                # rows under a KL penalty, whose KL term still has a gradient.
                active = sorted(
                    [
                        r
                        for r in kept
                        if rows.advantages[r] != 0 or (train.kl_coef > 0 and not rows.is_peer[r])
                    ]
                    + nll_rows,
                    key=lambda r: len(rows.prompt_ids[r]) + len(rows.response_ids[r]),
                )
                for r in kept:
                    totals["peer_tokens" if rows.is_peer[r] else "own_tokens"] += len(rows.response_ids[r])
                    if rows.is_peer[r] and rows.advantages[r] != 0:
                        sign = "pos" if rows.advantages[r] > 0 else "neg"
                        totals[f"peer_{sign}_tokens"] += len(rows.response_ids[r])
                policy.optimizer.zero_grad(set_to_none=False)
                parts = [[active[i] for i in part] for part in self._micro_batches_of_ranks(rows, active)]
                loss_value = clipped_own = clipped_peer = clipped_pos = clipped_neg = 0.0
                for idx in parts:
                    # An idle rank runs one of the minibatch's rows with loss x 0: FSDP's collectives
                    # need every rank in every forward and backward.
                    idle = not idx
                    inputs = self._loss_inputs(
                        rows, idx or active[:1], normalizer, nll_normalizer, len(kept), minibatch_index
                    )
                    loss, m = self.method.loss(inputs)
                    # FSDP averages gradients over ranks; the loss over the whole minibatch is the sum.
                    (loss * (0 if idle else self.world)).backward()
                    if idle:
                        continue
                    loss_value += float(loss.detach())
                    clipped_own += float(m.get("own_clipped_tokens", 0.0))
                    clipped_peer += float(m.get("peer_clipped_tokens", 0.0))
                    signs_reported |= "peer_pos_clipped_tokens" in m
                    clipped_pos += float(m.get("peer_pos_clipped_tokens", 0.0))
                    clipped_neg += float(m.get("peer_neg_clipped_tokens", 0.0))
                if self.world > 1:
                    loss_value, clipped_own, clipped_peer, clipped_pos, clipped_neg = sum_across_ranks(
                        [loss_value, clipped_own, clipped_peer, clipped_pos, clipped_neg]
                    )
                totals["own_clipped_tokens"] += clipped_own
                totals["peer_clipped_tokens"] += clipped_peer
                totals["peer_pos_clipped_tokens"] += clipped_pos
                totals["peer_neg_clipped_tokens"] += clipped_neg
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    policy.model.parameters(), self.config.optim.grad_clip
                )
                if hasattr(grad_norm, "full_tensor"):  # DTensor: the global norm over every shard
                    grad_norm = grad_norm.full_tensor()
                minibatch_index += 1
                if not (math.isfinite(loss_value) and math.isfinite(float(grad_norm))):
                    skipped += 1
                    self._skip_nonfinite(loss_value, float(grad_norm))
                    continue
                self._nonfinite_in_row = 0
                policy.optimizer.step()
                losses.append(loss_value)
                grad_norms.append(float(grad_norm))
        timings["time_update"] = time.perf_counter() - start
        return {
            "loss": statistics.fmean(losses) if losses else 0.0,
            "grad_norm": statistics.fmean(grad_norms) if grad_norms else 0.0,
            "optimizer_steps": len(losses),
            "nonfinite_skips": skipped,
            "clip_frac_own": totals["own_clipped_tokens"] / max(totals["own_tokens"], 1),
            "clip_frac_peer": totals["peer_clipped_tokens"] / totals["peer_tokens"]
            if totals["peer_tokens"]
            else None,
            **{
                f"clip_frac_peer_{sign}": totals[f"peer_{sign}_clipped_tokens"]
                / totals[f"peer_{sign}_tokens"]
                if totals[f"peer_{sign}_tokens"] and signs_reported
                else None
                for sign in ("pos", "neg")
            },
            "train_tokens": totals["own_tokens"] + totals["peer_tokens"],
            "train_rows": int(totals["rows"]),
        }

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        """Drop a non-finite minibatch's gradient; stop after ``train.max_nonfinite_steps`` in a row."""
        assert self.policy.optimizer is not None
        self.policy.optimizer.zero_grad(set_to_none=False)
        self._nonfinite_in_row += 1
        limit = self.config.train.max_nonfinite_steps
        if self._nonfinite_in_row >= limit:
            raise TrainingDivergedError(
                f"policy {self.name!r}: loss {loss} / grad norm {grad_norm} non-finite in {limit} optimizer "
                "steps in a row (train.max_nonfinite_steps); the weights are kept from before them: lower "
                "optim.lr, set train.log_ratio_clamp or train.clip_ratio_c, or check the data and model"
            )

    def _micro_batches_of_ranks(self, rows: TrainingRows, active: list[int]) -> list[list[int]]:
        """This rank's micro-batches (positions in ``active``), padded with empty ones to the most
        any rank has: one rank's rows as today, or its token-balanced share (``split_rows``), each cut
        by ``micro_batch_size`` rows or ``micro_batch_tokens`` padded tokens (``micro_batch_groups``)."""
        shapes = [(len(rows.prompt_ids[r]), len(rows.response_ids[r])) for r in active]
        if self.world == 1:
            return self.policy.micro_batch_groups(shapes)
        shares = split_rows([p + r for p, r in shapes], self.world)
        per_rank = [
            [
                [share[k] for k in group]
                for group in self.policy.micro_batch_groups([shapes[i] for i in share])
            ]
            for share in shares
        ]
        count = max(len(parts) for parts in per_rank)
        mine = per_rank[self.rank]
        return mine + [[] for _ in range(count - len(mine))]

    def _loss_inputs(
        self,
        rows: TrainingRows,
        idx: list[int],
        normalizer: int,
        nll_normalizer: int,
        num_rows: int,
        minibatch_index: int,
    ) -> LossInputs:
        """One micro-batch: the forward pass with grad, padded old log-probs and the row fields."""
        policy, train = self.policy, self.config.train
        batch = policy.pad([rows.prompt_ids[r] for r in idx], [rows.response_ids[r] for r in idx])
        logp = policy.response_logprobs(batch)  # [B, T]
        device = logp.device
        width = logp.shape[1]
        old = torch.nn.utils.rnn.pad_sequence([rows.old_logprobs[r] for r in idx], batch_first=True)  # type: ignore[misc]
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = self.reference.response_logprobs(batch)
        token_weights = None
        if any(rows.tis_weights[r] is not None for r in idx):
            token_weights = torch.nn.utils.rnn.pad_sequence(
                [
                    w if (w := rows.tis_weights[r]) is not None else torch.ones(len(rows.response_ids[r]))
                    for r in idx
                ],
                batch_first=True,
            ).to(device)[:, :width]

        def column(values: list[Any]) -> Tensor:
            return torch.tensor(values, device=device)

        return LossInputs(
            logp=logp,
            old_logp=old.to(device)[:, :width],
            advantages=column([rows.advantages[r] for r in idx]),
            weights=column([rows.weights[r] for r in idx]),
            mask=batch.response_mask,
            is_peer=column([rows.is_peer[r] for r in idx]),
            normalizer=max(normalizer, 1),
            eps_low=train.eps_low,
            eps_high=train.eps_high,
            is_nll=column([rows.is_nll[r] for r in idx]),
            nll_normalizer=max(nll_normalizer, 1),
            minibatch_tokens=max(normalizer + nll_normalizer, 1),
            sources=tuple(rows.source[r] for r in idx),
            receiver=policy.name,
            minibatch_index=minibatch_index,
            ref_logp=ref_logp,
            kl_coef=train.kl_coef,
            num_rows=max(num_rows, 1),
            source_mean_logp=column([rows.source_mean_logp[r] for r in idx]),
            finished=column([rows.finished[r] for r in idx]),
            token_weights=token_weights,
            clip_ratio_c=train.clip_ratio_c,
            log_ratio_clamp=train.log_ratio_clamp,
        )

    # ----- checkpoints and validation ---------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """Weights and tokenizer (save_pretrained) plus the optimizer state into ``folder``.

        Under data parallelism the weights and AdamW state go to ``folder/dcp`` as a sharded
        torch.distributed.checkpoint (each rank writes its shards; loadable on any N), and rank 0
        also writes the plain save_pretrained folder (weights only) that evaluation reads."""
        if self.world == 1 or self.rank == 0:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / UPDATE_STATE).write_text(json.dumps(self._update_state()))
        if self.world == 1:
            self.policy.save(str(folder))
            assert self.policy.optimizer is not None
            torch.save(self.policy.optimizer.state_dict(), Path(folder) / "optimizer.pt")
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.policy.model, self.policy.optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(folder) / DCP_FOLDER
        )
        self.save_policy(folder)

    def save_policy(self, folder: str | Path) -> None:
        """Weights and tokenizer only (best-checkpoint copies, exports): a plain save_pretrained
        folder, gathered on rank 0 when the model is sharded."""
        if self.world == 1:
            self.policy.save(str(folder))
            return
        weights = full_state_dict(self.policy.model)
        if self.rank == 0:
            model = self.policy.model
            model.save_pretrained(str(folder), state_dict=weights)
            self.policy.tokenizer.save_pretrained(str(folder))
            # The sharded model's class is FSDP<Name>; the folder names the plain architecture.
            config_file = Path(folder) / "config.json"
            config = json.loads(config_file.read_text())
            config["architectures"] = [type(model).__mro__[1].__name__]
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        dist.barrier()

    def load(self, folder: str | Path) -> None:
        """Weights and optimizer state from a ``save`` folder, written with any number of ranks
        (a sharded checkpoint is resharded to this run's N); the engine takes the weights."""
        folder = Path(folder)
        if (folder / DCP_FOLDER).is_dir():
            self._load_sharded(folder / DCP_FOLDER)
        elif self.world == 1:
            self._load_plain(folder)
        else:
            self._load_plain_into_shards(folder)
        self._restore_update_state(folder / UPDATE_STATE)
        self._sync_engine()

    def _update_state(self) -> dict[str, Any]:
        """What the update keeps in this process besides weights and AdamW state (``UPDATE_STATE``).

        A parameter's gradient is None until the process's first backward reaches it and a zero
        tensor after every ``zero_grad(set_to_none=False)``; AdamW skips a None gradient but steps
        on a zero one (weight decay, moments). A minibatch whose rows all have zero advantage runs
        no backward, so whether it moves the weights depends on this state, which a resumed
        process must restore."""
        return {
            "gradients": [name for name, p in self.policy.model.named_parameters() if p.grad is not None],
            "nonfinite_in_row": self._nonfinite_in_row,
        }

    def _restore_update_state(self, path: Path) -> None:
        """Gradients as the saving process held them (zero tensors where it held one; between
        steps every gradient is zero). A checkpoint written before ``UPDATE_STATE`` existed: a
        parameter with AdamW state has had a gradient (AdamW creates its state on one)."""
        optimizer = self.policy.optimizer
        assert optimizer is not None
        if path.is_file():
            state = json.loads(path.read_text())
            held = set(state["gradients"])
            self._nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
        else:
            held = {name for name, p in self.policy.model.named_parameters() if optimizer.state.get(p)}
        for name, p in self.policy.model.named_parameters():
            p.grad = torch.zeros_like(p) if name in held else None

    def _sync_engine(self) -> None:
        """The engine takes the current weights; a sharded policy's vLLM engines take the full
        weights, gathered on every rank (a collective: every rank calls it)."""
        if self.world == 1 or isinstance(self.engine, HFRolloutEngine):
            self.engine.sync_weights(self.policy)
            return
        weights = full_state_dict(self.policy.model, every_rank=True)
        self.engine.sync_weights(self.policy, list(weights.items()))  # type: ignore[call-arg]

    def _plain_weights(self, folder: Path) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        weights: dict[str, Tensor] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(shard), device="cpu"))
        return weights

    def _check_keys(self, folder: Path, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        # Tied embeddings are saved once; anything else missing is a broken checkpoint.
        tied = set(getattr(self.policy.model, "_tied_weights_keys", None) or [])
        if unexpected or (set(missing) - tied):
            raise RuntimeError(f"checkpoint {folder}: missing {missing}, unexpected {unexpected}")

    def _load_plain(self, folder: Path) -> None:
        policy = self.policy
        weights = {k: v.to(policy.device) for k, v in self._plain_weights(folder).items()}
        missing, unexpected = policy.model.load_state_dict(weights, strict=False)
        self._check_keys(folder, missing, unexpected)
        assert policy.optimizer is not None
        policy.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))

    def _load_plain_into_shards(self, folder: Path) -> None:
        """A one-device checkpoint (safetensors + optimizer.pt) into this run's shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        weights = self._plain_weights(folder)
        names = [name for name, _ in self.policy.model.named_parameters()]
        expected = self.policy.model.state_dict().keys()
        self._check_keys(
            folder, [k for k in expected if k not in weights], [k for k in weights if k not in expected]
        )
        # optimizer.pt numbers parameters in model.parameters() order; DCP names them.
        raw = torch.load(folder / "optimizer.pt", weights_only=True)
        optimizer_state = {
            "state": {names[i]: value for i, value in raw["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]} for group in raw["param_groups"]
            ],
        }
        set_state_dict(
            self.policy.model,
            self.policy.optimizer,
            model_state_dict=weights,
            optim_state_dict=optimizer_state,
            options=StateDictOptions(full_state_dict=True, strict=False),
        )

    def _load_sharded(self, checkpoint: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.policy.model, self.policy.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(
            self.policy.model,
            self.policy.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )

    def validation_scores(self) -> dict[str, float]:
        """pass@1 per validation benchmark of the current weights (``graftrl.training.validation``),
        sampled by this policy's own rollout engine (the one training samples with)."""
        if self.validator is None:
            from graftrl.training.validation import Validator

            verifier = self.verifier if self.world == 1 else _RankZeroVerifier(self._score)
            self.validator = Validator(self.config, self.run_dir, verifier, self.engine)
        # Sharded: every rank samples the whole benchmark on the gathered weights with the same
        # seeds (the samples of one device, whatever N), rank 0 verifies and shares the rewards.
        with gathered(self.policy.model):
            return self.validator.scores(self.policy)

    def state_dict(self) -> dict[str, Tensor]:
        """The model's full weights (for tests comparing backends and rank counts)."""
        return {k: v.detach().cpu().clone() for k, v in full_state_dict(self.policy.model).items()}

    def nonfinite_state(self, limit: int = 3) -> list[str]:
        """Names of up to ``limit`` weight or optimizer-state tensors holding NaN or inf (checked
        before a checkpoint is written, so a diverged state never replaces a good one)."""
        found: list[str] = []

        def check(name: str, value: Any) -> None:
            if len(found) < limit and isinstance(value, Tensor) and value.is_floating_point():
                local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor shard
                if not bool(torch.isfinite(local).all()):
                    found.append(name)

        for name, value in self.policy.model.state_dict().items():
            check(f"weights {name}", value)
        if self.policy.optimizer is not None:
            for index, state in self.policy.optimizer.state_dict()["state"].items():
                for key, value in state.items():
                    check(f"optimizer state[{index}].{key}", value)
        if self.world > 1:  # each rank checked its shards: the answer is every rank's findings
            found = sorted({name for part in all_gather_objects(found) for name in part})[:limit]
        return found

    def close(self) -> None:
        self.engine.close()
        if self._owns_verifier and hasattr(self.verifier, "close"):
            self.verifier.close()
