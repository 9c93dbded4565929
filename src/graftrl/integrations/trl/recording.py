"""Record a TRL GRPO run into graftrl's trajectory store, so it can serve as a stored peer.

``RecordTrajectoriesMixin`` goes before ``GRPOTrainer`` in a trainer's bases
(``RecordingGRPOTrainer`` is that class); it needs no TRL import itself. Each training generation
batch becomes one store step (step t = the t-th generation batch, as graftrl's step t is its t-th
rollout batch), written before the batch is trained on, with exactly the rows ``graftrl train``
writes (``graftrl.training.trajectories``: the same ``TrajectoryRecord`` fields, Parquet files and
manifest): prompt id, step, source, index in the group, response text (decoded without special
tokens), reward, the source's advantage (TRL's), the source's mean token log-prob and token count
over the response's own tokens (a terminal EOS excluded), byte count and finished flag, plus the
per-token log-probs.

**Which log-probs.** The sampler's when TRL has them (vLLM's ``sampling_per_token_logps``, where
finite); else one no-grad pass of the generating weights before any update on the batch, with
graftrl's ``Policy.score``: logits / temperature over the full vocabulary (top-k / top-p are not
applied) at position ids that skip the left padding, as ``generate`` samples. (TRL's own forward
passes no position ids, so for an absolute-position model such as GPT-2 its log-probs of a
left-padded row are not the sampler's; a RoPE model such as Llama gives the same either way.)

**Resuming** (``train(resume_from_checkpoint=...)``) reads the checkpoint's weights through
transformers' own loading (``checkpoint_weights``), not by the file's raw keys as transformers'
Trainer does: that leaves the weights transformers renames or regroups on load (GPT-NeoX's head,
a mixture's experts) at their current values with only a warning.

**Rewards** are the weighted sum of TRL's reward functions, any finite number (a verifier's 0/1
correctness, a code reward's fraction of tests passed): the store keeps them as they are, and
advantages come from them unchanged (algorithm.md §1.1). A non-finite reward stops the run at its
batch with one line (``check_finite``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graftrl.integrations.trl._compat import TRLIntegrationError
from graftrl.models.model_loading import checkpoint_weights
from graftrl.models.policy import Policy
from graftrl.models.rollout import RolloutBatch
from graftrl.storage.data import MathProblem
from graftrl.storage.peers import PROMPT_ID_COLUMN, prompt_id_of, prompt_text
from graftrl.storage.store import TrajectoryWriter, tokenizer_id
from graftrl.training.trajectories import rollout_records, stored_rows


@dataclass
class CapturedRollout:
    """What TRL's ``_calculate_rewards`` saw for a generation batch (B = P x n rows)."""

    inputs: list[dict[str, Any]]
    prompts: list[Any]
    completion_ids: list[list[int]]
    """[B] completion ids, unpadded; ends with an EOS id when the completion finished."""
    rewards_per_func: Tensor
    """[B, F] each reward function's value."""


def combined_rewards(rewards_per_func: Tensor, reward_weights: Tensor) -> Tensor:
    """[B] TRL's weighted sum of the reward functions (an all-None row counts 0)."""
    return (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)


def check_finite(rewards: Tensor, what: str) -> None:
    """Refuse rewards that are not finite numbers (NaN, +-inf), in one line naming the fix. Any
    finite reward is kept (a fraction of tests passed, say); successes are counted elsewhere, at a
    threshold (``core.is_success``)."""
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        value = float(rewards[bad][0])
        raise TRLIntegrationError(
            f"{what}: reward {value} is not a finite number; the trajectory store and GRAFT's advantages "
            "need finite rewards: make each reward function return a finite float (or None where it does "
            "not apply) and keep reward_weights finite"
        )


def store_rows(
    *,
    step: int,
    source: str,
    tokenizer_name: str,
    prompt_ids: list[str],
    prompt_texts: list[str],
    prompt_token_ids: list[list[int]],
    completion_ids: list[list[int]],
    finished: list[bool],
    token_logprobs: list[Tensor],
    texts: list[str],
    rewards: Tensor,
    advantages: Tensor,
    n: int,
) -> list[Any]:
    """The store rows of one generation batch (P prompts x n completions, prompt-major), built by
    graftrl's own converter from a ``RolloutBatch``; rewards, advantages: [P, n]."""
    rollout = RolloutBatch(
        prompt_ids=prompt_token_ids,
        response_ids=completion_ids,
        behaviour_logprobs=token_logprobs,
        finished=finished,
        texts=texts,
        n=n,
    )
    problems = [
        MathProblem(id=pid, problem=text, answer="")
        for pid, text in zip(prompt_ids, prompt_texts, strict=True)
    ]
    records = rollout_records(step, source, problems, rollout, rewards, advantages)
    return stored_rows(records, rollout, prompt_texts, tokenizer_name)


class CaptureRolloutMixin:
    """Keeps what ``_calculate_rewards`` was given for the current generation batch."""

    _graft_rollout: CapturedRollout | None = None
    _graft_capture_paused: bool = False

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # type: ignore[misc]
        if not self._graft_capture_paused:
            self._graft_rollout = CapturedRollout(
                list(inputs), list(prompts), [list(ids) for ids in completion_ids_list], rewards_per_func
            )
        return rewards_per_func

    def _graft_generation_index(self) -> int:
        """The current generation batch's index: micro-steps done // micro-steps per generation."""
        args: Any = self.args  # type: ignore[attr-defined]
        accumulation = args.gradient_accumulation_steps
        done = self.state.global_step * accumulation + self._step % accumulation  # type: ignore[attr-defined]
        return done // (args.steps_per_generation * self.num_iterations)  # type: ignore[attr-defined]

    def _graft_score(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completions: list[list[int]]
    ) -> list[Tensor]:
        """Per-token log-probs (no grad, current weights, TRL's log-prob function) of each
        completion after its prompt row; prompt_ids, prompt_mask: [R, Lp] left-padded."""
        device = prompt_ids.device
        width = max(1, max((len(c) for c in completions), default=0))
        pad_id = self._tokenizer.pad_token_id  # type: ignore[attr-defined]
        ids = torch.full((len(completions), width), pad_id, dtype=prompt_ids.dtype, device=device)
        mask = torch.zeros((len(completions), width), dtype=prompt_mask.dtype, device=device)
        for r, completion in enumerate(completions):
            ids[r, : len(completion)] = torch.tensor(completion, dtype=ids.dtype)
            mask[r, : len(completion)] = 1
        with torch.no_grad(), _no_checkpointing(self):
            logps, _, _ = self._get_per_token_logps_and_entropies(  # type: ignore[attr-defined]
                self.model,  # type: ignore[attr-defined]
                torch.cat([prompt_ids, ids], dim=1),
                torch.cat([prompt_mask, mask], dim=1),
                width,
                batch_size=self.args.per_device_train_batch_size,  # type: ignore[attr-defined]
            )
        return [logps[r, : len(c)].detach().float().cpu() for r, c in enumerate(completions)]

    def _graft_check_single_process(self, what: str) -> None:
        if self.accelerator.num_processes > 1:  # type: ignore[attr-defined]
            raise TRLIntegrationError(
                f"{what} runs on one process (got {self.accelerator.num_processes}); launch it without "  # type: ignore[attr-defined]
                "accelerate/torchrun data parallelism"
            )


def _no_checkpointing(trainer: Any) -> Any:
    """TRL's context that turns gradient checkpointing off for a no-grad forward (a no-op if absent)."""
    import contextlib

    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:
        return contextlib.nullcontext()
    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)


class RecordTrajectoriesMixin(CaptureRolloutMixin):
    """Writes every training generation batch of a GRPOTrainer into a trajectory store.

    Keyword arguments (taken before the trainer's own): ``record_store`` (store folder; None
    records nothing), ``record_source`` (the ``source`` name in the store; default the model
    folder's name), ``prompt_id_column`` (default ``args.graft_prompt_id_column`` or ``prompt_id``).
    """

    def __init__(
        self,
        *args: Any,
        record_store: str | Path | None = None,
        record_source: str | None = None,
        prompt_id_column: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.prompt_id_column = prompt_id_column or getattr(
            self.args, "graft_prompt_id_column", PROMPT_ID_COLUMN
        )  # type: ignore[attr-defined]
        self.record_writer = None if record_store is None else TrajectoryWriter(record_store)
        if self.record_writer is None:
            return
        self._graft_check_single_process("recording a trajectory store")
        if self._tokenizer.eos_token_id is None:  # type: ignore[attr-defined]
            raise TRLIntegrationError(
                "record_store: the tokenizer has no eos_token, so finished and cut-off responses cannot be told "
                "apart; set tokenizer.eos_token"
            )
        name = getattr(getattr(self.model, "config", None), "name_or_path", "") or "trl"  # type: ignore[attr-defined]
        self.record_source = record_source or Path(str(name)).name or "trl"
        self._record_tokenizer_id = tokenizer_id(self._tokenizer)  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """A one-process ``save_pretrained`` checkpoint of a plain transformers model loads through
        transformers' loading (module docstring); sharded, DeepSpeed and adapter checkpoints, which
        Trainer reads its own ways, go to Trainer."""
        from transformers import PreTrainedModel

        model = self.model if model is None else model  # type: ignore[attr-defined]
        folder = Path(resume_from_checkpoint)
        plain = any(
            (folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
        )
        wrapped = getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False)
        if (
            not plain
            or wrapped
            or type(model).__name__.startswith("Peft")
            or not isinstance(model, PreTrainedModel)
        ):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        model.load_state_dict(checkpoint_weights(model, folder))

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        batch = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        if self.record_writer is not None and self.model.training:  # type: ignore[attr-defined]
            self._record(batch)
        return batch

    def _record(self, batch: dict[str, Any]) -> None:
        captured = self._graft_rollout
        assert captured is not None, "TRL scored no rewards for this batch"
        n = self.num_generations  # type: ignore[attr-defined]
        rows = len(captured.completion_ids)
        rewards = combined_rewards(captured.rewards_per_func, self.reward_weights).cpu()  # type: ignore[attr-defined]
        check_finite(rewards, "record_store")
        eos = set(self.eos_token_ids)  # type: ignore[attr-defined]
        finished = [bool(ids) and ids[-1] in eos for ids in captured.completion_ids]
        logprobs = self._recorded_logprobs(batch, captured)
        tokenizer = self._tokenizer  # type: ignore[attr-defined]
        groups = range(0, rows, n)
        prompt_mask = batch["prompt_mask"]
        rows_out = store_rows(
            step=self._graft_generation_index(),
            source=self.record_source,
            tokenizer_name=self._record_tokenizer_id,
            prompt_ids=[prompt_id_of(captured.inputs[g], self.prompt_id_column) for g in groups],
            prompt_texts=[prompt_text(captured.prompts[g]) for g in groups],
            prompt_token_ids=[batch["prompt_ids"][g][prompt_mask[g].bool()].tolist() for g in groups],
            completion_ids=captured.completion_ids,
            finished=finished,
            token_logprobs=logprobs,
            texts=tokenizer.batch_decode(captured.completion_ids, skip_special_tokens=True),
            rewards=rewards.view(-1, n),
            advantages=batch["advantages"].detach().float().cpu().view(-1, n),
            n=n,
        )
        assert self.record_writer is not None
        self.record_writer.write_step(self._graft_generation_index(), rows_out)

    def _recorded_logprobs(self, batch: dict[str, Any], captured: CapturedRollout) -> list[Tensor]:
        """[B] per-token log-probs of each completion: the sampler's, else a no-grad pass (module docstring)."""
        lengths = [len(ids) for ids in captured.completion_ids]
        sampled = batch.get("sampling_per_token_logps")
        if sampled is not None:
            rows = [sampled[r, :length].detach().float().cpu() for r, length in enumerate(lengths)]
            if all(bool(torch.isfinite(row).all()) for row in rows):
                return rows
        prompts = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)
        ]
        scorer = Policy(
            self.record_source,
            self.model,  # type: ignore[attr-defined]
            self._tokenizer,  # type: ignore[attr-defined]
            temperature=self.args.temperature,  # type: ignore[attr-defined]
            micro_batch_size=self.args.per_device_train_batch_size,  # type: ignore[attr-defined]
        )
        with _no_checkpointing(self):
            return scorer.score(prompts, captured.completion_ids)
