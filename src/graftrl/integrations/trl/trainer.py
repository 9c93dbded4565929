"""``GraftGRPOTrainer``: TRL's GRPOTrainer with GRAFT from stored peers; ``RecordingGRPOTrainer``.

Importing this module imports TRL (``require_trl``: a one-line error without it or outside the
tested range). See docs/trl.md for the recipe, the matching rule and every config field.

One generation batch of ``GraftGRPOTrainer`` (``_prepare_inputs``, in training):

1. TRL samples, scores and computes its advantages (``_generate_and_score_completions``); with
   ``record_store`` the receiver's own samples are recorded first (``RecordTrajectoriesMixin``);
2. each peer source (``sources``: ``graftrl train``'s interface, one per ``peers`` entry) gives its
   groups on the batch's prompts: a stored peer's looked up (``PeerStore``, the matching rule of
   ``graft_peer_match``) and, where the receiver failed all n (no reward at or above
   ``graft_success_threshold``), re-verified with this trainer's reward functions
   (``graft_reverify``); a served peer's asked and verified; a registered kind's as it gives them;
3. ``graft_exchange`` replaces the selected groups (graftrl's GRAFT: plan, re-tokenization,
   no-grad scoring, s and w, w folded into the advantages, w = 0 rows out of the loss);
4. the rows are shuffled as TRL does, then ordered peer rows last (``peer_last_order``, by
   optimizer steps of ``per_device_train_batch_size x gradient_accumulation_steps`` rows), and
   split into TRL's ``steps_per_generation`` micro-batches.

Rewards are any finite numbers (a code reward's fraction of tests passed): advantages come from
them as they are, and every count of GRAFT (all-fail, eq. 4's k, ``success_only``) counts successes,
rewards at or above ``graft_success_threshold`` (``core.is_success``; algorithm.md §1.1).

The loss is TRL's (``dapo`` or ``bnpo``, token level); graftrl's exchange metrics go to TRL's logs
under ``graft/``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from graftrl.config.peers import PeerSettings
from graftrl.config.rewards import RewardConfig
from graftrl.core import clipped_token_mask
from graftrl.integrations.trl._compat import TRLIntegrationError, require_trl
from graftrl.integrations.trl.exchange import IS_PEER, Exchange, graft_exchange, peer_last_order
from graftrl.integrations.trl.recording import RecordTrajectoriesMixin, check_finite, combined_rewards
from graftrl.integrations.trl.served import ServedPeer, ServedPeerSource
from graftrl.integrations.trl.sources import (
    StoredPeerSource,
    build_sources,
    graft_seed,
    peer_groups_of,
    problem_of,
    trl_run,
)
from graftrl.methods import GroupOutcomes
from graftrl.methods.graft import GRAFT, GraftConfig
from graftrl.models.policy import Policy
from graftrl.storage.peers import DEFAULT_PEER_MATCH, PEER_MATCHES, PROMPT_ID_COLUMN, StoredPeer, prompt_id_of
from graftrl.storage.problems import Problem
from graftrl.storage.store import StoredTrajectory, TrajectoryStore

require_trl()

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

try:
    from trl.extras.profiling import profiling_decorator
except ImportError:  # pragma: no cover - profiling moved

    def profiling_decorator(function):  # type: ignore[no-redef]
        return function


__all__ = ["GraftGRPOConfig", "GraftGRPOTrainer", "RecordingGRPOTrainer"]

_GRAFT = GraftConfig.model_fields
_REWARD = RewardConfig.model_fields
SUPPORTED_LOSSES = ("dapo", "bnpo")
"""TRL losses whose denominator is a token count: a row with an empty mask is out of both terms."""


@dataclass
class GraftGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus GRAFT's switches (defaults: the paper's GRAFT, graftrl's ``graft:`` section;
    ``graft_success_threshold``: ``reward.success_threshold``)."""

    graft_delta: float = field(
        default=_GRAFT["delta"].default, metadata={"help": _GRAFT["delta"].description}
    )
    graft_gate: bool = field(default=_GRAFT["gate"].default, metadata={"help": _GRAFT["gate"].description})
    graft_transfer: str = field(
        default=_GRAFT["transfer"].default, metadata={"help": _GRAFT["transfer"].description}
    )
    graft_peer_position: str = field(
        default=_GRAFT["peer_position"].default,
        metadata={
            "help": "Where optimizer steps holding peer rows go in each generation batch: last, first or uniform."
        },
    )
    graft_peer_match: str = field(
        default=DEFAULT_PEER_MATCH,
        metadata={
            "help": "Which stored group serves a prompt at generation batch t (graftrl.storage.peers): 'step' "
            "(the group stored at t; the default), 'nearest' (stored at the step nearest t) or 'prompt_id' "
            "(the latest stored)."
        },
    )
    graft_prompt_id_column: str = field(
        default=PROMPT_ID_COLUMN,
        metadata={"help": "Dataset column of the prompt id (rows without it: sha256 of the prompt)."},
    )
    graft_reverify: bool = field(
        default=True,
        metadata={
            "help": "Re-verify stored peer rewards with this trainer's reward functions (groups whose rewards "
            "change get recomputed advantages)."
        },
    )
    graft_success_threshold: float = field(
        default=_REWARD["success_threshold"].default,
        metadata={"help": _REWARD["success_threshold"].description},
    )


def graft_method(args: Any) -> GRAFT:
    """graftrl's GRAFT for a trainer config (one-way transfer: balancing off, algorithm.md §2.3)."""
    values = {
        "delta": getattr(args, "graft_delta", _GRAFT["delta"].default),
        "gate": getattr(args, "graft_gate", _GRAFT["gate"].default),
        "transfer": getattr(args, "graft_transfer", _GRAFT["transfer"].default),
        "peer_position": getattr(args, "graft_peer_position", _GRAFT["peer_position"].default),
    }
    try:
        options = GraftConfig(balance=False, **values)
    except ValidationError as error:
        problem = error.errors()[0]
        name = f"graft_{problem['loc'][0]}" if problem["loc"] else "graft_*"
        raise TRLIntegrationError(
            f"{name}: {problem['msg']} (got {problem.get('input')!r}); see docs/trl.md"
        ) from None
    match = getattr(args, "graft_peer_match", DEFAULT_PEER_MATCH)
    if match not in PEER_MATCHES:
        raise TRLIntegrationError(f"graft_peer_match: must be one of {PEER_MATCHES}, got {match!r}")
    return GRAFT(options)  # train's defaults: eq. 1's eps and std, TRL's loss uses none of the rest


def graft_success_threshold(args: Any) -> float:
    """A trainer config's ``graft_success_threshold`` (``reward.success_threshold``; default 1.0): a
    reward at or above it is a success for every count of GRAFT (``core.is_success``)."""
    value = getattr(args, "graft_success_threshold", _REWARD["success_threshold"].default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TRLIntegrationError(
            f"graft_success_threshold: must be a finite number (got {value!r}); see docs/trl.md"
        )
    return float(value)


BUILT_IN = {"stored": StoredPeerSource, "served": ServedPeerSource}
"""TRL's own sources of the built-in peer kinds (``sources``); other kinds come from ``training.peer_sources``."""


@dataclass
class BatchVerifier:
    """The ``verifier`` a source gets for one generation batch: this trainer's reward functions."""

    trainer: GraftGRPOTrainer
    captured: Any
    problems: list[Problem]

    def groups(self, groups: list[Any], prompts: list[int]) -> dict[int, list[float]]:
        """prompt -> the rewards of its group's n rows, for the ``prompts`` that have a group."""
        return self.trainer._reverify(groups, prompts, self.captured)

    def rewards(self, texts: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """Each text's reward as a finished response to its problem, one of the batch's
        (``verifier.rewards`` of ``graftrl train``)."""
        n, index = self.trainer.num_generations, {id(problem): p for p, problem in enumerate(self.problems)}
        seen: dict[int, int] = {}
        items = []
        for text, problem in zip(texts, problems, strict=True):
            p = index[id(problem)]
            seen[p] = seen.get(p, -1) + 1
            items.append((p * n + seen[p] % n, text, True))
        return self.trainer._rewards(items, self.captured)


class RecordingGRPOTrainer(RecordTrajectoriesMixin, GRPOTrainer):
    """TRL's GRPOTrainer that records its run into a trajectory store (``record_store=...``)."""


class GraftGRPOTrainer(RecordTrajectoriesMixin, GRPOTrainer):
    """GRPOTrainer training on GRAFT's exchange with stored peers (module docstring, docs/trl.md).

    ``peers``: the peers, in one list: each a stored peer to replay (a store folder or a
    ``StoredPeer(path, source)``), a served peer (``ServedPeer(endpoint=..., model=..., name=...)``)
    or the settings of a kind registered in ``training.peer_sources`` (``sources``). Also takes
    ``record_store`` / ``record_source`` (record this run's own samples). ``graft_last_exchange``
    holds the last generation batch's ``Exchange`` (plan, s, w) for inspection.

    ``peer_stores=`` (the stored peers alone) is a deprecated alias of ``peers=``, kept for one release.
    """

    receiver_name = "receiver"

    def __init__(
        self,
        *args: Any,
        peers: Sequence[StoredPeer | ServedPeer | PeerSettings | str | Path] = (),
        peer_stores: Sequence[StoredPeer | str | Path] = (),
        **kwargs: Any,
    ) -> None:
        if peer_stores:
            warnings.warn(
                "GraftGRPOTrainer(peer_stores=...) is deprecated and will be removed in the next release; "
                "pass the stored peers in peers=[...] (beside any ServedPeer)",
                DeprecationWarning,
                stacklevel=2,
            )
        super().__init__(*args, **kwargs)
        self.graft = graft_method(self.args)
        self.graft_threshold = graft_success_threshold(self.args)
        self.graft_match = getattr(self.args, "graft_peer_match", DEFAULT_PEER_MATCH)
        self.graft_reverify = bool(getattr(self.args, "graft_reverify", True))
        self._check_supported()
        if not peer_stores and not peers:
            raise TRLIntegrationError(
                "peers: give at least one stored peer (a store folder or StoredPeer) or a "
                "served peer (ServedPeer(endpoint=..., model=..., name=...))"
            )
        self.graft_sources = build_sources(
            [*peer_stores, *peers], trl_run(self), BUILT_IN, self.receiver_name
        )
        # graftrl's re-tokenization rule (Policy.encode_response) on the receiver's tokenizer.
        self._encoder = Policy(self.receiver_name, self.model, self._tokenizer)
        self.graft_last_exchange: Exchange | None = None
        self._graft_capture_logps = False
        self._graft_captured_logps: torch.Tensor | None = None

    # ----- refusals, before training -------------------------------------------------------
    def _check_supported(self) -> None:
        args = self.args

        def refuse(message: str) -> None:
            raise TRLIntegrationError(f"GraftGRPOTrainer: {message}")

        self._graft_check_single_process("GraftGRPOTrainer")
        if self._tokenizer.eos_token_id is None:
            refuse(
                "the tokenizer has no eos_token: a finished peer response gets the receiver's EOS; set tokenizer.eos_token"
            )
        if self.processing_class is not self._tokenizer:
            refuse("multimodal processors are not supported; pass a text tokenizer as processing_class")
        if args.loss_type not in SUPPORTED_LOSSES:
            refuse(
                f"loss_type {args.loss_type!r} is not supported: GRAFT removes w = 0 responses from a token-mean "
                f"denominator; set loss_type to one of {SUPPORTED_LOSSES}"
            )
        if args.importance_sampling_level != "token":
            refuse("importance_sampling_level must be 'token' (GRAFT's eq. 9 ratio)")
        if args.beta != 0.0:
            refuse("beta (KL to a reference) must be 0: graftrl's KL term covers own rows only; set beta=0.0")
        if args.use_vllm:
            refuse(
                "use_vllm is not supported yet (no sampler log-probs exist for peer rows); set use_vllm=False"
            )
        if args.mask_truncated_completions:
            refuse("mask_truncated_completions is not supported (it masks own rows only); set it to False")
        if getattr(self, "tools", None) or getattr(self, "environment_factories", None) or self.rollout_func:
            refuse("tools, environments and rollout_func are not supported; remove them")

    # ----- one generation batch --------------------------------------------------------------
    @profiling_decorator
    def _prepare_inputs(self, generation_batch):  # type: ignore[no-untyped-def]
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        args = self.args
        generate_every = args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = self._graft_exchange(batch)
            rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
            order = peer_last_order(
                batch[IS_PEER], rows_per_step, self.graft.peer_position, self._graft_generator(2)
            )
            batch = {k: v[order] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in batch.items()}
            self._buffered_inputs = split_tensor_dict(batch, args.steps_per_generation)
        return self._buffered_inputs[self._step % args.steps_per_generation]

    def _graft_generator(self, stream: int) -> torch.Generator:
        """A generator for (seed, generation batch, stream): 0 = the plan, 1 = the weights (random
        admission), 2 = the minibatch order (uniform peer position), 3 = served peers' request seeds."""
        return torch.Generator().manual_seed(
            graft_seed(self.args.seed, self._graft_generation_index(), stream)
        )

    def _graft_exchange(self, batch: dict[str, Any]) -> dict[str, Any]:
        captured = self._graft_rollout
        assert captured is not None, "TRL scored no rewards for this batch"
        n = self.num_generations
        rewards = combined_rewards(captured.rewards_per_func, self.reward_weights).cpu()
        check_finite(rewards, "GraftGRPOTrainer")
        rewards = rewards.view(-1, n)
        threshold = self.graft_threshold
        step = self._graft_generation_index()
        rows = captured.inputs[::n]  # one dataset row per prompt
        problems = [problem_of(row, prompt_id_of(row, self.prompt_id_column)) for row in rows]
        advantages = batch["advantages"].detach().float().cpu().view(-1, n)
        receivers = {self.receiver_name: GroupOutcomes(rewards.float(), advantages, threshold)}
        verifier = BatchVerifier(self, captured, problems)
        peers, info = {}, {}
        for source in self.graft_sources:  # stored, served, then any registered kind (sources.py)
            got = source.groups(step, problems, receivers, verifier)
            peers[source.name] = peer_groups_of(got, n)
            info.update(got.info)
            self._record_rows(step, got.rows)
        exchange = graft_exchange(
            batch,
            rewards,
            peers,
            self.graft,
            receiver=self.receiver_name,
            encode=self._encoder.encode_response,
            score=self._graft_score,
            pad_token_id=self._tokenizer.pad_token_id,
            plan_generator=self._graft_generator(0),
            weight_generator=self._graft_generator(1),
            success_threshold=threshold,
        )
        self.graft_last_exchange = exchange
        metrics = self._metrics["train"]
        for key, value in {**exchange.metrics, **info}.items():
            # only a source that re-verifies recorded rewards reports their changes (not a served one)
            if not key.startswith("stored_reward_changes/") or key in info:
                metrics[f"graft/{key}"].append(value)
        return exchange.batch

    def _record_rows(self, step: int, rows: list[StoredTrajectory]) -> None:
        """Add a source's rows (a served peer's verified groups) to this batch's step file of ``record_store``."""
        if self.record_writer is None or not rows:
            return
        store = TrajectoryStore(self.record_writer.root)
        own = store.read_step(step) if step in store.steps() else []
        self.record_writer.write_step(step, own + rows)

    def _reverify(self, groups: list[Any], prompts: list[int], captured: Any) -> dict[int, list[float]]:
        """This trainer's rewards of the stored responses on the prompts where GRAFT may transfer."""
        n = self.num_generations
        chosen = [p for p in prompts if groups[p] is not None]
        items = [(p * n + i, row.response, row.finished) for p in chosen for i, row in enumerate(groups[p])]
        rewards = self._rewards(items, captured)
        return {p: rewards[k * n : (k + 1) * n] for k, p in enumerate(chosen)}

    def _rewards(self, items: list[tuple[int, str, bool]], captured: Any) -> list[float]:
        """This trainer's rewards of responses (batch row whose prompt it answers, text, finished)."""
        if not items:
            return []
        inputs, prompt_rows, completions, completion_ids = [], [], [], []
        for row, response, finished in items:
            inputs.append(captured.inputs[row])
            prompt_rows.append(captured.prompts[row])
            conversational = not isinstance(captured.prompts[row], str)
            completions.append([{"role": "assistant", "content": response}] if conversational else response)
            completion_ids.append(self._encoder.encode_response(response, finished))
        self._graft_capture_paused = True
        try:
            per_func = self._calculate_rewards(inputs, prompt_rows, completions, completion_ids)
        finally:
            self._graft_capture_paused = False
        rewards = combined_rewards(per_func, self.reward_weights).cpu()
        check_finite(rewards, "GraftGRPOTrainer (re-verified peer rewards)")
        return rewards.tolist()

    # ----- loss: TRL's, plus graftrl's own/peer clip metrics ------------------------------------
    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._graft_capture_logps:
            self._graft_captured_logps = out[0].detach()
        return out

    def _compute_loss(self, model, inputs):  # type: ignore[no-untyped-def]
        self._graft_capture_logps = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._graft_capture_logps = False
        logps, self._graft_captured_logps = self._graft_captured_logps, None
        if logps is not None and IS_PEER in inputs and self.model.training:
            old = inputs.get("old_per_token_logps")
            ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old)
            mask = inputs["completion_mask"].bool()
            clipped = (
                clipped_token_mask(ratio, inputs["advantages"], self.epsilon_low, self.epsilon_high) & mask
            )
            peer = inputs[IS_PEER].unsqueeze(-1)
            for name, rows in (("own", mask & ~peer), ("peer", mask & peer)):
                tokens = int(rows.sum())
                if tokens:
                    self._metrics["train"][f"graft/clip_frac_{name}"].append(
                        float((clipped & rows).sum()) / tokens
                    )
        return loss
