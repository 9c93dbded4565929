"""Order of groups across optimizer steps (peer-last updates, algorithm.md §2.2)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

PeerPosition = Literal["last", "first", "uniform"]


def minibatch_order(
    is_peer: Tensor,
    groups_per_minibatch: int,
    position: PeerPosition = "last",
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Group indices for each optimizer step, in order.

    is_peer: BoolTensor [P] — group p is a grafted peer group. Returns a list of LongTensors.
    "last": own groups first, then peer groups, chunked into minibatches, so every minibatch that
    holds a peer group comes after all purely-own ones. "first": the mirror (peer groups first).
    "uniform": the own-first chunks in a random minibatch order (drawn from ``generator``).
    """
    if groups_per_minibatch < 1:
        raise ValueError(f"groups_per_minibatch must be >= 1, got {groups_per_minibatch}")
    if position not in ("last", "first", "uniform"):
        raise ValueError(f"peer position must be 'last', 'first' or 'uniform', got {position!r}")
    if is_peer.numel() == 0:
        return []
    indices = torch.arange(is_peer.numel())
    own, peer = indices[~is_peer], indices[is_peer]
    ordered = torch.cat([peer, own]) if position == "first" else torch.cat([own, peer])
    chunks = list(torch.split(ordered, groups_per_minibatch))
    if position == "uniform":
        permutation = torch.randperm(len(chunks), generator=generator)
        chunks = [chunks[i] for i in permutation.tolist()]
    return chunks
