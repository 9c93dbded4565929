"""Per-token log-probs from hidden states, a chunk of sequence positions at a time.

The full computation log_softmax(h W^T / T) materialises [B, L, V] float32 logits: 8 rows of
4,096 tokens on a 151,936-token vocabulary are ~20 GB. Applying the LM head per chunk of C
positions, each chunk under activation checkpointing, bounds that to [B, C, V]: autograd keeps
only the chunk's inputs (views of the hidden states) and recomputes its logits in backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def token_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float = 1.0
) -> Tensor:
    """log softmax(h W^T + b) / T at the target ids, in float32.

    hidden: [B, C, H]; weight: [V, H]; bias: [V] or None; targets: [B, C] token ids.
    Returns [B, C]. The projection runs in the ambient (autocast) dtype, the softmax in float32.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias).float()  # [B, C, V]
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, C, V]
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, C]


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> Tensor:
    """``token_logprobs`` over chunks of ``chunk_tokens`` sequence positions; the same values.

    hidden: [B, L, H] (the hidden state predicting each target); weight: [V, H]; bias: [V] or
    None; targets: [B, L]. Returns [B, L] float32. Peak memory O(B * chunk_tokens * V), forward
    and backward: with grad, each chunk is checkpointed, so its logits are freed after the
    forward and recomputed (one chunk at a time) in the backward pass.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    length = hidden.shape[1]
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    parts = []
    for start in range(0, length, chunk_tokens):
        stop = min(start + chunk_tokens, length)
        args = (hidden[:, start:stop], weight, bias, targets[:, start:stop], temperature)
        if needs_grad:
            parts.append(checkpoint(token_logprobs, *args, use_reentrant=False))
        else:
            parts.append(token_logprobs(*args))
    if not parts:  # an empty response width
        return hidden.new_zeros(hidden.shape[:2], dtype=torch.float32)
    return torch.cat(parts, dim=1)  # [B, L]
