"""Algorithm 1: co-train K policies on a shared prompt stream with GRPO or GRAFT.

Each step: every policy samples n responses per prompt, the verifier scores them, each policy
computes its own GRPO advantages; the method plans which groups each receiver trains on; each
receiver scores the grafted responses on its own tokenization, weighs them, and updates with
peer groups ordered last. The loop knows nothing of two models in particular.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graftrl.config import Config, dump_config
from graftrl.core import (
    compatibility_score,
    complementarity,
    group_outcome_fractions,
    grpo_advantages,
    minibatch_order,
)
from graftrl.data import MathProblem, PromptSampler, load_problems
from graftrl.methods import ExchangePlan, GroupOutcomes, LossInputs, build_method
from graftrl.metrics import MetricsLogger
from graftrl.policy import Policy
from graftrl.records import TrajectoryRecord
from graftrl.rewards import MathVerifier
from graftrl.rollout import HFRolloutEngine, RolloutBatch, SamplingParams, content_mean_logprob
from graftrl.store import StoreError, TrajectoryStore, TrajectoryWriter, rows_from_rollout, tokenizer_id


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A seed derived from (run seed, step, stream): randomness needs no state to resume."""
    return (seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1)


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


@dataclass
class PolicyRollout:
    """One policy's scored groups at a step (``Trainer._rollout_policy``)."""

    problems: list[MathProblem]
    """The prompts it trains on (the shared batch, unless dynamic sampling replaced some)."""
    rollout: RolloutBatch
    outcomes: GroupOutcomes
    records: list[TrajectoryRecord]
    shared: GroupOutcomes
    """Its outcomes on the step's shared prompt batch (the first round), for complementarity."""
    info: dict[str, Any]
    """Dynamic-sampling metrics ({} when off)."""


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


class Trainer:
    """Runs Algorithm 1 for a config and writes everything into ``run_dir``."""

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        *,
        problems: Sequence[MathProblem] | None = None,
        policies: Sequence[Policy] | None = None,
        verifier: MathVerifier | None = None,
        step_callback: Callable[[int, dict[str, dict[str, Any]]], None] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.problems = list(problems) if problems is not None else load_problems(config.data.train)
        self.policies = (
            list(policies)
            if policies is not None
            else [self._load_policy(i) for i in range(len(config.policies))]
        )
        for policy, policy_config in zip(self.policies, config.policies, strict=True):
            policy.temperature = config.rollout.temperature
            policy.micro_batch_size = config.train.micro_batch_size
            if policy.optimizer is None:
                policy.configure_optimizer(
                    policy_config.lr or config.optim.lr, config.optim.betas, config.optim.weight_decay
                )
        self.method = build_method(config.method, config)
        # Frozen copies of the initial policies, for a KL penalty (off unless train.kl_coef > 0).
        self.references: dict[str, Policy] = {}
        if config.train.kl_coef > 0:
            for policy in self.policies:
                self.references[policy.name] = policy.frozen_copy()
        self.sampler = PromptSampler(self.problems, config.train.batch_prompts, config.seed)
        # Dynamic sampling's extra prompts: a second stream, one slot per (step, policy, round).
        self.extra_sampler = PromptSampler(
            self.problems, config.train.batch_prompts, step_seed(config.seed, 0, 999_983)
        )
        self.engine = HFRolloutEngine(config.rollout.max_batch_size)
        self.sampling = SamplingParams(
            n=config.rollout.n,
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        self._owns_verifier = verifier is None
        self.verifier = verifier or MathVerifier(
            timeout_s=config.reward.timeout_s, workers=config.reward.workers
        )
        self.step_callback = step_callback
        self.start_step = 0
        self.logger: MetricsLogger | None = None
        self.validator = None
        if config.validation.files:  # validation and best-checkpoint selection (graftrl.validation)
            from graftrl.validation import Validator

            self.validator = Validator(config, self.run_dir, self.verifier, self.engine)
        # Trajectory recording (graftrl.store) and stored peers replayed from earlier runs (SPEC 2.3).
        self.recorder = None
        if config.store.record:
            self.recorder = TrajectoryWriter(Path(config.store.path or self.run_dir / "store"))
        self.tokenizer_ids = (
            {p.name: tokenizer_id(p.tokenizer) for p in self.policies} if self.recorder else {}
        )
        self.stored_peers = {peer.name: (peer, TrajectoryStore(peer.path)) for peer in config.peers}

    # ----- construction -------------------------------------------------------------------
    def _load_policy(self, index: int) -> Policy:
        spec = self.config.policies[index]
        return Policy.from_pretrained(
            spec.name,
            spec.path,
            dtype=spec.dtype,
            param_dtype=spec.param_dtype,
            device=spec.device,
            template=spec.template,
            chat_template=spec.chat_template,
        )

    # ----- the loop -----------------------------------------------------------------------
    def train(self, resume: bool = False) -> None:
        (self.run_dir / "config.yaml").write_text(dump_config(self.config))
        logging = self.config.logging
        self.logger = MetricsLogger(
            self.run_dir,
            logging.tensorboard,
            logging.wandb,
            logging.wandb_project,
            self.config.model_dump(mode="json"),
        )
        if resume:
            self.resume()
        total = self.config.train.steps
        every = self.config.checkpoint.every
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            with Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                disable=not logging.progress,
            ) as progress:
                task = progress.add_task(
                    f"{self.config.method} train", total=total, completed=self.start_step, status=""
                )
                for step in range(self.start_step, total):
                    metrics = self.step(step)
                    status = "  ".join(f"{name} r={m['reward_mean']:.2f}" for name, m in metrics.items())
                    progress.update(task, advance=1, status=status)
                    if self.step_callback is not None:
                        self.step_callback(step, metrics)
                    if self.validator is not None:  # after the step: not part of its timings
                        self.validator(step, self.policies)
                    if (every and (step + 1) % every == 0) or step + 1 == total:
                        self.save_checkpoint(step)
        finally:
            self.logger.close()
            if self._owns_verifier:
                self.verifier.close()

    def step(self, step: int) -> dict[str, dict[str, Any]]:
        """One rollout batch and one update of every policy; returns metrics per model."""
        problems = self.sampler.batch(step)
        timings: dict[str, dict[str, float]] = defaultdict(dict)
        sampled = {
            policy.name: self._rollout_policy(step, index, policy, problems, timings[policy.name])
            for index, policy in enumerate(self.policies)
        }
        rollouts = {name: s.rollout for name, s in sampled.items()}
        outcomes = {name: s.outcomes for name, s in sampled.items()}
        records = {name: s.records for name, s in sampled.items()}
        shared = {name: s.shared for name, s in sampled.items()}
        if self.recorder is not None:
            self._record(step, sampled)
        stored_info: dict[str, float] = {}
        for name, (stored_outcomes, stored_records, changed) in self._stored_peer_groups(
            step, problems
        ).items():
            outcomes[name], records[name], shared[name] = stored_outcomes, stored_records, stored_outcomes
            stored_info[f"stored_reward_changes/{name}"] = changed

        generator = torch.Generator().manual_seed(step_seed(self.config.seed, step, 0))
        plans = self.method.plan(outcomes, generator)
        metrics: dict[str, dict[str, Any]] = {}
        for policy in self.policies:
            row = self._update(
                step,
                policy,
                rollouts[policy.name],
                plans[policy.name],
                records,
                timings[policy.name],
                generator,
            )
            row.update(self._outcome_metrics(policy.name, outcomes, rollouts[policy.name], shared))
            row.update(sampled[policy.name].info)
            row.update(stored_info)
            row.update(plans[policy.name].diagnostics)
            row.update(timings[policy.name])
            row["time_step"] = sum(timings[policy.name].values())
            metrics[policy.name] = row
        for name, row in metrics.items():
            assert self.logger is not None
            self.logger.log({"step": step, "model": name, "method": self.method.name, **row})
        self._log_samples(step, {name: s.problems for name, s in sampled.items()}, rollouts, outcomes)
        return metrics

    def _rollout_policy(
        self,
        step: int,
        index: int,
        policy: Policy,
        problems: list[MathProblem],
        timings: dict[str, float],
    ) -> PolicyRollout:
        """Sample, score and compute GRPO advantages for one policy on the step's prompts.

        With ``rollout.dynamic_sampling`` (DAPO, SPEC 3) the policy keeps only groups whose rewards
        are not all equal; round r >= 1 draws ``batch_prompts`` more prompts from the auxiliary
        stream at slot (step, policy, r), which depends only on (seed, step, policy, round) so
        resume stays exact, skipping prompts already drawn at this step. It stops once
        ``batch_prompts`` informative groups are kept (the surplus of the last round is cut, in
        draw order) or after ``max_sampling_rounds`` rounds, and then trains on what it kept: fewer
        groups, or none (no optimizer step for this policy at this step).
        """
        config, n = self.config, self.sampling.n
        dynamic = config.rollout.dynamic_sampling
        rounds = config.rollout.max_sampling_rounds if dynamic else 1
        target = config.train.batch_prompts
        seen = {p.id for p in problems}
        batch = problems
        parts: list[tuple[RolloutBatch, list[int]]] = []
        kept_problems: list[MathProblem] = []
        kept_rewards: list[Tensor] = []
        first_rewards: Tensor | None = None
        timings["time_rollout"] = timings["time_reward"] = 0.0
        rounds_run = prompts_sampled = 0
        for round_ in range(rounds):
            if round_:
                slot = (step * len(self.policies) + index) * (rounds - 1) + round_ - 1
                batch = []
                for problem in self.extra_sampler.batch(slot):
                    if problem.id not in seen:
                        seen.add(problem.id)
                        batch.append(problem)
                if not batch:
                    continue
            start = time.perf_counter()
            torch.manual_seed(step_seed(config.seed, step, 1 + index + 1000 * round_))
            prompts = [with_suffix(p.problem, config.data.prompt_suffix) for p in batch]
            rollout = self.engine.generate(policy, prompts, self.sampling)
            timings["time_rollout"] += time.perf_counter() - start

            start = time.perf_counter()
            answers = [p.answer for p in batch for _ in range(n)]
            rewards = torch.tensor(self.verifier.score(rollout.texts, answers), dtype=torch.float32)
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
        records = self._records(step, policy.name, kept_problems, rollout, rewards, advantages)
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
        timings["time_reward"] += time.perf_counter() - start
        return PolicyRollout(kept_problems, rollout, outcomes, records, shared, info)

    # ----- pieces of a step ---------------------------------------------------------------
    def _record(self, step: int, sampled: dict[str, Any]) -> None:
        """Write every policy's groups of this step to the trajectory store (one Parquet file)."""
        assert self.recorder is not None
        rows = []
        for policy in self.policies:
            part = sampled[policy.name]
            prompts = [with_suffix(p.problem, self.config.data.prompt_suffix) for p in part.problems]
            rows += rows_from_rollout(
                step,
                policy.name,
                self.tokenizer_ids[policy.name],
                part.problems,
                part.rollout,
                part.outcomes.rewards,
                part.outcomes.advantages,
                prompt_texts=prompts,
            )
        self.recorder.write_step(step, rows)

    def _stored_peer_groups(
        self, step: int, problems: Sequence[MathProblem]
    ) -> dict[str, tuple[GroupOutcomes, list[TrajectoryRecord], float]]:
        """Each stored peer's groups on this step's prompts, rewards re-verified (SPEC 2.3).

        A group whose re-verified rewards equal the stored ones keeps its stored (source-computed)
        advantages; one whose rewards changed gets advantages recomputed on its full group.
        """
        out = {}
        n = self.sampling.n
        for name, (peer, store) in self.stored_peers.items():
            ids = [p.id for p in problems]
            if peer.match == "step" and step not in store.steps():
                held = store.steps()
                raise StoreError(
                    f"peers[{name}]: store {peer.path} has no step {step} (it holds steps "
                    f"{held[0] if held else '-'}..{held[-1] if held else '-'}); train for at most as many "
                    "steps as were recorded, or set `match: prompt_id` to match prompts regardless of step"
                )
            found = store.find_groups(ids, source=name, step=step if peer.match == "step" else None)
            missing = [i for i in ids if i not in found]
            if missing:
                where = f"step {step}" if peer.match == "step" else "any step"
                raise StoreError(
                    f"peers[{name}]: store {peer.path} has no group of source {name!r} at {where} for "
                    f"{len(missing)} of the step's {len(ids)} prompts (e.g. {missing[:3]}); record the peer "
                    "with the same data, seed and batch size, or set `match: prompt_id`"
                )
            groups = [sorted(found[i], key=lambda row: row.index) for i in ids]
            sizes = {len(g) for g in groups}
            if sizes != {n}:
                raise StoreError(
                    f"peers[{name}]: stored groups hold {sorted(sizes)} responses; set rollout.n: {n} to match or re-record"
                )
            texts = [row.response for group in groups for row in group]
            answers = [p.answer for p in problems for _ in range(n)]
            rewards = torch.tensor(self.verifier.score(texts, answers), dtype=torch.float32).view(len(ids), n)
            stored_rewards = torch.tensor([[row.reward for row in g] for g in groups], dtype=torch.float32)
            stored_advantages = torch.tensor(
                [[row.advantage for row in g] for g in groups], dtype=torch.float32
            )
            changed = (rewards != stored_rewards).any(dim=-1)  # [P]
            recomputed = grpo_advantages(
                rewards, self.config.train.adv_eps, self.config.train.adv_std_unbiased
            )
            advantages = torch.where(changed.unsqueeze(-1), recomputed, stored_advantages)
            records = [
                dataclasses.replace(
                    row.to_record(), reward=float(rewards[p, i]), advantage=float(advantages[p, i])
                )
                for p, group in enumerate(groups)
                for i, row in enumerate(group)
            ]
            out[name] = (GroupOutcomes(rewards, advantages), records, float(changed.sum()))
        return out

    @staticmethod
    def _records(
        step: int,
        source: str,
        problems: Sequence[MathProblem],
        rollout: RolloutBatch,
        rewards: Tensor,
        advantages: Tensor,
    ) -> list[TrajectoryRecord]:
        n = rollout.n
        return [
            TrajectoryRecord(
                prompt_id=problems[row // n].id,
                step=step,
                source=source,
                index=row % n,
                response=rollout.texts[row],
                reward=float(rewards.view(-1)[row]),
                advantage=float(advantages.view(-1)[row]),
                mean_logprob=rollout.content_mean_logprob(row),
                num_tokens=rollout.content_length(row),
                num_bytes=len(rollout.texts[row].encode("utf-8")),
                finished=rollout.finished[row],
            )
            for row in range(len(rollout.texts))
        ]

    def _training_rows(
        self,
        step: int,
        policy: Policy,
        rollout: RolloutBatch,
        plan: ExchangePlan,
        records: dict[str, list[TrajectoryRecord]],
        timings: dict[str, float],
        generator: torch.Generator,
    ) -> tuple[TrainingRows, dict[str, Any]]:
        """The receiver's rows for every planned group; peer rows re-tokenized and re-scored."""
        n = rollout.n
        rows = TrainingRows()
        peer_rows: list[int] = []
        peer_records: list[TrajectoryRecord] = []
        for group_index, group in enumerate(plan.groups):
            for i in range(n):
                if group.keep is not None and not bool(group.keep[i]):
                    continue
                flat = group.prompt * n + i
                if group.peer:
                    record = records[group.source][flat]
                    response = policy.encode_response(record.response, record.finished)
                    old: Tensor | None = torch.zeros(len(response))  # unused by NLL rows
                    if not group.nll:  # scored below, in one batched pass
                        peer_rows.append(len(rows.response_ids))
                        peer_records.append(record)
                    finished, mean_logp = record.finished, record.mean_logprob
                else:
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
        if not peer_rows:
            return rows, info
        start = time.perf_counter()
        # The receiver's old policy on its own tokenization of every grafted response (eq. 9),
        # which also gives lbar for the compatibility score (eq. 7, EOS excluded on both sides).
        old_logprobs = policy.score(
            [rows.prompt_ids[r] for r in peer_rows], [rows.response_ids[r] for r in peer_rows]
        )
        receiver_mean = torch.tensor(
            [
                content_mean_logprob(lp, rec.finished)
                for lp, rec in zip(old_logprobs, peer_records, strict=True)
            ]
        )
        source_mean = torch.tensor([rec.mean_logprob for rec in peer_records])
        if self.config.graft.compat_normalization == "byte":
            # Total log-likelihood of the same string under each model, per UTF-8 byte.
            receiver_tokens = torch.tensor(
                [len(lp) - int(rec.finished) for lp, rec in zip(old_logprobs, peer_records, strict=True)]
            )
            num_bytes = torch.tensor([max(rec.num_bytes, 1) for rec in peer_records])
            source_tokens = torch.tensor([rec.num_tokens for rec in peer_records])
            receiver_mean = receiver_mean * receiver_tokens / num_bytes
            source_mean = source_mean * source_tokens / num_bytes
        s = compatibility_score(receiver_mean, source_mean)
        w = self.method.peer_weights(s, generator)
        for k, row in enumerate(peer_rows):
            rows.old_logprobs[row] = old_logprobs[k]
            rows.weights[row] = float(w[k])
        timings["time_peer_logprob"] = time.perf_counter() - start
        info.update(
            peer_admitted=int((w > 0).sum()),
            admit_rate=float((w > 0).float().mean()),
            s_mean=float(s.mean()),
            s_median=float(s.median()),
            s_min=float(s.min()),
            s_max=float(s.max()),
            w_mean=float(w.mean()),
        )
        with (self.run_dir / "compatibility.jsonl").open("a") as handle:
            row = {
                "step": step,
                "receiver": policy.name,
                "source": [rec.source for rec in peer_records],
                "s": [round(float(x), 5) for x in s],
                "reward": [rec.reward for rec in peer_records],
            }
            handle.write(json.dumps(row) + "\n")
        return rows, info

    def _update(
        self,
        step: int,
        policy: Policy,
        rollout: RolloutBatch,
        plan: ExchangePlan,
        records: dict[str, list[TrajectoryRecord]],
        timings: dict[str, float],
        generator: torch.Generator,
    ) -> dict[str, Any]:
        rows, info = self._training_rows(step, policy, rollout, plan, records, timings, generator)
        start = time.perf_counter()
        train = self.config.train
        is_peer_group = torch.tensor([g.peer for g in plan.groups], dtype=torch.bool)
        # A method may lay out its own optimizer steps (HACPO: each prompt's pooled groups together).
        custom_order = getattr(self.method, "order_minibatches", None)
        if custom_order is not None:
            order = custom_order(plan, train.minibatch_prompts, generator)
        else:
            order = minibatch_order(
                is_peer_group, train.minibatch_prompts, self.method.peer_position, generator
            )
        rows_of_group: dict[int, list[int]] = defaultdict(list)
        for row, group in enumerate(rows.group):
            rows_of_group[group].append(row)
        assert policy.optimizer is not None
        policy.model.train()
        totals: dict[str, float] = defaultdict(float)
        losses, grad_norms = [], []
        minibatch_index = 0
        for _ in range(train.update_epochs):
            for groups in order:
                members = [r for g in groups.tolist() for r in rows_of_group[g]]
                kept = [r for r in members if rows.weights[r] > 0]
                nll_rows = [r for r in members if rows.is_nll[r]]
                normalizer = sum(len(rows.response_ids[r]) for r in kept)
                nll_normalizer = sum(len(rows.response_ids[r]) for r in nll_rows)
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
                policy.optimizer.zero_grad(set_to_none=False)
                loss_value = 0.0
                for part in policy.micro_batches(len(active)):
                    idx = active[part]
                    batch = policy.pad([rows.prompt_ids[r] for r in idx], [rows.response_ids[r] for r in idx])
                    logp = policy.response_logprobs(batch)
                    old = torch.nn.utils.rnn.pad_sequence(
                        [rows.old_logprobs[r] for r in idx], batch_first=True
                    )
                    device = logp.device
                    reference = self.references.get(policy.name)
                    ref_logp = None
                    if reference is not None:
                        with torch.no_grad():
                            ref_logp = reference.response_logprobs(batch)
                    loss, m = self.method.loss(
                        LossInputs(
                            logp=logp,
                            old_logp=old.to(device)[:, : logp.shape[1]],
                            advantages=torch.tensor([rows.advantages[r] for r in idx], device=device),
                            weights=torch.tensor([rows.weights[r] for r in idx], device=device),
                            mask=batch.response_mask,
                            is_peer=torch.tensor([rows.is_peer[r] for r in idx], device=device),
                            normalizer=max(normalizer, 1),
                            eps_low=train.eps_low,
                            eps_high=train.eps_high,
                            is_nll=torch.tensor([rows.is_nll[r] for r in idx], device=device),
                            nll_normalizer=max(nll_normalizer, 1),
                            sources=tuple(rows.source[r] for r in idx),
                            receiver=policy.name,
                            minibatch_index=minibatch_index,
                            ref_logp=ref_logp,
                            kl_coef=train.kl_coef,
                            num_rows=max(len(kept), 1),
                            source_mean_logp=torch.tensor(
                                [rows.source_mean_logp[r] for r in idx], device=device
                            ),
                            finished=torch.tensor([rows.finished[r] for r in idx], device=device),
                        )
                    )
                    loss.backward()
                    loss_value += float(loss.detach())
                    for key in ("own_clipped_tokens", "peer_clipped_tokens"):
                        totals[key] += float(m.get(key, 0.0))
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    policy.model.parameters(), self.config.optim.grad_clip
                )
                policy.optimizer.step()
                minibatch_index += 1
                losses.append(loss_value)
                grad_norms.append(float(grad_norm))
        timings["time_update"] = time.perf_counter() - start
        info.update(
            loss=statistics.fmean(losses) if losses else 0.0,
            grad_norm=statistics.fmean(grad_norms) if grad_norms else 0.0,
            optimizer_steps=len(losses),
            clip_frac_own=totals["own_clipped_tokens"] / max(totals["own_tokens"], 1),
            clip_frac_peer=totals["peer_clipped_tokens"] / totals["peer_tokens"]
            if totals["peer_tokens"]
            else None,
            train_tokens=totals["own_tokens"] + totals["peer_tokens"],
        )
        return info

    def _outcome_metrics(
        self,
        name: str,
        outcomes: dict[str, GroupOutcomes],
        rollout: RolloutBatch,
        shared: dict[str, GroupOutcomes] | None = None,
    ) -> dict[str, Any]:
        """Reward and length of what the policy trains on; complementarity on the shared batch."""
        own = outcomes[name]
        all_fail, all_pass = group_outcome_fractions(own.rewards)
        row: dict[str, Any] = {
            "reward_mean": float(own.rewards.mean()),
            "all_fail_frac": float(all_fail),
            "all_pass_frac": float(all_pass),
            "response_length": statistics.fmean(
                rollout.content_length(r) for r in range(len(rollout.response_ids))
            )
            if rollout.response_ids
            else None,
        }
        shared = shared or outcomes
        for peer, other in shared.items():
            if peer != name:
                row[f"complementarity/{peer}"] = float(
                    complementarity(shared[name].successes, other.successes)
                )
        return row

    def _log_samples(self, step, problems, rollouts, outcomes) -> None:
        count = self.config.logging.log_samples
        if not count:
            return
        n = self.sampling.n
        with (self.run_dir / "samples.jsonl").open("a") as handle:
            for name, rollout in rollouts.items():
                for row in range(0, min(count * n, len(rollout.texts)), n):
                    handle.write(
                        json.dumps(
                            {
                                "step": step,
                                "model": name,
                                "prompt_id": problems[name][row // n].id,
                                "answer": problems[name][row // n].answer,
                                "response": rollout.texts[row],
                                "reward": float(outcomes[name].rewards.view(-1)[row]),
                            }
                        )
                        + "\n"
                    )

    # ----- checkpoints --------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self, step: int) -> Path:
        """Weights (safetensors), optimizer state and step; written to a temp folder then renamed."""
        final = self.checkpoint_root / f"step_{step + 1:06d}"
        staging = final.with_name(final.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for policy in self.policies:
            policy.save(str(staging / policy.name))
            assert policy.optimizer is not None
            torch.save(policy.optimizer.state_dict(), staging / policy.name / "optimizer.pt")
        (staging / "method_state.json").write_text(json.dumps(self.method.state_dict()))
        (staging / "trainer_state.json").write_text(
            json.dumps({"completed_steps": step + 1, "method": self.method.name})
        )
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        existing = sorted(p for p in self.checkpoint_root.glob("step_*") if not p.name.endswith(".tmp"))
        for old in existing[: -self.config.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoint_root.glob("step_*") if not p.name.endswith(".tmp"))
        return done[-1] if done else None

    def resume(self) -> None:
        """Load the latest checkpoint: weights, optimizer, step. Randomness is derived per step."""
        checkpoint = self.latest_checkpoint()
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.checkpoint_root}")
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        from safetensors.torch import load_file

        for policy in self.policies:
            folder = checkpoint / policy.name
            weights = {}
            for shard in sorted(folder.glob("*.safetensors")):
                weights.update(load_file(str(shard), device=str(policy.device)))
            missing, unexpected = policy.model.load_state_dict(weights, strict=False)
            # Tied embeddings are saved once; anything else missing is a broken checkpoint.
            tied = set(getattr(policy.model, "_tied_weights_keys", None) or [])
            if unexpected or (set(missing) - tied):
                raise RuntimeError(f"checkpoint {folder}: missing {missing}, unexpected {unexpected}")
            assert policy.optimizer is not None
            policy.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        method_state = checkpoint / "method_state.json"
        self.method.load_state_dict(json.loads(method_state.read_text()) if method_state.exists() else {})
        self.start_step = int(state["completed_steps"])
        if self.recorder is not None:
            self.recorder.truncate_after(self.start_step - 1)
        assert self.logger is not None
        self.logger.truncate_after(self.start_step - 1)
