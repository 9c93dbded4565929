"""A policy's update at a step: the optimizer steps over its rows, in the method's minibatch order.

Each minibatch's rows share one token-mean denominator (eq. 10), so its micro-batches (cut by
``train.micro_batch_size`` / ``micro_batch_tokens``) and, under data parallelism, its ranks'
shares (``parallel.split_rows``) each compute the loss of their rows over the whole minibatch's
denominators and their gradients add up to the minibatch's. Rows with zero advantage add only to
the denominator (their gradient is exactly zero), so they skip the forward pass.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graftrl.config import Config
from graftrl.errors import TrainingDivergedError
from graftrl.methods import ExchangePlan, LossInputs, Method, RowOrigins
from graftrl.methods.loss_metrics import TRAINED_COUNTS, LossMetric
from graftrl.models.policy import Policy
from graftrl.training.parallel import split_rows, sum_across_ranks
from graftrl.training.rows import TrainingRow


@dataclass
class NonfiniteGuard:
    """Optimizer steps skipped in a row for a NaN/inf loss or gradient norm (kept across steps and
    in checkpoints: ``train.max_nonfinite_steps`` counts them whatever the step boundaries)."""

    policy_name: str
    limit: int
    in_row: int = 0

    def skip(self, policy: Policy, loss: float, grad_norm: float) -> None:
        """Drop a non-finite minibatch's gradient; stop after ``limit`` in a row."""
        assert policy.optimizer is not None
        policy.optimizer.zero_grad(set_to_none=False)
        self.in_row += 1
        if self.in_row >= self.limit:
            raise TrainingDivergedError(
                f"policy {self.policy_name!r}: loss {loss} / grad norm {grad_norm} non-finite in {self.limit} "
                "optimizer steps in a row (train.max_nonfinite_steps); the weights are kept from before them: "
                "lower optim.lr, set train.log_ratio_clamp or train.clip_ratio_c, or check the data and model"
            )


class LossTotals:
    """A step's totals of the sums a method's loss returns and of the worker's counts of the
    tokens it trained, and the method's ``loss_metrics`` computed from them."""

    def __init__(self, method: Method) -> None:
        self.method = method.name or type(method).__name__
        self.metrics: tuple[LossMetric, ...] = tuple(method.loss_metrics)
        self.sums = tuple(dict.fromkeys(name for metric in self.metrics for name in metric.sums()))
        self.totals = dict.fromkeys((*self.sums, *TRAINED_COUNTS), 0.0)
        self.returned = dict.fromkeys(self.sums, 0.0)
        """Micro-batches (of every rank) whose loss returned each sum."""

    def minibatch(self) -> tuple[dict[str, float], dict[str, float]]:
        """Fresh (sums, returned) accumulators for one minibatch's micro-batches."""
        return dict.fromkeys(self.sums, 0.0), dict.fromkeys(self.sums, 0.0)

    def accumulate(self, into: tuple[dict[str, float], dict[str, float]], values: dict[str, Tensor]) -> None:
        """Add one micro-batch's loss sums; a key the method does not declare is a bug in it."""
        sums, returned = into
        for key, value in values.items():
            if key not in sums:
                raise ValueError(
                    f"method {self.method!r}: its loss returned {key!r}, which none of its loss_metrics "
                    f"names (declared sums: {', '.join(self.sums)}); declare a LossMetric for it "
                    "(graftrl.methods.loss_metrics) or leave it out"
                )
            sums[key] += float(value)
            returned[key] += 1

    def add(self, sums: dict[str, float], returned: dict[str, float]) -> None:
        """A minibatch's sums (summed over ranks) into the step's totals."""
        for key in self.sums:
            self.totals[key] += sums[key]
            self.returned[key] += returned[key]

    def count(self, name: str, tokens: int) -> None:
        """Trained tokens into one of the worker's counts (``TRAINED_COUNTS``)."""
        self.totals[name] += tokens

    def values(self) -> dict[str, float | None]:
        """Each declared metric's value at the step (see ``LossMetric``)."""
        out: dict[str, float | None] = {}
        for metric in self.metrics:
            measured = any(self.returned[name] for name in metric.sums())
            if metric.denominator not in TRAINED_COUNTS and not measured:
                continue  # nothing measured at this step (no KL term, no NLL row)
            denominator = self.totals[metric.denominator]
            out[metric.key] = self.totals[metric.numerator] / denominator if denominator else metric.empty
        return out


@dataclass(frozen=True)
class Ranks:
    """Where this process sits among a policy's data-parallel ranks (world 1: no parallelism)."""

    world: int = 1
    rank: int = 0


def optimize(
    policy: Policy,
    method: Method,
    config: Config,
    rows: Sequence[TrainingRow],
    plan: ExchangePlan,
    generator: torch.Generator,
    guard: NonfiniteGuard,
    timings: dict[str, float],
    *,
    reference: Policy | None = None,
    ranks: Ranks = Ranks(),
) -> dict[str, Any]:
    """The optimizer steps over the planned groups, in the method's minibatch order; returns the
    update's metrics (loss, gradient norm, clipping, rows and tokens trained) and adds
    ``time_update`` to ``timings``."""
    train = config.train
    start = time.perf_counter()
    order = method.order_minibatches(plan, train.minibatch_prompts, generator)
    rows_of_group: dict[int, list[int]] = defaultdict(list)
    for index, row in enumerate(rows):
        rows_of_group[row.group].append(index)
    assert policy.optimizer is not None
    policy.model.train()
    totals = LossTotals(method)
    trained_rows = 0
    losses, grad_norms = [], []
    skipped = 0  # minibatches whose loss or grad norm was NaN/inf (no optimizer step)
    minibatch_index = 0
    for _ in range(train.update_epochs):
        for groups in order:
            members = [r for g in groups.tolist() for r in rows_of_group[g]]
            kept = [r for r in members if rows[r].weight > 0]
            nll_rows = [r for r in members if rows[r].nll]
            normalizer = sum(rows[r].length for r in kept)
            nll_normalizer = sum(rows[r].length for r in nll_rows)
            trained_rows += len(kept) + len(nll_rows)
            # Rows with zero advantage add only to the denominator: their gradient is exactly
            # zero, so skipping their forward pass changes nothing but the cost — except own
            # rows under a KL penalty, whose KL term still has a gradient.
            active = sorted(
                [r for r in kept if rows[r].advantage != 0 or (train.kl_coef > 0 and not rows[r].peer)]
                + nll_rows,
                key=lambda r: len(rows[r].prompt_ids) + rows[r].length,
            )
            for r in kept:
                totals.count("trained_peer_tokens" if rows[r].peer else "trained_own_tokens", rows[r].length)
                if rows[r].peer and rows[r].advantage != 0:
                    sign = "pos" if rows[r].advantage > 0 else "neg"
                    totals.count(f"trained_peer_{sign}_tokens", rows[r].length)
            policy.optimizer.zero_grad(set_to_none=False)
            parts = [[active[i] for i in part] for part in micro_batches(policy, rows, active, ranks)]
            loss_value = 0.0
            sums, returned = minibatch = totals.minibatch()
            for idx in parts:
                # An idle rank runs one of the minibatch's rows with loss x 0: FSDP's collectives
                # need every rank in every forward and backward.
                idle = not idx
                inputs = loss_inputs(
                    policy,
                    [rows[r] for r in (idx or active[:1])],
                    normalizer,
                    nll_normalizer,
                    reference,
                    origins=method.reads_row_origins,
                    minibatch_index=minibatch_index,
                    minibatch_rows=len(kept),
                )
                loss, m = method.loss(inputs)
                # FSDP averages gradients over ranks; the loss over the whole minibatch is the sum.
                (loss * (0 if idle else ranks.world)).backward()
                if idle:
                    continue
                loss_value += float(loss.detach())
                totals.accumulate(minibatch, m)
            if ranks.world > 1:  # the minibatch's sums over every rank's micro-batches
                reduced = sum_across_ranks([loss_value, *sums.values(), *returned.values()])
                loss_value = reduced[0]
                sums = dict(zip(sums, reduced[1 : 1 + len(sums)], strict=True))
                returned = dict(zip(returned, reduced[1 + len(sums) :], strict=True))
            totals.add(sums, returned)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), config.optim.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # DTensor: the global norm over every shard
                grad_norm = grad_norm.full_tensor()
            minibatch_index += 1
            if not (math.isfinite(loss_value) and math.isfinite(float(grad_norm))):
                skipped += 1
                guard.skip(policy, loss_value, float(grad_norm))
                continue
            guard.in_row = 0
            policy.optimizer.step()
            losses.append(loss_value)
            grad_norms.append(float(grad_norm))
    timings["time_update"] = time.perf_counter() - start
    return {
        "loss": statistics.fmean(losses) if losses else 0.0,
        "grad_norm": statistics.fmean(grad_norms) if grad_norms else 0.0,
        "optimizer_steps": len(losses),
        "nonfinite_skips": skipped,
        **totals.values(),
        "train_tokens": totals.totals["trained_own_tokens"] + totals.totals["trained_peer_tokens"],
        "train_rows": trained_rows,
    }


def micro_batches(
    policy: Policy, rows: Sequence[TrainingRow], active: list[int], ranks: Ranks
) -> list[list[int]]:
    """This rank's micro-batches (positions in ``active``), padded with empty ones to the most
    any rank has: one rank's rows as today, or its token-balanced share (``split_rows``), each cut
    by ``micro_batch_size`` rows or ``micro_batch_tokens`` padded tokens (``micro_batch_groups``)."""
    shapes = [(len(rows[r].prompt_ids), rows[r].length) for r in active]
    if ranks.world == 1:
        return policy.micro_batch_groups(shapes)
    shares = split_rows([p + r for p, r in shapes], ranks.world)
    per_rank = [
        [[share[k] for k in group] for group in policy.micro_batch_groups([shapes[i] for i in share])]
        for share in shares
    ]
    count = max(len(parts) for parts in per_rank)
    mine = per_rank[ranks.rank]
    return mine + [[] for _ in range(count - len(mine))]


def loss_inputs(
    policy: Policy,
    batch_rows: Sequence[TrainingRow],
    normalizer: int,
    nll_normalizer: int,
    reference: Policy | None = None,
    *,
    origins: bool = False,
    minibatch_index: int = 0,
    minibatch_rows: int = 0,
) -> LossInputs:
    """One micro-batch: the forward pass with grad, padded old log-probs and the row fields.

    ``origins``: build ``LossInputs.origins`` (a method's ``reads_row_origins``), with the
    minibatch's position among the step's optimizer steps and its surrogate row count."""
    batch = policy.pad([row.prompt_ids for row in batch_rows], [row.response_ids for row in batch_rows])
    logp = policy.response_logprobs(batch)  # [B, T]
    device = logp.device
    width = logp.shape[1]
    old = torch.nn.utils.rnn.pad_sequence([row.old_logprobs for row in batch_rows], batch_first=True)
    ref_logp = None
    if reference is not None:
        with torch.no_grad():
            ref_logp = reference.response_logprobs(batch)
    token_weights = None
    if any(row.tis_weights is not None for row in batch_rows):
        token_weights = torch.nn.utils.rnn.pad_sequence(
            [w if (w := row.tis_weights) is not None else torch.ones(row.length) for row in batch_rows],
            batch_first=True,
        ).to(device)[:, :width]

    def column(values: list[Any]) -> Tensor:
        return torch.tensor(values, device=device)

    row_origins = None
    if origins:
        row_origins = RowOrigins(
            receiver=policy.name,
            sources=tuple(row.source for row in batch_rows),
            source_mean_logp=column([row.source_mean_logp for row in batch_rows]),
            finished=column([row.finished for row in batch_rows]),
            minibatch_index=minibatch_index,
            minibatch_rows=max(minibatch_rows, 1),
        )
    return LossInputs(
        logp=logp,
        old_logp=old.to(device)[:, :width],
        advantages=column([row.advantage for row in batch_rows]),
        weights=column([row.weight for row in batch_rows]),
        mask=batch.response_mask,
        is_peer=column([row.peer for row in batch_rows]),
        normalizer=max(normalizer, 1),
        is_nll=column([row.nll for row in batch_rows]),
        nll_normalizer=max(nll_normalizer, 1),
        minibatch_tokens=max(normalizer + nll_normalizer, 1),
        ref_logp=ref_logp,
        token_weights=token_weights,
        origins=row_origins,
    )
