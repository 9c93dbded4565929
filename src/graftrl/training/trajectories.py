"""Rollout batch -> records: the one place a ``RolloutBatch`` becomes trajectory records.

A rollout batch is prompt-major (row = p * n + i). ``rollout_records`` gives the tokenizer-neutral
records the trainer exchanges between models; ``stored_rows`` extends those same records with what
the trajectory store keeps for replay (prompt text, tokenizer, group, per-token log-probs), so a
stored row's ``to_record()`` is exactly the record the trainer exchanged at that step.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

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
