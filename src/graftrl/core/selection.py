"""Which groups move between models (SPEC section 2.1, eq. 4 and balanced exchange)."""

from __future__ import annotations

import torch
from torch import Tensor


def transfer_candidates(k_receiver: Tensor, k_source: Tensor, n: int) -> Tensor:
    """C_{S->R} (eq. 4): prompts where the receiver failed all n and the source group is mixed.

    k_receiver, k_source: [P] success counts. Returns BoolTensor [P].
    """
    return (k_receiver == 0) & (k_source >= 1) & (k_source < n)


def select_with_ties(candidates: Tensor, k_source: Tensor, m: int) -> Tensor:
    """Keep the m candidates with the most source successes, plus every tie at the boundary.

    candidates: BoolTensor [P]; k_source: [P]. Returns BoolTensor [P]; empty when m == 0.
    """
    count = int(candidates.sum())
    if m <= 0 or count == 0:
        return torch.zeros_like(candidates)
    if m >= count:
        return candidates.clone()
    ranked = torch.sort(k_source[candidates], descending=True).values
    boundary = ranked[m - 1]
    # Every candidate strictly above the boundary is within the first m; ties at it all stay.
    return candidates & (k_source >= boundary)


def balanced_selection(k_a: Tensor, k_b: Tensor, n: int, balance: bool = True) -> tuple[Tensor, Tensor]:
    """Balanced exchange between A and B.

    k_a, k_b: [P] success counts of A's and B's groups on the same prompts.
    Returns (a_to_b, b_to_a), BoolTensor [P] each: prompts where B receives A's group, and vice
    versa. With ``balance``, m = min(|C_{A->B}|, |C_{B->A}|) and each direction keeps its top-m by
    source successes plus boundary ties (m == 0 moves nothing either way); without it, every
    candidate moves.
    """
    a_to_b = transfer_candidates(k_b, k_a, n)
    b_to_a = transfer_candidates(k_a, k_b, n)
    if not balance:
        return a_to_b, b_to_a
    m = min(int(a_to_b.sum()), int(b_to_a.sum()))
    return select_with_ties(a_to_b, k_a, m), select_with_ties(b_to_a, k_b, m)
