"""What a receiver trains on at a step: one ``TrainingRow`` per response, on its own tokenization.

``build_rows`` turns the method's plan into rows: own responses with their behaviour log-probs,
peer responses re-tokenized by the receiver (algorithm.md §2.2) and, for a method that scores
peers, re-scored in one no-grad pass that gives both the ratio's denominator (eq. 9) and the
receiver's side of the compatibility score (eq. 7), then weighted (eq. 8 or the method's rule;
``methods.receive``, the path the TRL integration takes too). The same pass measures how the
step's moved groups contrast (``core.contrast``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import Tensor

from graftrl.config import Config
from graftrl.core import is_success, truncated_is_weights
from graftrl.core.contrast import GroupContrast, contrast_metrics, group_contrast
from graftrl.methods import ExchangePlan, Method
from graftrl.methods.receive import scores_peer_rows, weigh_peers
from graftrl.models.policy import Policy
from graftrl.models.rollout import RolloutBatch
from graftrl.storage.records import TrajectoryRecord


@dataclass(frozen=True)
class TrainingRow:
    """One response the receiver optimises on this step, on the receiver's tokenization."""

    group: int
    """Index of the row's group in the plan."""
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    peer: bool
    nll: bool
    """Trained by the method's NLL term (SGT), outside the surrogate."""
    source: str
    finished: bool
    """The response ended with EOS (its last token is outside lbar's content tokens)."""
    source_mean_logp: float
    """lbar of the sampling policy on its own tokenization (the record's mean_logprob)."""
    old_logprobs: Tensor
    """[T] the receiver's old log-probs: the behaviour log-probs of own rows, the no-grad pass of
    scored peer rows (zeros where the loss does not read them)."""
    weight: float = 1.0
    """1 for own rows, w for peer rows (0 removes a row); 0 for NLL rows, which the surrogate skips."""
    tis_weights: Tensor | None = None
    """[T] truncated importance-sampling weights of own rows (``rollout.tis_cap``), else None."""

    @property
    def length(self) -> int:
        """Response tokens (the row's share of a token-mean denominator)."""
        return len(self.response_ids)


@dataclass(frozen=True)
class CompatibilityScores:
    """One receiver's compatibility scores at a step: a line of compatibility.jsonl.

    Order (a contract ``graftrl probe`` relies on, tests/test_probe.py): entry k is the k-th
    scored peer response in the plan's order: its peer groups that are not NLL groups, in
    ``plan.groups`` order, and within each group its kept responses (``keep``) by index."""

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
    admitted: list[bool] = field(default_factory=list)
    """It entered the loss (w > 0): what a report counts as admitted, whatever the rule."""
    advantage: list[float] = field(default_factory=list)
    """The advantage it was trained with (the source's), rounded to 5 decimals."""
    prompt_id: list[str] = field(default_factory=list)
    """Its prompt's id."""
    response: list[str] | None = None
    """Its text (``logging.log_transfers``; None when off)."""


@dataclass(frozen=True)
class TrainingBatch:
    """A receiver's rows at a step, with the metrics of building them."""

    rows: tuple[TrainingRow, ...]
    metrics: dict[str, Any]
    """Peer responses, admissions, s and w summaries, TIS and contrast metrics."""
    compatibility: CompatibilityScores | None = None
    """The peer rows' compatibility scores, when the method scores peers."""
    group_contrasts: dict[int, GroupContrast] = field(default_factory=dict)
    """The contrast of each moved group, by its index in the plan (when measured): the
    ``contrast_*`` metrics are these summed (``graftrl probe`` keeps them per direction)."""


def build_rows(
    step: int,
    rollout: RolloutBatch,
    plan: ExchangePlan,
    records: Mapping[str, list[TrajectoryRecord]],
    *,
    policy: Policy,
    method: Method,
    config: Config,
    generator: torch.Generator,
    timings: dict[str, float],
    contrast: bool = True,
) -> TrainingBatch:
    """The receiver's rows for every planned group; peer rows re-tokenized and re-scored. Rows, and
    the compatibility scores of the peer rows, follow ``plan.groups`` and each group's responses
    by index (``CompatibilityScores`` states the order).

    ``contrast``: measure the moved groups' contrast (rank 0 of a sharded policy; every rank holds
    the same rows)."""
    n = rollout.n
    rows: list[TrainingRow] = []
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
                moved_rows[(group_index, i)] = len(rows)
                record = records[group.source][flat]
                response = policy.encode_response(record.response, record.finished)
                old = torch.zeros(len(response))  # unused by NLL rows
                if not group.nll:  # scored below, in one batched pass
                    peer_rows.append(len(rows))
                    peer_records.append(record)
                finished, mean_logp = record.finished, record.mean_logprob
            else:
                own_rows.append(len(rows))
                response, old = rollout.response_ids[flat], rollout.behaviour_logprobs[flat]
                finished, mean_logp = rollout.finished[flat], rollout.content_mean_logprob(flat)
            rows.append(
                TrainingRow(
                    group=group_index,
                    prompt_ids=rollout.prompt_ids[group.prompt],
                    response_ids=response,
                    advantage=float(group.advantages[i]),
                    peer=group.peer,
                    nll=group.nll,
                    source=group.source,
                    finished=finished,
                    source_mean_logp=mean_logp,
                    old_logprobs=old,
                    # NLL rows are outside the surrogate (weight 0 there); the method's loss trains them.
                    weight=0.0 if group.nll else 1.0,
                )
            )
    info: dict[str, Any] = {"peer_responses": len(peer_rows)}
    cap = config.rollout.tis_cap
    if cap is not None and own_rows:
        # Truncated importance sampling: the trainer's own old log-probs replace the rollout
        # engine's in the ratio, and min(pi_trainer / pi_rollout, cap) weighs each token.
        start = time.perf_counter()
        trainer_old = policy.score(
            [rows[r].prompt_ids for r in own_rows], [rows[r].response_ids for r in own_rows]
        )
        for r, old in zip(own_rows, trainer_old, strict=True):
            behaviour = rows[r].old_logprobs
            rows[r] = replace(
                rows[r], old_logprobs=old, tis_weights=truncated_is_weights(old, behaviour, cap)
            )
        weights = torch.cat([cast(Tensor, rows[r].tis_weights) for r in own_rows])  # each set above
        info.update(
            tis_weight_mean=float(weights.mean()),
            tis_truncated_frac=float((weights >= cap).float().mean()),
        )
        timings["time_old_logprob"] = time.perf_counter() - start
    if not peer_rows:
        return TrainingBatch(tuple(rows), info)
    scored = scores_peer_rows(method)
    old_logprobs = None
    if scored:
        start = time.perf_counter()
        # The receiver's old policy on its own tokenization of every grafted response (eq. 9),
        # which also gives lbar for the compatibility score (eq. 7, EOS excluded on both sides).
        old_logprobs = policy.score(
            [rows[r].prompt_ids for r in peer_rows], [rows[r].response_ids for r in peer_rows]
        )
        for k, row in enumerate(peer_rows):
            rows[row] = replace(rows[row], old_logprobs=old_logprobs[k])
        timings["time_peer_logprob"] = time.perf_counter() - start
    weights = weigh_peers(method, old_logprobs, peer_records, generator)
    for k, row in enumerate(peer_rows):
        rows[row] = replace(rows[row], weight=float(weights.w[k]))
    info.update(weights.metrics())
    groups: dict[int, GroupContrast] = {}
    if contrast:
        groups = moved_group_contrasts(plan, records, rows, moved_rows, policy, config, scored)
        info.update(contrast_metrics(sum(groups.values(), GroupContrast())))
    s, w = weights.s, weights.w
    if s is None:  # not scored: no compatibility.jsonl line
        return TrainingBatch(tuple(rows), info, group_contrasts=groups)
    # The driver appends it to compatibility.jsonl (one writer, whatever the backend).
    compatibility = CompatibilityScores(
        step=step,
        receiver=policy.name,
        source=[rec.source for rec in peer_records],
        s=[round(float(x), 5) for x in s],
        reward=[rec.reward for rec in peer_records],
        w=[round(float(x), 5) for x in w],
        admitted=[bool(x > 0) for x in w],
        advantage=[round(rows[row].advantage, 5) for row in peer_rows],
        prompt_id=[rec.prompt_id for rec in peer_records],
        response=[rec.response for rec in peer_records] if config.logging.log_transfers else None,
    )
    return TrainingBatch(tuple(rows), info, compatibility, groups)


def moved_group_contrasts(
    plan: ExchangePlan,
    records: Mapping[str, list[TrajectoryRecord]],
    rows: list[TrainingRow],
    moved_rows: Mapping[tuple[int, int], int],
    policy: Policy,
    config: Config,
    scored: bool,
) -> dict[int, GroupContrast]:
    """The contrast of each moved group (``core.contrast``), by its index in the plan, on the
    receiver's tokenization: every response of each moved source group (one the receiver does not
    train on, e.g. a wrong one under success-only transfer, is tokenized here and pushes 0).
    ``scored``: peer rows hold the receiver's old log-probs."""
    n, logging = config.rollout.n, config.logging
    out: dict[int, GroupContrast] = {}
    for group_index, group in enumerate(plan.groups):
        if not group.peer or group.nll:
            continue
        tokens, correct, push, logprobs = [], [], [], []
        for i in range(n):
            record = records[group.source][group.prompt * n + i]
            row = moved_rows.get((group_index, i))
            ids = (
                rows[row].response_ids
                if row is not None
                else policy.encode_response(record.response, record.finished)
            )
            tokens.append(ids[:-1] if record.finished else ids)  # content tokens, no EOS
            correct.append(is_success(record.reward, config.reward.success_threshold))
            push.append(rows[row].weight * rows[row].advantage if row is not None else 0.0)
            # the receiver's old log-probs of a scored row (peer rows of a scoring method)
            old = rows[row].old_logprobs if row is not None and scored else None
            logprobs.append(old.tolist() if old is not None else None)
        out[group_index] = group_contrast(
            tokens, correct, push, logging.contrast_max_tokens, logging.contrast_max_pairs, logprobs
        )
    return out
