"""``generate`` with n samples per prompt, the prompts' forward pass done once per prompt.

``generate(num_return_sequences=n)`` repeats every prompt n times before its first forward pass, so
the prefill computes each prompt's keys and values n times. Here the prompts go through the model
once, their cache and last-position logits are repeated n times, and the first token is sampled as
``generate`` samples it (the logits processor, softmax, one multinomial draw over all P*n rows);
``generate`` then continues from that cache. Every later forward pass, random draw and stop decision
is ``generate``'s own, so where a row's arithmetic does not depend on how many rows share the batch
(CPU fp32 kernels: ``tests/test_rollout_cache.py``), the sequences, the logits processor's inputs and
the random stream afterwards are those of ``generate`` bit for bit. Elsewhere (GPU kernels chosen by
batch size) the last bits may differ, as between any two batch sizes.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import Tensor
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

#: A CPU matrix product of few rows takes other kernels than one of many (a matrix-vector path, or
#: rows split unevenly across threads), whose sums round differently: fp32 ``linear`` rows equal
#: those of a 4,096-row product from 4 rows up at 1 and 4 threads, from 12 at 2 and 8 threads
#: (benchmarks/README.md, "HF sampler: each prompt's forward pass once"). The shared prefill's
#: last-position logits are a P-row product where ``generate``'s is P*n rows, so calls of fewer
#: prompts than this keep ``generate``'s own prefill and its samples.
SHARE_FROM_PROMPTS = 16


def sharing_pays(prompts: int, n: int) -> bool:
    """Whether a call of ``prompts`` prompts x ``n`` samples shares its prompts' forward pass."""
    return n > 1 and prompts >= SHARE_FROM_PROMPTS


class _FinishedAtFirstToken(StoppingCriteria):
    """Tells ``generate`` which rows already ended with the EOS sampled before it started."""

    def __init__(self, finished: Tensor) -> None:
        self.finished = finished  # [P*n] bool

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> Tensor:
        return self.finished


def _accepts(model: PreTrainedModel, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def generate_sharing_prompts(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    config: GenerationConfig,
    processor: LogitsProcessor,
    cache: Any,
    cache_key: str,
) -> Tensor:
    """[P*n, width + steps] sequences of ``generate(input_ids, attention_mask, config, [processor])``.

    input_ids, attention_mask: [P, width] left-padded prompts; n = ``config.num_return_sequences``;
    row p*n + i is prompt p's i-th sample (``generate``'s order). ``config`` samples with no
    processor of its own (temperature 1, top-k 0, top-p 1: ``processor`` does the rest); ``cache``
    is an empty ``DynamicCache`` that ``model`` takes as ``cache_key``.
    """
    if config.temperature != 1.0 or config.top_k not in (0, None) or config.top_p != 1.0:
        raise ValueError("generate_sharing_prompts: the logits processor must do temperature and top-p")
    n = config.num_return_sequences or 1
    prompt_inputs: dict[str, Any] = {cache_key: cache, "use_cache": True}
    if _accepts(model, "position_ids"):  # generate's positions: left padding skipped
        prompt_inputs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).masked_fill(
            attention_mask == 0, 0
        )
    if _accepts(model, "logits_to_keep"):
        prompt_inputs["logits_to_keep"] = 1
    # generate drops an all-ones mask (no padding anywhere), and so must this forward pass
    mask = None if bool((attention_mask == 1).all()) else attention_mask
    output = model(input_ids=input_ids, attention_mask=mask, **prompt_inputs)
    logits = output.logits[:, -1].to(copy=True, dtype=torch.float32).repeat_interleave(n, dim=0)  # [P*n, V]
    del output
    cache.batch_repeat_interleave(n)

    rows = input_ids.repeat_interleave(n, dim=0)  # [P*n, width]
    scores = LogitsProcessorList([processor])(rows, logits)
    first = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)  # [P*n, 1]: generate's draw
    sequences = torch.cat([rows, first], dim=-1)
    eos = torch.as_tensor(config.eos_token_id if config.eos_token_id is not None else [], dtype=first.dtype)
    finished = torch.isin(first[:, 0], eos.to(first.device))  # [P*n]
    if config.max_new_tokens <= 1 or bool(finished.all()):
        return sequences

    rest = copy.deepcopy(config)
    rest.num_return_sequences = 1
    rest.max_new_tokens = config.max_new_tokens - 1
    sequences = model.generate(
        input_ids=sequences,
        attention_mask=torch.cat(
            [attention_mask.repeat_interleave(n, dim=0), torch.ones_like(first)], dim=-1
        ),
        generation_config=rest,
        logits_processor=LogitsProcessorList([processor]),
        stopping_criteria=StoppingCriteriaList([_FinishedAtFirstToken(finished)]),
        **{cache_key: cache},
    )
    # generate pads a row after its EOS; the rows that ended at the first token drew one more
    if config.pad_token_id is not None:
        sequences[finished, input_ids.shape[1] + 1 :] = config.pad_token_id
    return sequences


__all__ = ["SHARE_FROM_PROMPTS", "generate_sharing_prompts", "sharing_pays"]
