"""One policy and everything that touches its weights: the unit a backend places.

A ``PolicyWorker`` owns a policy (model, tokenizer, optimizer), its rollout engine, its frozen
reference (for a KL penalty) and its copy of the method's loss. The trainer (the driver) asks it
to sample and score a step's prompts (``sampling``), then to update on the planned groups given
every model's tokenizer-neutral records (``rows``, then ``update``). Nothing else crosses between
models, so the same worker runs in the trainer's process (``backend: local``) or in its own Ray
actor (``backend: ray``) unchanged, and both give the same results for the same seed: every
random draw is derived from (seed, step, policy index) (``randomness``), never from the order in
which workers run. Its checkpoint part is ``policy_state``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from graftrl.config import Config
from graftrl.methods import Method, build_method
from graftrl.methods.receive import scores_peer_rows
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, RolloutBatch, RolloutEngine, SamplingParams
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.training.parallel import (
    all_gather_objects,
    broadcast_object,
    full_state_dict,
    gathered,
    rank_device,
    shard_model,
)
from graftrl.training.peak_memory import peak_memory_mb, reset_peak_memory
from graftrl.training.policy_state import load_state, save_state, save_weights
from graftrl.training.randomness import EXTRA_PROMPT_STREAM, RESCUE_STREAM, UPDATE_STREAM, step_seed
from graftrl.training.rescue import RescueResult, RescueRoundRequest, sample_rescue
from graftrl.training.rows import TrainingBatch, build_rows
from graftrl.training.sampling import PolicyRollout, sample_step, with_suffix
from graftrl.training.update import NonfiniteGuard, Ranks, optimize
from graftrl.training.worker_calls import (
    CheckpointRequest,
    PeerScores,
    PeerScoringRequest,
    RolloutRequest,
    SavePolicyRequest,
    UpdateRequest,
    UpdateResult,
)


def make_engine(config: Config, policy: Policy) -> RolloutEngine:
    """The configured rollout engine for one policy (``rollout.engine``)."""
    if config.rollout.engine == "hf":
        rollout = config.rollout
        return HFRolloutEngine(
            rollout.max_batch_size, share_prompts=rollout.share_prompts, compile=rollout.compile
        )
    try:
        from graftrl.models.rollout_vllm import VLLMOptions, VLLMRolloutEngine
    except ImportError as error:
        raise RuntimeError(
            f"rollout.engine: vllm needs vLLM ({error}); install it with `bash scripts/setup_vllm.sh` "
            "or set rollout.engine: hf"
        ) from None
    options = VLLMOptions(**config.rollout.vllm.model_dump())
    return VLLMRolloutEngine(policy, options, seed=config.seed, max_batch_size=config.rollout.max_batch_size)


class _RankZeroVerifier:
    """A verifier for every rank of a sharded policy: rank 0 scores, every rank gets the rewards."""

    def __init__(self, rewards: Callable[[list[str], list[MathProblem]], list[float]]) -> None:
        self.rewards = rewards


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
            attn_implementation=spec.attn_implementation,
            disable_dropout=spec.disable_dropout,
            device=rank_device(spec.device, self.rank) if self.world > 1 else spec.device,
            template=spec.template,
            chat_template=spec.chat_template,
        )
        self.name = self.policy.name
        self.policy.check_prompt_lengths(
            [(p.id, with_suffix(p.problem, config.data.prompt_suffix)) for p in problems],
            config.rollout.max_new_tokens,
            suffix=config.data.prompt_suffix,
        )
        self._check_validation_prompts()
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
            from graftrl.verifiers.registry import build_verifier, start_verifier

            verifier = start_verifier(build_verifier(config.reward), config.reward.kind)
        from graftrl.verifiers.registry import as_verifier

        self.verifier = as_verifier(verifier)
        self.tokenizer_id = ""
        if config.store.record:
            from graftrl.storage.store import tokenizer_id

            self.tokenizer_id = tokenizer_id(self.policy.tokenizer)
        self.validator = None  # built on first use (backend: ray scores validation here)
        self._rollout: RolloutBatch | None = None
        self._problems: list[MathProblem] = []  # the rollout's prompts (a rescue round's problems)
        self.guard = NonfiniteGuard(self.name, config.train.max_nonfinite_steps)

    def _check_validation_prompts(self) -> None:
        """The validation benchmarks' prompts must fit the context too (before anything is sampled)."""
        settings = self.config.validation
        if not settings.files:
            return
        from graftrl.evaluation.benchmarks import load_benchmarks

        limit = "validation.max_new_tokens" if settings.max_new_tokens else "rollout.max_new_tokens"
        for benchmark in load_benchmarks(settings.specs(), settings.max_problems):
            self.policy.check_prompt_lengths(
                [(p.id, with_suffix(p.problem, self.config.data.prompt_suffix)) for p in benchmark.problems],
                settings.max_new_tokens or self.config.rollout.max_new_tokens,
                source=f"validation benchmark {benchmark.name} ({benchmark.source})",
                limit=limit,
                suffix=self.config.data.prompt_suffix,
            )

    @property
    def ranks(self) -> Ranks:
        return Ranks(self.world, self.rank)

    # ----- sampling -------------------------------------------------------------------------
    def reset_peak_memory(self) -> None:
        """Called at the start of every step: ``memory_peak_mb`` is then the step's peak (the
        process's, so under the local backend all policies' together)."""
        reset_peak_memory(self.policy.device)

    def rollout(self, request: RolloutRequest) -> PolicyRollout:
        """Sample, score and compute GRPO advantages on the step's prompts (``sampling.sample_step``:
        dynamic sampling, records, store rows); the rollout batch stays here for the update."""
        sampled, self._rollout = sample_step(
            self.config,
            self.index,
            self.name,
            request.step,
            request.problems,
            generate=self._generate,
            score=self._score,
            extra_sampler=self.extra_sampler,
            verifier=self.verifier,
            tokenizer_id=self.tokenizer_id,
        )
        self._problems = sampled.problems
        return sampled

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

    def _score(self, responses: list[str], problems: list[MathProblem]) -> list[float]:
        """The verifier's rewards (``problems[i]``: the row response i answers); under data
        parallelism rank 0 scores and sends them to all."""
        if self.world == 1:
            return self.verifier.rewards(responses, problems)
        return broadcast_object(self.verifier.rewards(responses, problems) if self.rank == 0 else None)

    def rescue(self, request: RescueRoundRequest) -> RescueResult | None:
        """The rescue round of a method that ``rescues`` (``rescue.sample_rescue``): sample this
        policy's hinted prompts and put the groups into the rollout batch the update trains on."""
        step, own = request.step, request.requests[self.index]
        if own is None:
            return None
        if self._rollout is None:
            raise RuntimeError(f"policy {self.name!r}: rescue() before rollout() at step {step}")
        return sample_rescue(
            step,
            self.name,
            own,
            self._rollout,
            self._problems,
            policy=self.policy,
            max_new_tokens=self.config.rollout.max_new_tokens,
            generate=self._generate,
            score=self._score,
            seed=step_seed(self.config.seed, step, RESCUE_STREAM + self.index),
        )

    # ----- the update -----------------------------------------------------------------------
    def update(self, request: UpdateRequest) -> UpdateResult:
        """Train on this policy's planned groups (own rollout of this step + peers' records)."""
        batch, timings, generator = self._rows(request, during="update")
        plan = request.plans[self.index]
        info = dict(batch.metrics)
        info.update(
            optimize(
                self.policy,
                self.method,
                self.config,
                batch.rows,
                plan,
                generator,
                self.guard,
                timings,
                reference=self.reference,
                ranks=self.ranks,
            )
        )
        self._rollout = None
        start = time.perf_counter()
        self._sync_engine()
        timings["time_weight_sync"] = time.perf_counter() - start
        info.update(timings)
        info["memory_peak_mb"] = peak_memory_mb(self.policy.device)
        if self.world > 1:  # the largest rank's peak: what each device must hold
            info["memory_peak_mb"] = max(all_gather_objects(info["memory_peak_mb"]))
        return UpdateResult(info, batch.compatibility)

    def score_peers(self, request: PeerScoringRequest) -> PeerScores:
        """The update's row building without the optimizer (``graftrl probe``): the plan's peer
        groups re-tokenized, scored in the no-grad pass, weighed and, with ``contrast``, measured,
        with the random draws of ``update`` at this step, by the request's ``scoring`` rule or
        the worker's own method."""
        batch, timings, _ = self._rows(
            request, during="score_peers", scoring=request.scoring, contrast=request.contrast
        )
        method = request.scoring or self.method
        tokens = [len(row.prompt_ids) + len(row.response_ids) for row in batch.rows]
        scored = [scores_peer_rows(method) and row.peer and not row.nll for row in batch.rows]
        return PeerScores(
            {**batch.metrics, **timings},
            batch.compatibility,
            batch.group_contrasts,
            row_tokens=sum(tokens),
            scored_tokens=sum(t for t, peer in zip(tokens, scored, strict=True) if peer),
        )

    def _rows(
        self,
        request: UpdateRequest,
        *,
        during: str,
        scoring: Method | None = None,
        contrast: bool = True,
    ) -> tuple[TrainingBatch, dict[str, float], torch.Generator]:
        """The receiver's rows of this step's plan (``rows.build_rows``) with the step's update
        generator, as ``update`` and ``score_peers`` (``during``) build them: the request's
        ``method_state`` is loaded first; ``scoring`` scores with another method's rule than the
        worker's own; ``contrast`` measures each peer group's contrast."""
        step, plan = request.step, request.plans[self.index]
        if self._rollout is None:
            raise RuntimeError(f"policy {self.name!r}: {during}() before rollout() at step {step}")
        if request.method_state is not None:
            self.method.load_state_dict(request.method_state)
        method = scoring or self.method
        timings: dict[str, float] = {}
        generator = torch.Generator().manual_seed(
            step_seed(self.config.seed, step, UPDATE_STREAM + self.index)
        )
        # Every rank builds all rows (peer scoring on the gathered weights), so each knows every
        # minibatch's denominators and every rank's share without communicating.
        scores = self.config.rollout.tis_cap is not None or (
            scores_peer_rows(method) and any(g.peer and not g.nll for g in plan.groups)
        )
        with gathered(self.policy.model) if scores else contextlib.nullcontext():
            batch = build_rows(
                step,
                self._rollout,
                plan,
                request.records,
                policy=self.policy,
                method=method,
                config=self.config,
                generator=generator,
                timings=timings,
                contrast=contrast
                and self.rank == 0,  # every rank holds the same rows; rank 0's metrics are the policy's
            )
        return batch, timings, generator

    # ----- checkpoints and validation ---------------------------------------------------------
    def save(self, request: CheckpointRequest) -> None:
        """Weights and tokenizer, optimizer state and update state into this policy's folder
        (``policy_state.save_state``: sharded under data parallelism)."""
        save_state(self.policy, request.folders[self.index], self.guard, self.ranks)

    def save_policy(self, request: SavePolicyRequest) -> None:
        """Weights and tokenizer only (best-checkpoint copies, exports): a plain save_pretrained
        folder, gathered on rank 0 when the model is sharded."""
        save_weights(self.policy, request.folder, self.ranks)

    def load(self, request: CheckpointRequest) -> None:
        """Weights and optimizer state from this policy's ``save`` folder, written with any number
        of ranks (a sharded checkpoint is resharded to this run's N); the engine takes the weights."""
        load_state(self.policy, request.folders[self.index], self.guard, self.ranks)
        self._sync_engine()

    def _sync_engine(self) -> None:
        """The engine takes the current weights; a sharded policy's vLLM engines take the full
        weights, gathered on every rank (a collective: every rank calls it)."""
        if self.world == 1 or isinstance(self.engine, HFRolloutEngine):
            self.engine.sync_weights(self.policy)
            return
        weights = full_state_dict(self.policy.model, every_rank=True)
        self.engine.sync_weights(self.policy, list(weights.items()))  # type: ignore[call-arg]

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
