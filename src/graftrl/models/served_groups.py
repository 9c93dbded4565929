"""A served peer's answers as trajectory rows: what graftrl train and GraftGRPOTrainer share.

``served_rows`` turns one step's answered groups (``graftrl.models.served``) into the trajectory
store's rows of source ``peer.name``, with GRPO advantages within each group (eq. 1), so a served
group is exactly what a stored peer replays; ``dense_records`` lays a peer's groups out as the
receiver indexes them. ``api_key`` reads the endpoint's key from the environment (never from a
config, never logged); ``client_of`` opens a peer's client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graftrl.core.advantages import grpo_advantages
from graftrl.models.served import ServedCompletion, ServedPeerClient, ServedPeerError
from graftrl.storage.data import MathProblem
from graftrl.storage.log_keys import SERVED_COST_KEYS
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.store import StoredTrajectory

COST_KEYS = SERVED_COST_KEYS
"""Per-step cost of a served peer, logged as ``served_<key>/<peer>`` (the fact: storage.log_keys)."""


def api_key(peer: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """The peer's key from the environment variable ``api_key_env`` names (never from the config)."""
    if not peer.api_key_env:
        return None
    value = (os.environ if environ is None else environ).get(peer.api_key_env)
    if not value:
        raise ServedPeerError(
            f"peers[{peer.name}].api_key_env: the environment variable {peer.api_key_env} is not set; "
            "export it (the key is read from the environment only), or remove api_key_env"
        )
    return value


def client_of(peer: Any) -> ServedPeerClient:
    """The client of a served peer's settings (``config.peers.ServedPeerConfig``: a ``peers[]`` entry
    with ``source: served``, or TRL's ``ServedPeer``, the same class)."""
    return ServedPeerClient(
        peer.name,
        peer.endpoint,
        peer.model,
        api_key(peer),
        concurrency=peer.concurrency,
        retries=peer.retries,
        backoff_s=peer.backoff_s,
        step_timeout_s=peer.timeout_s,
    )


def served_rows(
    *,
    step: int,
    source: str,
    prompt_ids: Sequence[str],
    prompt_texts: Sequence[str],
    indices: Sequence[int],
    answers: Sequence[list[ServedCompletion]],
    rewards: Sequence[Sequence[float]],
    n: int,
    tokenizer_id: str,
    adv_eps: float,
    adv_std_unbiased: bool,
) -> list[list[StoredTrajectory]]:
    """The stored rows of each answered group (``indices``: their prompts' positions in the batch,
    ``prompt_ids`` and ``prompt_texts`` indexed as the batch), with GRPO advantages within the group
    (eq. 1) on ``rewards`` [G][n] (``adv_eps``, ``adv_std_unbiased`` as the trainer's)."""
    if not indices:
        return []
    advantages = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), adv_eps, adv_std_unbiased)
    groups = []
    for g, (p, completions) in enumerate(zip(indices, answers, strict=True)):
        group = []
        for i, completion in enumerate(completions):
            record = TrajectoryRecord(
                prompt_id=str(prompt_ids[p]),
                step=int(step),
                source=source,
                index=i,
                response=completion.text,
                reward=float(rewards[g][i]),
                advantage=float(advantages[g, i]),
                mean_logprob=completion.mean_logprob,
                num_tokens=len(completion.token_logprobs),
                num_bytes=len(completion.text.encode("utf-8")),
                finished=completion.finished,
            )
            group.append(
                StoredTrajectory.from_record(
                    record,
                    prompt_text=prompt_texts[p],
                    tokenizer_id=tokenizer_id,
                    n=n,
                    group_index=p,
                    token_logprobs=completion.token_logprobs,
                    eos_logprob=completion.eos_logprob,
                )
            )
        groups.append(group)
    return groups


def dense_records(
    groups: Sequence[list[TrajectoryRecord] | None],
    problems: Sequence[MathProblem],
    step: int,
    source: str,
    n: int,
) -> list[TrajectoryRecord]:
    """[P * n] records, row p * n + i, as the receiver indexes them (``training.rows``); a prompt
    without a group gets empty placeholders with reward 0 (never a candidate, never trained on)."""
    out: list[TrajectoryRecord] = []
    for p, group in enumerate(groups):
        out += group or [
            TrajectoryRecord(str(problems[p].id), int(step), source, i, "", 0.0, 0.0, 0.0, 0, 0, False)
            for i in range(n)
        ]
    return out
