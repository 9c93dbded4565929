"""Algorithm 1: co-train K policies on a shared prompt stream with GRPO or GRAFT.

Each step: every policy samples n responses per prompt, the verifier scores them, each policy
computes its own GRPO advantages; the method plans which groups each receiver trains on; each
receiver scores the grafted responses on its own tokenization, weighs them, and updates with
peer groups ordered last. The loop knows nothing of two models in particular.
"""

from __future__ import annotations

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


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A seed derived from (run seed, step, stream): randomness needs no state to resume."""
    return (seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1)


def with_suffix(problem: str, suffix: str | None) -> str:
    return f"{problem} {suffix}" if suffix else problem


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

    # ----- construction -------------------------------------------------------------------
    def _load_policy(self, index: int) -> Policy:
        spec = self.config.policies[index]
        return Policy.from_pretrained(
            spec.name,
            spec.path,
            dtype=spec.dtype,
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
        n = self.sampling.n
        problems = self.sampler.batch(step)
        prompts = [with_suffix(p.problem, self.config.data.prompt_suffix) for p in problems]
        answers = [p.answer for p in problems for _ in range(n)]
        timings: dict[str, dict[str, float]] = defaultdict(dict)
        rollouts: dict[str, RolloutBatch] = {}
        outcomes: dict[str, GroupOutcomes] = {}
        records: dict[str, list[TrajectoryRecord]] = {}
        for index, policy in enumerate(self.policies):
            start = time.perf_counter()
            torch.manual_seed(step_seed(self.config.seed, step, 1 + index))
            rollouts[policy.name] = self.engine.generate(policy, prompts, self.sampling)
            timings[policy.name]["time_rollout"] = time.perf_counter() - start

            start = time.perf_counter()
            rewards = torch.tensor(
                self.verifier.score(rollouts[policy.name].texts, answers), dtype=torch.float32
            )
            rewards = rewards.view(len(problems), n)
            advantages = grpo_advantages(
                rewards, self.config.train.adv_eps, self.config.train.adv_std_unbiased
            )
            outcomes[policy.name] = GroupOutcomes(rewards, advantages)
            records[policy.name] = self._records(
                step, policy.name, problems, rollouts[policy.name], rewards, advantages
            )
            timings[policy.name]["time_reward"] = time.perf_counter() - start

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
            row.update(self._outcome_metrics(policy.name, outcomes, rollouts[policy.name]))
            row.update(plans[policy.name].diagnostics)
            row.update(timings[policy.name])
            row["time_step"] = sum(timings[policy.name].values())
            metrics[policy.name] = row
        for name, row in metrics.items():
            assert self.logger is not None
            self.logger.log({"step": step, "model": name, "method": self.method.name, **row})
        self._log_samples(step, problems, rollouts, outcomes)
        return metrics

    # ----- pieces of a step ---------------------------------------------------------------
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
                else:
                    response, old = rollout.response_ids[flat], rollout.behaviour_logprobs[flat]
                rows.append(
                    group_index,
                    rollout.prompt_ids[group.prompt],
                    response,
                    old,
                    float(group.advantages[i]),
                    group.peer,
                    group.nll,
                    group.source,
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
        s = compatibility_score(receiver_mean, torch.tensor([rec.mean_logprob for rec in peer_records]))
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
        order = minibatch_order(is_peer_group, train.minibatch_prompts, self.method.peer_position, generator)
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
                # zero, so skipping their forward pass changes nothing but the cost.
                active = sorted(
                    [r for r in kept if rows.advantages[r] != 0] + nll_rows,
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
        self, name: str, outcomes: dict[str, GroupOutcomes], rollout: RolloutBatch
    ) -> dict[str, Any]:
        own = outcomes[name]
        all_fail, all_pass = group_outcome_fractions(own.rewards)
        row: dict[str, Any] = {
            "reward_mean": float(own.rewards.mean()),
            "all_fail_frac": float(all_fail),
            "all_pass_frac": float(all_pass),
            "response_length": statistics.fmean(
                rollout.content_length(r) for r in range(len(rollout.response_ids))
            ),
        }
        for peer, other in outcomes.items():
            if peer != name:
                row[f"complementarity/{peer}"] = float(complementarity(own.successes, other.successes))
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
                                "prompt_id": problems[row // n].id,
                                "answer": problems[row // n].answer,
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
        assert self.logger is not None
        self.logger.truncate_after(self.start_step - 1)
