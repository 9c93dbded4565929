"""What a method measures: the ``LossMetric`` keys of its loss (sums and counts) and the
``PlanKey`` keys of its plan's diagnostics, in metrics.jsonl.

A loss returns, with its value, a dict of detached scalar *sums* over the rows of its micro-batch
(clipped tokens, a KL summed over tokens, rows and their sequence ratios summed, ...). The
worker adds each sum over the step's micro-batches, minibatches, epochs and data-parallel ranks,
and logs every metric the method declares as the ratio of two totals. As in the HACPO recipe's
sums and counts, the result does not depend on how the rows were cut into micro-batches or
ranks (a mean of per-micro-batch means would). A loss returns only sums its ``loss_metrics``
name; the worker refuses any other key, so a new measurement cannot be dropped unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINED_COUNTS = (
    "trained_own_tokens",
    "trained_peer_tokens",
    "trained_peer_pos_tokens",
    "trained_peer_neg_tokens",
)
"""The worker's counts of what it trained at a step (every kept row, zero-advantage rows included,
whose forward pass it skips, every epoch): response tokens of own rows, of peer rows, and of peer
rows with a positive / a negative advantage. A ``LossMetric`` may divide by them; a loss never
returns them."""

FRACTION = "fraction (0-1)"


@dataclass(frozen=True)
class LossMetric:
    """A metrics.jsonl key of a method's loss: ``numerator / denominator`` of the step's totals.

    Both are names of sums the loss returns, or the denominator is one of ``TRAINED_COUNTS``. A
    numerator the loss did not return at the step counts 0 (no clipped token). A metric that
    divides by a sum of the loss is left out of the step's row when the loss returned neither sum
    (nothing measured: no KL term, no NLL row); one that divides by the worker's count is always
    logged. Either is ``empty`` when its denominator is 0.
    """

    key: str
    numerator: str
    denominator: str
    meaning: str
    unit: str
    empty: float | None = None

    def __post_init__(self) -> None:
        if self.numerator in TRAINED_COUNTS:
            raise ValueError(
                f"loss metric {self.key!r}: the numerator {self.numerator!r} is the worker's count"
            )

    def sums(self) -> tuple[str, ...]:
        """The names of the sums the loss returns for this metric."""
        return tuple(name for name in (self.numerator, self.denominator) if name not in TRAINED_COUNTS)


CLIP_OWN = LossMetric(
    "clip_frac_own",
    "own_clipped_tokens",
    "trained_own_tokens",
    "share of the policy's own trained tokens whose ratio was clipped",
    FRACTION,
    empty=0.0,
)
CLIP_PEER = LossMetric(
    "clip_frac_peer",
    "peer_clipped_tokens",
    "trained_peer_tokens",
    "share of peer trained tokens whose ratio was clipped (null: no peer tokens)",
    FRACTION,
)
CLIP_PEER_POS = LossMetric(
    "clip_frac_peer_pos",
    "peer_pos_clipped_tokens",
    "trained_peer_pos_tokens",
    "the same over peer tokens with a positive advantage, whose push up clipping stops (null: none)",
    FRACTION,
)
CLIP_PEER_NEG = LossMetric(
    "clip_frac_peer_neg",
    "peer_neg_clipped_tokens",
    "trained_peer_neg_tokens",
    "the same over peer tokens with a negative advantage, whose push down clipping stops",
    FRACTION,
)
OWN_S = LossMetric(
    "own_s_mean",
    "own_s_sum",
    "own_rows",
    "mean over the own rows trained with a gradient of their sequence ratio s = exp(mean_t log rho_t) "
    "to the old policy: how far the update moved them (HACPO: GSPO's ratio)",
    "ratio",
)
PEER_S = LossMetric(
    "peer_s_mean",
    "peer_s_sum",
    "peer_rows",
    "the same over peer rows (to the receiver's old policy on its tokenization; HACPO: its peer ratio, "
    "the current receiver's lbar against the source's behaviour lbar)",
    "ratio",
)
KL = LossMetric(
    "kl",
    "kl_sum",
    "kl_tokens",
    "mean k3 estimate of KL(pi ‖ pi_ref) over the own response tokens trained with a gradient "
    "(`train.kl_coef` > 0)",
    "nats",
)

CLIPPING = (CLIP_OWN, CLIP_PEER)
"""Every method's loss reports what it clipped on own and on peer tokens."""
CLIPPING_BY_SIGN = (CLIP_PEER_POS, CLIP_PEER_NEG)
"""Peer tokens clipped by the advantage's sign (losses built on ``core.clipped_policy_loss``)."""


@dataclass(frozen=True)
class PlanKey:
    """A metrics.jsonl key of a method's plan (``ExchangePlan.diagnostics``): a name, or a pattern
    with one ``<source>`` placeholder (``candidates/<source>``). The method that logs it declares
    it (``Method.plan_keys``); ``graftrl metrics-reference`` lists it under the methods' names."""

    name: str
    meaning: str
    unit: str
