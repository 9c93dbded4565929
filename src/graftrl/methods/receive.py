"""The receiver's side of a transfer: how likely each transferred response is under both models,
and the weight it trains with (algorithm.md §2.2).

One path for every receiver: `graftrl train` (``training.rows.build_rows``) and the TRL integration
(``integrations.trl.exchange.graft_exchange``) both score the re-tokenized responses with the
receiver's old policy (their own model code), then call these functions for the rest: the
method's gate (``scores_peer_rows``, ``Method.scores_peers``), the likelihoods of both sides
(``peer_likelihoods``), the score s and the weight w (``weigh_peers``) and their metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from graftrl.core import content_mean_logprob, weight_summary
from graftrl.methods.base import Method, PeerLikelihoods


class SourceResponse(Protocol):
    """What a transferred response's record says of its source (``storage.records.TrajectoryRecord``)."""

    @property
    def finished(self) -> bool:
        """The response ended with EOS."""
        ...

    @property
    def mean_logprob(self) -> float:
        """lbar of the source's behaviour policy on its own tokenization, EOS excluded."""
        ...

    @property
    def num_tokens(self) -> int:
        """Source content tokens, EOS excluded."""
        ...

    @property
    def num_bytes(self) -> int:
        """UTF-8 bytes of the response string."""
        ...


def scores_peer_rows(method: Method) -> bool:
    """The receiver runs its no-grad pass over transferred responses: its loss reads their old
    log-probs (eq. 9) or it scores their compatibility (eq. 7). Otherwise they are never scored
    and each enters with w = 1."""
    return method.needs_peer_old_logprobs or method.scores_peers


def peer_likelihoods(
    receiver_logprobs: Sequence[Tensor], sources: Sequence[SourceResponse]
) -> PeerLikelihoods:
    """Both sides' likelihoods of R transferred responses, each on its own tokenization with a
    terminal EOS excluded. receiver_logprobs: R tensors [L_r], the receiver's old per-token
    log-probs of its re-tokenization (EOS included when the response finished)."""
    pairs = list(zip(receiver_logprobs, sources, strict=True))
    return PeerLikelihoods(
        receiver_mean_logp=torch.tensor([content_mean_logprob(lp, src.finished) for lp, src in pairs]),
        receiver_tokens=torch.tensor([len(lp) - int(src.finished) for lp, src in pairs]),
        source_mean_logp=torch.tensor([src.mean_logprob for src in sources]),
        source_tokens=torch.tensor([src.num_tokens for src in sources]),
        num_bytes=torch.tensor([max(src.num_bytes, 1) for src in sources]),
    )


@dataclass(frozen=True)
class PeerWeights:
    """One receiver's transferred responses at a step: their scores and weights."""

    s: Tensor | None
    """[R] compatibility score of each (eq. 7); None when the method does not score peers."""
    w: Tensor
    """[R] its weight (eq. 8, or the method's rule; 1 when it is not scored)."""

    def metrics(self) -> dict[str, float]:
        """The exchange metrics (``core.weight_summary``); R > 0."""
        return weight_summary(self.s, self.w)


def weigh_peers(
    method: Method,
    receiver_logprobs: Sequence[Tensor] | None,
    sources: Sequence[SourceResponse],
    generator: torch.Generator,
) -> PeerWeights:
    """s and w of R transferred responses (``sources``, R > 0) under ``method``.

    receiver_logprobs: the receiver's old per-token log-probs of each (``peer_likelihoods``);
    None when ``scores_peer_rows(method)`` is False. A method that does not score peers gives
    w = 1 and no s; ``generator`` serves a random weight rule (GRAFT's random admission)."""
    if not method.scores_peers:
        return PeerWeights(None, torch.ones(len(sources)))
    if receiver_logprobs is None:
        raise ValueError(f"method {method.name!r} scores peers: pass the receiver's log-probs")
    s = method.compatibility(peer_likelihoods(receiver_logprobs, sources))
    return PeerWeights(s, method.peer_weights(s, generator))
