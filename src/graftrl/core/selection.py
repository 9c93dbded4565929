"""Which groups move between models (algorithm.md §2.1, eq. 4 and balanced exchange)."""

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


def multi_source_selection(successes: Tensor, n: int, balance: bool = True) -> Tensor:
    """GRAFT among K >= 2 models: which source's group each receiver takes on each prompt.

    successes: [K, P] success counts k_M(q) of the K models on the shared prompts.
    Returns LongTensor [K, P]: the source index whose group replaces receiver r's group on prompt
    q, or -1 to keep its own. Rule (the paper defines K = 2 only; this is graftrl's extension):
    1. candidates: k_r(q) = 0, and among the sources with 1 <= k_s(q) < n (eq. 4) the one with
       the most successes (ties: the lower model index, i.e. config order);
    2. balancing per pair {r, s}: m = min(|C_{s->r}|, |C_{r->s}|) over the candidates assigned to
       that pair, and each direction keeps its top m by k_s plus boundary ties (as for K = 2).
    With K = 2 this is exactly ``balanced_selection``.
    """
    num_models, num_prompts = successes.shape
    mixed = (successes >= 1) & (successes < n)  # [K, P] usable as a source
    assigned = torch.full((num_models, num_prompts), -1, dtype=torch.long)
    for receiver in range(num_models):
        score = torch.where(mixed, successes, torch.full_like(successes, -1))  # [K, P]
        score[receiver] = -1
        best = score.max(dim=0)  # first index wins ties
        take = (successes[receiver] == 0) & (best.values >= 1)
        assigned[receiver] = torch.where(take, best.indices, assigned[receiver])
    if not balance:
        return assigned
    selected = torch.full_like(assigned, -1)
    for r in range(num_models):
        for s in range(r + 1, num_models):
            s_to_r, r_to_s = assigned[r] == s, assigned[s] == r
            m = min(int(s_to_r.sum()), int(r_to_s.sum()))
            keep_r = select_with_ties(s_to_r, successes[s], m)
            keep_s = select_with_ties(r_to_s, successes[r], m)
            selected[r] = torch.where(keep_r, s, selected[r])
            selected[s] = torch.where(keep_s, r, selected[s])
    return selected
