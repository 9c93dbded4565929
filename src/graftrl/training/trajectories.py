"""Rollout batch -> records, and stored groups -> the records a receiver replays.

A rollout batch is prompt-major (row = p * n + i). ``rollout_records`` gives the tokenizer-neutral
records the trainer exchanges between models; ``stored_rows`` extends those same records with what
the trajectory store keeps for replay (prompt text, tokenizer, group, per-token log-probs), so a
stored row's ``to_record()`` is exactly the record the trainer exchanged at that step.
``peer_groups`` turns a stored peer's groups back into records and outcomes, rewards re-verified
(algorithm.md §2.3): the trainer's stored peers and the TRL integration's replay both use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED, SUCCESS_THRESHOLD, reverified_advantages
from graftrl.methods import GroupOutcomes
from graftrl.models.rollout import RolloutBatch
from graftrl.storage.data import MathProblem
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.store import StoredTrajectory


def rollout_records(
    step: int,
    source: str,
    problems: Sequence[MathProblem],
    rollout: RolloutBatch,
    rewards: Tensor,
    advantages: Tensor,
) -> list[TrajectoryRecord]:
    """The records of a rollout batch (row = p * n + i); rewards, advantages: [P, n].

    The mean log-prob and token count are over content tokens (``RolloutBatch.content_*``: the
    terminal EOS excluded, eq. 6).
    """
    n = rollout.n
    rows_total = len(rollout.texts)
    if rows_total != len(problems) * n:
        raise ValueError(f"rollout_records: {rows_total} responses for {len(problems)} prompts x n={n}")
    flat_rewards = rewards.reshape(-1).tolist()
    flat_advantages = advantages.reshape(-1).tolist()
    if len(flat_rewards) != rows_total or len(flat_advantages) != rows_total:
        raise ValueError(
            f"rollout_records: rewards/advantages hold {len(flat_rewards)}/{len(flat_advantages)} "
            f"values, expected [P, n] = {rows_total}"
        )
    return [
        TrajectoryRecord(
            prompt_id=str(problems[row // n].id),
            step=int(step),
            source=source,
            index=row % n,
            response=text,
            reward=float(flat_rewards[row]),
            advantage=float(flat_advantages[row]),
            mean_logprob=rollout.content_mean_logprob(row),
            num_tokens=rollout.content_length(row),
            num_bytes=len(text.encode("utf-8")),
            finished=bool(rollout.finished[row]),
        )
        for row, text in enumerate(rollout.texts)
    ]


def stored_rows(
    records: Sequence[TrajectoryRecord],
    rollout: RolloutBatch,
    prompt_texts: Sequence[str],
    tokenizer_id: str,
) -> list[StoredTrajectory]:
    """The trajectory-store rows of ``rollout_records(...)`` for the same batch.

    prompt_texts: one per prompt, the strings the source's template was applied to (the problem
    with the run's suffix); tokenizer_id: ``store.tokenizer_id`` of the source's tokenizer.
    """
    n = rollout.n
    if len(records) != len(rollout.texts) or len(records) != len(prompt_texts) * n:
        raise ValueError(
            f"stored_rows: {len(records)} records, {len(rollout.texts)} responses and "
            f"{len(prompt_texts)} prompt texts x n={n} do not match"
        )
    out = []
    for row, record in enumerate(records):
        logprobs = rollout.behaviour_logprobs[row].float()
        has_eos = record.finished and len(logprobs) > 0
        out.append(
            StoredTrajectory.from_record(
                record,
                prompt_text=prompt_texts[row // n],
                tokenizer_id=tokenizer_id,
                n=n,
                group_index=row // n,
                token_logprobs=tuple((logprobs[:-1] if has_eos else logprobs).tolist()),
                eos_logprob=float(logprobs[-1]) if has_eos else None,
            )
        )
    return out


@dataclass(frozen=True)
class PeerGroups:
    """One stored peer's groups on a batch's P prompts."""

    outcomes: GroupOutcomes
    """[P, n] rewards and advantages; a prompt without a stored group has rewards 0 (no candidate)."""
    records: list[list[TrajectoryRecord] | None]
    """[P] the group's records in index order (rewards and advantages as in ``outcomes``), or None."""
    found: int
    """Prompts of the batch with a stored group."""
    reward_changes: int
    """Stored groups whose re-verified rewards differ from the stored ones (advantages recomputed)."""


def peer_groups(
    groups: Sequence[list[StoredTrajectory] | None],
    n: int,
    reverified: Mapping[int, Sequence[float]] | None = None,
    adv_eps: float = ADV_EPS,
    adv_std_unbiased: bool = ADV_STD_UNBIASED,
    success_threshold: float = SUCCESS_THRESHOLD,
) -> PeerGroups:
    """A peer's ``PeerGroups`` from its stored groups ([P] of n rows in index order, None where absent).

    ``reverified``: prompt index -> this run's rewards of the group's n responses; such a group keeps
    its stored advantages if the rewards are unchanged, else gets eq. 1 on the new rewards
    (``reverified_advantages``, algorithm.md §2.3). Groups not listed keep the stored values.
    ``success_threshold``: the run's ``reward.success_threshold`` (what the outcomes count as successes).
    """
    reverified = reverified or {}
    stored_rewards = torch.zeros(len(groups), n)
    stored_advantages = torch.zeros(len(groups), n)
    for p, group in enumerate(groups):
        if group is not None:
            stored_rewards[p] = torch.tensor([row.reward for row in group])
            stored_advantages[p] = torch.tensor([row.advantage for row in group])
    rewards = stored_rewards.clone()
    for p, values in reverified.items():
        rewards[p] = torch.tensor(list(values), dtype=rewards.dtype)
    advantages, changed = reverified_advantages(
        stored_rewards, stored_advantages, rewards, adv_eps, adv_std_unbiased
    )
    records: list[list[TrajectoryRecord] | None] = [
        None
        if group is None
        else [
            replace(row.to_record(), reward=float(rewards[p, i]), advantage=float(advantages[p, i]))
            for i, row in enumerate(group)
        ]
        for p, group in enumerate(groups)
    ]
    found = sum(group is not None for group in groups)
    outcomes = GroupOutcomes(rewards, advantages, success_threshold)
    return PeerGroups(outcomes, records, found, int(changed.sum()))
