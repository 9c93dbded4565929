"""Sampling with a static KV cache and a compiled decode step: the HF engine's ``rollout.compile``.

HF ``generate`` decodes in eager PyTorch: every new token launches each layer's kernels from Python,
and on a GPU that launching, not the arithmetic, sets the pace (50-80 ms per token for a 0.5B model
whatever the batch on the first H200 lent to this project: benchmarks/README.md, GPU check
results). Here a call (``sample_compiled``) runs:

1. the prefill, eager: the prompts' forward pass, once per prompt when its n samples share it (as
   ``models.shared_prefill`` does for ``generate``), else once per row. Its keys and values are
   copied, repeated n times, into a static cache (``StaticDecodeLayer``: per layer, buffers of
   [rows, KV heads, length, head dim] allocated once for the call);
2. the first token, sampled from the prompts' last logits;
3. the decode: the model's forward pass for one token per row over the static cache, compiled with
   ``torch.compile`` (inductor). On CUDA the second step is captured in a CUDA graph and every later
   step replays it: one launch per token instead of hundreds from Python. Graph and cache are freed
   when the call returns; kept, they would hold gigabytes through the update.

Sampling stays eager, outside the graph: ``models.behaviour`` then ``torch.multinomial``, as
``generate`` with the eager engine's recorder does, so the samples follow the eager sampler's
distribution and the recorded log-probs are log softmax(logits / T) of the sampled ids, to float
rounding (compiled kernels sum in another order; tests/test_compiled_decode.py).

Bounded shapes, bounded compiles: rows are padded to a multiple of ``ROW_MULTIPLE`` (padding rows
decode copies of the last row and are dropped) and the cache length (prompt width + max new
tokens) is rounded up to a multiple of ``CACHE_MULTIPLE``. The step compiles once per cache length
and model object; a second row count recompiles it once with the row dimension symbolic (torch's
automatic dynamic shapes), and later row counts reuse that. Compile time is timed apart from the
steps (``DecodeTiming.compile_s``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel

from graftrl.errors import UserError
from graftrl.models.behaviour import behaviour_distribution
from graftrl.models.kv_cache import cache_argument, dynamic_cache

try:  # transformers >= 4.56 (the layered cache)
    from transformers.cache_utils import StaticCache, StaticLayer
except ImportError:  # pragma: no cover - older transformers: no compiled path
    StaticCache = StaticLayer = None  # type: ignore[assignment,misc]

CompileSetting = Literal["auto"] | bool
"""``rollout.compile``: "auto" (on CUDA, where the model supports it), True, False."""

ROW_MULTIPLE = 8
"""Rows are padded to a multiple of this (one compiled shape for nearby row counts)."""
CACHE_MULTIPLE = 256
"""The static cache length, prompt width + max new tokens, is rounded up to a multiple of this:
each distinct length is a compile of its own (attention reads the whole static cache, masked)."""
SYNC_EVERY = 16
"""Decode steps between checks that every row has finished: a check waits for the device."""
RECOMPILE_LIMIT = 64
"""torch's default (8 graphs per compiled function, then silently eager) is shared by every model
and cache length of a process; calls raise it to this while they run."""


def padded_rows(rows: int) -> int:
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def cache_length(prompt_width: int, max_new_tokens: int) -> int:
    return -(-(prompt_width + max_new_tokens) // CACHE_MULTIPLE) * CACHE_MULTIPLE


class StaticDecodeLayer(StaticLayer if StaticLayer is not None else object):  # type: ignore[misc]
    """transformers' ``StaticLayer`` with the keys and the values each in its own dtype.

    Under bf16 autocast with float32 weights (a policy's default on GPUs) the keys come out float32
    (the rotary embedding runs in the hidden states' dtype) and the values bfloat16; transformers
    before 5.2x allocates both in the keys' dtype and then fails to copy the values in.
    ``static_addresses``: tag the buffers as fixed addresses for torch.compile's own CUDA graphs
    (``mode="reduce-overhead"``); this module captures its graphs itself and needs no tag.
    """

    def __init__(self, max_cache_len: int, static_addresses: bool = False) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.static_addresses = static_addresses

    def lazy_initialization(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        # zeros, not empty: a masked slot still enters attention as 0 x value, and 0 x NaN is NaN
        self.keys = key_states.new_zeros((*key_states.shape[:2], self.max_cache_len, self.k_head_dim))
        self.values = value_states.new_zeros((*value_states.shape[:2], self.max_cache_len, self.v_head_dim))
        self.cumulative_length = self.cumulative_length.to(self.device)
        if self.static_addresses:
            for tensor in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True


def static_cache(model: PreTrainedModel, capacity: int, static_addresses: bool = False) -> Any | None:
    """A ``StaticCache`` of ``capacity`` positions whose layers are ``StaticDecodeLayer``s, or None
    when the model's static cache is not made of full-attention ``StaticLayer``s (sliding-window
    or linear-attention layers)."""
    if StaticCache is None:
        return None
    try:
        cache = StaticCache(config=model.config, max_cache_len=capacity)
    except (TypeError, ValueError, AttributeError, KeyError):
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return None
    cache.layers = [StaticDecodeLayer(capacity, static_addresses) for _ in layers]
    return cache


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the compiled path cannot sample from ``model`` (None: it can)."""
    from torch.distributed.fsdp import FSDPModule

    name = type(model).__name__
    if isinstance(model, FSDPModule):
        return f"{name} is sharded (FSDP, parallel.data > 1)"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{name} does not declare torch.compile support"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{name}'s forward takes no logits_to_keep"
    if dynamic_cache(model) is None or static_cache(model, CACHE_MULTIPLE) is None:
        return f"{name}'s KV cache is not all full-attention layers"
    return None


def compile_applies(setting: CompileSetting, model: PreTrainedModel) -> bool:
    """Whether a call samples through this module: ``auto`` on CUDA where the model supports it,
    True wherever it does (else a ``UserError``), False never."""
    if setting is False or (setting == "auto" and model.device.type != "cuda"):
        return False
    reason = unsupported_reason(model)
    if setting == "auto":
        return reason is None
    if reason is not None:
        raise UserError(f"rollout.compile: true, but {reason}; set rollout.compile: auto or false")
    return True


@dataclass(frozen=True)
class DecodeTiming:
    """Where one ``sample_compiled`` call's time went (seconds, the device synchronized)."""

    rows: int
    padded_rows: int
    cache_length: int
    steps: int
    """Tokens sampled per row (the first one from the prefill's logits included)."""
    prefill_s: float
    """Prefill, cache set-up and the first token."""
    compile_s: float
    """Compiling the decode step (0 when this shape was compiled before): not part of the steps."""
    capture_s: float
    """Capturing the CUDA graph (part of ``decode_s``)."""
    decode_s: float
    """Every decode step after the first token, compile time excluded."""
    graph: bool
    """The steps replayed a CUDA graph."""


def _forward(
    model: PreTrainedModel, input_ids: Tensor, position_ids: Tensor, mask: Tensor, cache: Any, key: str
):
    """[B, V] next-token logits of one new token per row (what is compiled)."""
    output = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
        **{key: cache},
    )  # fmt: skip
    return output.logits[:, -1]


@functools.cache
def _compiled_forward() -> Callable[..., Tensor]:
    """``_forward`` compiled (on first use: importing torch's compiler takes seconds). One function
    for every model: dynamo keys its graphs by the model object and the shapes."""
    return torch.compile(_forward, fullgraph=True)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def _recompile_limit() -> Iterator[None]:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: max(getattr(config, name), RECOMPILE_LIMIT)}):
        yield


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _sample(logits: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """[B] tokens drawn as ``generate`` draws them (softmax of the truncated scores, one multinomial
    draw per row) and [B] their behaviour log-probs."""
    logprobs, truncated = behaviour_distribution(logits, temperature, top_p)
    tokens = torch.multinomial(torch.softmax(truncated, dim=-1), num_samples=1)  # [B, 1]
    return tokens.squeeze(-1), logprobs.gather(-1, tokens).squeeze(-1)


def _capture(step: Callable[[], Tensor]) -> Callable[[], Tensor] | None:
    """``step`` as a CUDA graph replay, or None (with a warning) when it cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            logits = step()
    except Exception as error:  # a capture-unsafe op somewhere in the step: decode without the graph
        warnings.warn(f"compiled decode: no CUDA graph ({error}); decoding without one", stacklevel=3)
        return None

    def replay() -> Tensor:
        graph.replay()
        return logits

    return replay


@torch.no_grad()
def sample_compiled(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    n: int,
    share_prompts: bool,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
) -> tuple[Tensor, Tensor, DecodeTiming]:
    """n samples per prompt: [P*n, steps] ids and [P*n, steps] float32 behaviour log-probs.

    input_ids, attention_mask: [P, W] left-padded prompts; row p*n + i is prompt p's i-th sample.
    A row's ids after its first EOS are filler (the caller cuts there); steps < max_new_tokens
    when every row finished early. Runs under the caller's autocast.
    """
    device = input_ids.device
    clock = _Clock(device)
    start = clock()
    prompts, width = input_ids.shape
    rows, share = prompts * n, share_prompts and n > 1
    if not share:
        input_ids, attention_mask = input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
    padded, length = padded_rows(rows), cache_length(width, max_new_tokens)
    source = torch.arange(padded, device=device).clamp(max=rows - 1) // (n if share else 1)  # [padded]
    key = cache_argument(model)

    # Prefill (eager, generate's positions: left padding skipped), then the static cache.
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    prefill_cache = dynamic_cache(model)
    output = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
        logits_to_keep=1, **{key: prefill_cache},
    )  # fmt: skip
    logits = output.logits[:, -1][source]  # [padded, V]
    del output
    cache = static_cache(model, length)
    for layer, prefilled in zip(cache.layers, prefill_cache.layers, strict=True):
        layer.update(prefilled.keys[source], prefilled.values[source])
    del prefill_cache
    # Constant for the whole call: the causal mask (from the cache's own position) hides the slots
    # not written yet.
    mask = torch.cat(
        [attention_mask[source].bool(), torch.ones(padded, length - width, dtype=torch.bool, device=device)],
        -1,
    )
    ids = torch.full((padded, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(padded, max_new_tokens, dtype=torch.float32, device=device)
    finished = torch.arange(padded, device=device) >= rows  # padding rows never hold the loop
    tokens, token_logprobs = _sample(logits, temperature, top_p)
    ids[:, 0], logprobs[:, 0] = tokens, token_logprobs
    finished |= tokens == eos_token_id
    # The step's inputs, updated in place (the graph reads them at fixed addresses).
    step_ids = tokens[:, None].clone()  # [padded, 1]
    step_positions = attention_mask[source].long().sum(-1, keepdim=True)  # [padded, 1]
    prefilled = clock()

    forward = _compiled_forward()

    def step() -> Tensor:
        return forward(model, step_ids, step_positions, mask, cache, key)

    compile_s = capture_s = 0.0
    replay: Callable[[], Tensor] | None = None
    captured = device.type != "cuda"  # on CPU there is nothing to capture
    steps = 1
    with _recompile_limit():
        for position in range(1, max_new_tokens):
            if position % SYNC_EVERY == 0 and bool(finished.all()):
                break
            if replay is not None:
                logits = replay()
            else:
                graphs, before = _compiled_graphs(), clock()
                logits = step()
                if _compiled_graphs() != graphs:
                    compile_s += clock() - before
                if not captured:  # after a step that ran (compiled, warmed up)
                    captured, before = True, clock()
                    replay = _capture(step)
                    capture_s = clock() - before
            tokens, token_logprobs = _sample(logits, temperature, top_p)
            ids[:, position], logprobs[:, position] = tokens, token_logprobs
            finished |= tokens == eos_token_id
            step_ids.copy_(tokens[:, None])
            step_positions.add_(1)
            steps = position + 1
    end = clock()
    timing = DecodeTiming(
        rows=rows,
        padded_rows=padded,
        cache_length=length,
        steps=steps,
        prefill_s=prefilled - start,
        compile_s=compile_s,
        capture_s=capture_s,
        decode_s=end - prefilled - compile_s,
        graph=replay is not None,
    )
    return ids[:rows, :steps], logprobs[:rows, :steps], timing


__all__ = [
    "CACHE_MULTIPLE",
    "ROW_MULTIPLE",
    "CompileSetting",
    "DecodeTiming",
    "StaticDecodeLayer",
    "cache_length",
    "compile_applies",
    "padded_rows",
    "sample_compiled",
    "static_cache",
    "unsupported_reason",
]
