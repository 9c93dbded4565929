"""GRAFT on one TRL generation batch: all-fail groups replaced by a stored peer's groups.

No TRL import: functions of the batch's tensors, graftrl's GRAFT method (its plan, compatibility
score and weights, ``graftrl.methods.graft``), the receive path ``graftrl train`` takes too
(stored groups re-verified: ``training.trajectories.peer_groups``; scores and weights:
``methods.receive``) and two callables the trainer provides (re-tokenize a response, score
completions with the receiver's no-grad forward).

The batch is TRL's generation batch on one process, B = P x n rows, prompt-major (row p * n + i is
response i of prompt p): ``prompt_ids`` / ``prompt_mask`` [B, Lp] left-padded, ``completion_ids`` /
``completion_mask`` [B, Lc] right-padded, ``advantages`` [B], ``num_items_in_batch`` (the
completion tokens of the batch: the ``dapo`` loss's token-mean denominator) and, when TRL computed
them, ``old_per_token_logps`` [B, Lc].

What changes (algorithm.md §2.1-2.3, the rows ``graftrl train`` builds in ``training.rows.build_rows``):

- on each prompt GRAFT selects (the receiver failed all n, the peer's group is mixed), the n own
  rows are replaced by the peer's n responses re-tokenized with the receiver's tokenizer (its EOS
  appended when the response finished), on the receiver's own prompt row;
- each transferred response is scored by the receiver's old policy (no grad) for its
  compatibility s (eq. 7) and weight w (eq. 8), and, when the batch has ``old_per_token_logps``,
  for the ratio's denominator (eq. 9);
- its advantage is the source's, times w: w >= 0, so ``w * min(rho a, clip(rho) a) =
  min(rho w a, clip(rho) w a)`` and folding w into the advantage is exact;
- a response with w = 0, or left out by ``transfer: success_only``, keeps its row with an empty
  completion mask, so it is in neither the loss nor its token denominator (``num_items_in_batch``
  is recounted; the row count, which TRL splits into equal micro-batches, stays B);
- ``graft_is_peer`` [B] marks the peer rows (for the minibatch order and the clip metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from graftrl.core import SUCCESS_THRESHOLD, minibatch_order
from graftrl.methods import ExchangePlan, GroupOutcomes, Method
from graftrl.methods.receive import PeerWeights, scores_peer_rows, weigh_peers
from graftrl.storage.records import TrajectoryRecord
from graftrl.training.trajectories import PeerGroups

IS_PEER = "graft_is_peer"
"""Batch key: [B] bool, the row is a transferred peer response."""

BATCH_KEYS = frozenset(
    {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"}
)
"""The keys of TRL's generation batch that the exchange understands, besides old_per_token_logps."""

Encode = Callable[[str, bool], list[int]]
"""(response text, finished) -> the receiver's token ids for it (EOS appended when finished)."""
Score = Callable[[Tensor, Tensor, list[list[int]]], list[Tensor]]
"""(prompt_ids [R, Lp], prompt_mask [R, Lp], R completions) -> each completion's per-token log-probs."""


@dataclass
class Exchange:
    """One generation batch after GRAFT, and what happened to it."""

    batch: dict[str, Any]
    plan: ExchangePlan
    selected: list[int]
    """Prompt indices (in the batch) whose own group was replaced."""
    sources: list[str] = field(default_factory=list)
    """Source of each scored (transferred) response."""
    s: Tensor | None = field(default_factory=lambda: torch.zeros(0))
    """[R] compatibility score of each transferred response (eq. 7); None when the method does
    not score peers."""
    w: Tensor = field(default_factory=lambda: torch.zeros(0))
    """[R] its weight (eq. 8)."""
    rewards: list[float] = field(default_factory=list)
    """[R] its reward."""
    metrics: dict[str, float] = field(default_factory=dict)
    """graftrl's exchange metrics (names as in docs/metrics.md)."""


def graft_exchange(
    batch: Mapping[str, Any],
    rewards: Tensor,
    peers: Mapping[str, PeerGroups],
    method: Method,
    *,
    receiver: str,
    encode: Encode,
    score: Score,
    pad_token_id: int,
    plan_generator: torch.Generator,
    weight_generator: torch.Generator,
    success_threshold: float = SUCCESS_THRESHOLD,
) -> Exchange:
    """GRAFT's replacement of the receiver's all-fail groups (module docstring). rewards: [P, n], any
    finite numbers; ``success_threshold``: a reward at or above it is a success (the receiver's k of
    eq. 4; the peers' outcomes carry their own, ``peer_groups``)."""
    unknown = set(batch) - BATCH_KEYS - {"old_per_token_logps"}
    if unknown:
        raise ValueError(f"graft_exchange: batch keys {sorted(unknown)} are not supported")
    num_prompts, n = rewards.shape
    advantages = batch["advantages"].detach().float().cpu().view(num_prompts, n)
    outcomes = {receiver: GroupOutcomes(rewards.float().cpu(), advantages, success_threshold)}
    outcomes.update({name: group.outcomes for name, group in peers.items()})
    plan = method.plan(outcomes, plan_generator)[receiver]

    new_advantages = batch["advantages"].detach().clone()
    is_peer = torch.zeros(num_prompts * n, dtype=torch.bool, device=new_advantages.device)
    transferred: list[tuple[int, TrajectoryRecord, list[int], float, str]] = []
    for group in plan.groups:
        rows = range(group.prompt * n, (group.prompt + 1) * n)
        if not group.peer:
            new_advantages[rows.start : rows.stop] = group.advantages.to(new_advantages)
            continue
        records = peers[group.source].records[group.prompt]
        assert records is not None, "GRAFT selected a prompt without a stored group"
        for i, row in enumerate(rows):
            is_peer[row] = True
            if group.keep is None or bool(group.keep[i]):
                record = records[i]
                ids = encode(record.response, record.finished)
                transferred.append((row, record, ids, float(group.advantages[i]), group.source))

    out = dict(batch)
    selected = sorted({g.prompt for g in plan.peer_groups})
    exchange = Exchange(out, plan, selected)
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    width = max([completion_ids.shape[1]] + [len(ids) for _, _, ids, _, _ in transferred])
    out["completion_ids"] = _pad_right(completion_ids, width, pad_token_id)
    out["completion_mask"] = _pad_right(completion_mask, width, 0)
    old = batch.get("old_per_token_logps")
    if old is not None:
        out["old_per_token_logps"] = _pad_right(old, width, 0.0)
    peer_rows = is_peer.nonzero().flatten()
    out["completion_ids"][peer_rows] = pad_token_id  # replaced rows start empty (out of the loss)
    out["completion_mask"][peer_rows] = 0
    new_advantages[peer_rows] = 0.0

    if transferred:
        records_t = [record for _, record, _, _, _ in transferred]
        logprobs = None
        if scores_peer_rows(method) or old is not None:  # s, w, or the ratio's denominator (eq. 9)
            rows_t = torch.tensor([row for row, *_ in transferred], device=completion_ids.device)
            completions = [ids for _, _, ids, _, _ in transferred]
            logprobs = score(batch["prompt_ids"][rows_t], batch["prompt_mask"][rows_t], completions)
        weights = weigh_peers(method, logprobs, records_t, weight_generator)
        w = weights.w
        for k, (row, _, ids, advantage, _) in enumerate(transferred):
            if float(w[k]) <= 0 or not ids:
                continue  # out of the loss and of its denominator
            out["completion_ids"][row, : len(ids)] = torch.tensor(ids, dtype=completion_ids.dtype)
            out["completion_mask"][row, : len(ids)] = 1
            new_advantages[row] = float(w[k]) * advantage
            if old is not None and logprobs is not None:
                out["old_per_token_logps"][row, : len(ids)] = logprobs[k].to(old)
        exchange.sources = [source for *_, source in transferred]
        exchange.s, exchange.w = weights.s, w
        exchange.rewards = [rec.reward for rec in records_t]
    out["advantages"] = new_advantages
    out["num_items_in_batch"] = out["completion_mask"].sum().to(batch["num_items_in_batch"].dtype)
    out[IS_PEER] = is_peer
    exchange.metrics = _metrics(plan, peers, exchange)
    return exchange


def _pad_right(values: Tensor, width: int, value: float) -> Tensor:
    if values.shape[1] >= width:
        return values.clone()
    pad = values.new_full((values.shape[0], width - values.shape[1]), value)
    return torch.cat([values, pad], dim=1)


def _metrics(plan: ExchangePlan, peers: Mapping[str, PeerGroups], exchange: Exchange) -> dict[str, float]:
    metrics = dict(plan.diagnostics)
    for name, group in peers.items():
        metrics[f"peer_prompts_found/{name}"] = float(group.found)
        metrics[f"stored_reward_changes/{name}"] = float(group.reward_changes)
    metrics["peer_responses"] = float(len(exchange.sources))
    metrics["peer_admitted"] = 0.0
    if len(exchange.w):
        weights = PeerWeights(exchange.s, exchange.w)
        metrics.update({key: float(value) for key, value in weights.metrics().items()})
    return metrics


def peer_last_order(
    is_peer: Tensor, rows_per_step: int, position: str, generator: torch.Generator | None = None
) -> Tensor:
    """[B] row order for the generation batch: TRL's shuffle (``torch.randperm`` on the global RNG,
    as TRL's ``shuffle_sequence_dict``), then own rows before peer rows in optimizer steps of
    ``rows_per_step`` rows with the peer steps placed by ``position`` (``core.minibatch_order``:
    last, first or uniform, the latter drawn from ``generator``). Without peer rows this is exactly
    TRL's permutation."""
    permutation = torch.randperm(is_peer.numel())
    chunks = minibatch_order(is_peer.cpu()[permutation], rows_per_step, position, generator)  # type: ignore[arg-type]
    return permutation[torch.cat(chunks)] if chunks else permutation
