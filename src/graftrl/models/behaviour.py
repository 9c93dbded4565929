"""The behaviour distribution the HF samplers draw from and record: log softmax(logits / T), then
nucleus truncation for the draw.

One function for the eager sampler (``generate`` with ``rollout._BehaviourLogprobRecorder``) and the
compiled one (``models.compiled_decode``), so the two draw from the same distribution and record the
same log-probs: the ones training recomputes (before truncation, as vLLM and verl report them).
"""

from __future__ import annotations

import torch
from torch import Tensor


def behaviour_distribution(scores: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """(log-probs, truncated log-probs), both [B, V] float32, of the next token.

    scores: [B, V] logits. The log-probs are log softmax(scores / T); the truncated ones are -inf
    outside the nucleus, the smallest set of most likely tokens whose mass reaches ``top_p`` (the
    top token always kept); sampling softmaxes them.
    """
    scores = scores.float()
    if temperature != 1.0:  # a full-vocabulary pass that would change nothing
        scores = scores / temperature
    logprobs = torch.log_softmax(scores, dim=-1)
    if top_p >= 1.0:
        return logprobs, logprobs
    sorted_logprobs, order = torch.sort(logprobs, descending=True, dim=-1)
    cumulative = sorted_logprobs.exp().cumsum(dim=-1)
    # Drop a token when the mass before it already reaches top_p (always keep the top one).
    drop_sorted = (cumulative - sorted_logprobs.exp()) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logprobs, logprobs.masked_fill(drop, float("-inf"))


__all__ = ["behaviour_distribution"]
