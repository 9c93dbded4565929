"""What a transferred group can teach: the contrast between its correct and wrong responses.

GRPO advantages sum to zero over a group (eq. 1), so a token that the peer's correct and wrong
responses share gets opposite pushes that cancel; only where they *differ* is there a net signal
(docs/algorithm.md §5, "contrast"). These functions measure that on the receiver's tokenization of
one moved group:

- how much of each wrong response lies inside its longest common subsequence (LCS) with the
  closest correct response (overlap), and where it first departs from it (divergence);
- the push sum_i w_i A_i of the trained rows, split by outcome and by whether a token is *shared*
  (inside the LCS alignment with the closest response of the other outcome) or *distinct*. Each
  response's push is spread evenly over its tokens, so the four parts add up to the group's
  advantage mass sum_i w_i A_i;
- where the lesson is: of the receiver's surprise on the correct responses (sum_t -log pi_R of
  their tokens, the tokens it does not yet produce), the share on distinct tokens. Near 0, the
  peer's wrong responses contain the tokens the receiver lacks as well, and the push on them
  cancels; near 1, they are exactly where correct and wrong differ.

Cost is bounded for long responses: each response is compared on its first ``max_tokens`` tokens
with at most ``max_pairs`` responses of the other outcome (evenly spaced in group order, no random
draw); the LCS is rapidfuzz's bit-parallel one (a 4,096 x 4,096-token alignment takes ~30 ms).
Sums and counts, so groups, micro-batches and steps aggregate exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from rapidfuzz.distance import LCSseq

MAX_TOKENS = 4096
"""Tokens of each response compared (its first ones)."""
MAX_PAIRS = 8
"""Responses of the other outcome each response is compared with."""


@dataclass
class GroupContrast:
    """Sums and counts over moved groups (``+`` adds them)."""

    groups: int = 0
    """Moved groups measured (each has both outcomes)."""
    wrong: int = 0
    """Wrong responses measured (non-empty)."""
    overlap: float = 0.0
    """Sum over wrong responses of LCS(wrong, closest correct) / |wrong|."""
    divergence: float = 0.0
    """Sum over wrong responses of (tokens before the first one that differs from the closest
    correct response) / |wrong|: 0 = differs at once, 1 = a prefix of it."""
    mass_correct_shared: float = 0.0
    mass_correct_distinct: float = 0.0
    mass_wrong_shared: float = 0.0
    mass_wrong_distinct: float = 0.0
    """Sum of w * A over the trained rows' tokens, by outcome and shared / distinct."""
    surprise: float = 0.0
    """Sum of the receiver's -log pi over the correct responses' tokens (those with log-probs)."""
    surprise_distinct: float = 0.0
    """The part of it on distinct tokens."""

    def __add__(self, other: GroupContrast) -> GroupContrast:
        return GroupContrast(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _spaced(indices: list[int], count: int) -> list[int]:
    """At most ``count`` of ``indices``, evenly spaced (all of them when they are few)."""
    if len(indices) <= count:
        return indices
    return [indices[(k * len(indices)) // count] for k in range(count)]


def _closest(response: Sequence[int], others: Sequence[Sequence[int]]) -> int:
    """Index in ``others`` of the one with the longest LCS with ``response`` (first on ties)."""
    lengths = [LCSseq.similarity(response, other) for other in others]
    return max(range(len(others)), key=lambda k: (lengths[k], -k))


def shared_tokens(response: Sequence[int], other: Sequence[int]) -> list[bool]:
    """Per token of ``response``: inside one LCS alignment with ``other`` (rapidfuzz's)."""
    shared = [True] * len(response)
    for op in LCSseq.editops(response, other):
        if op.tag == "delete":  # a token of `response` the alignment leaves out
            shared[op.src_pos] = False
    return shared


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def group_contrast(
    responses: Sequence[Sequence[int]],
    correct: Sequence[bool],
    push: Sequence[float],
    max_tokens: int = MAX_TOKENS,
    max_pairs: int = MAX_PAIRS,
    logprobs: Sequence[Sequence[float] | None] | None = None,
) -> GroupContrast:
    """The contrast of one moved group.

    responses: [n] token ids on the receiver's tokenization, content only (no EOS); correct: [n]
    which of the source's rewards are successes (``advantages.is_success``); push: [n] w_i * A_i of the rows the receiver trains on (0 for a
    response it does not train on, e.g. a wrong one under success-only transfer); logprobs: [n]
    the receiver's old log-prob of each token of a response (None where not scored), for the
    surprise sums. A group without both outcomes measures nothing.
    """
    tokens = [list(r[:max_tokens]) for r in responses]
    right = [i for i, c in enumerate(correct) if c]
    wrong = [i for i, c in enumerate(correct) if not c]
    if not right or not wrong:
        return GroupContrast()
    out = GroupContrast(groups=1)
    for i, tokens_i in enumerate(tokens):
        others = _spaced(wrong if correct[i] else right, max_pairs)
        if not tokens_i:
            continue
        closest = tokens[others[_closest(tokens_i, [tokens[k] for k in others])]]
        shared = shared_tokens(tokens_i, closest)
        share = sum(shared) / len(shared)
        if not correct[i]:
            out.wrong += 1
            out.overlap += share
            out.divergence += common_prefix(tokens_i, closest) / len(tokens_i)
        if correct[i]:
            out.mass_correct_shared += push[i] * share
            out.mass_correct_distinct += push[i] * (1 - share)
            if logprobs is not None and (token_logprobs := logprobs[i]) is not None:
                surprise = [-float(lp) for lp in token_logprobs[: len(shared)]]
                out.surprise += sum(surprise)
                out.surprise_distinct += sum(x for x, same in zip(surprise, shared, strict=False) if not same)
        else:
            out.mass_wrong_shared += push[i] * share
            out.mass_wrong_distinct += push[i] * (1 - share)
    return out


def contrast_metrics(total: GroupContrast) -> dict[str, float | int | None]:
    """A step's ``contrast_*`` metrics from its moved groups' sums ({} when none was measured):
    overlap and divergence are means over wrong responses, the masses means per moved group."""
    if not total.groups:
        return {}
    per_wrong = (lambda value: value / total.wrong) if total.wrong else (lambda value: None)
    return {
        "contrast_groups": total.groups,
        "contrast_overlap": per_wrong(total.overlap),
        "contrast_divergence": per_wrong(total.divergence),
        "contrast_lesson": total.surprise_distinct / total.surprise if total.surprise > 0 else None,
        **{
            f"contrast_{name}": getattr(total, name) / total.groups
            for name in (
                "mass_correct_shared",
                "mass_correct_distinct",
                "mass_wrong_shared",
                "mass_wrong_distinct",
            )
        },
    }
