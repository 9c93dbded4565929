"""Rollout engines: sample n responses per prompt with behaviour log-probs.

The HF engine drives ``model.generate`` (batched; each prompt's forward pass done once for its n
samples: ``models.shared_prefill``; the KV cache preallocated where that pays: ``models.kv_cache``),
or on CUDA its own loop with a static cache and a compiled decode step (``models.compiled_decode``).
Behaviour log-probs are read by a
logits processor that keeps one step of log-softmax at a time, so memory stays O(batch x vocab)
instead of O(batch x length x vocab) — the difference between 1 MB and 100s of GB for a real
vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from graftrl.core import content_mean_logprob
from graftrl.models.behaviour import behaviour_distribution
from graftrl.models.compiled_decode import CompileSetting, DecodeTiming, compile_applies, sample_compiled
from graftrl.models.kv_cache import cache_argument, dynamic_cache, preallocated_cache
from graftrl.models.policy import Policy
from graftrl.models.shared_prefill import generate_sharing_prompts, sharing_pays


@dataclass(frozen=True)
class SamplingParams:
    n: int = 8
    """Responses per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4096


@dataclass
class RolloutBatch:
    """A policy's samples for P prompts x n responses, prompt-major (row = p * n + i)."""

    prompt_ids: list[list[int]]
    """[P] the policy's own prompt ids."""
    response_ids: list[list[int]]
    """[P*n] sampled ids, terminal EOS included when the response finished."""
    behaviour_logprobs: list[Tensor]
    """[P*n] per-token log-probs of ``response_ids`` under the behaviour policy (logits / T)."""
    finished: list[bool]
    """[P*n] the response ended with EOS."""
    texts: list[str]
    """[P*n] decoded response text, special tokens removed."""
    n: int

    def content_mean_logprob(self, row: int) -> float:
        """Mean behaviour log-prob over the response's own tokens, terminal EOS excluded."""
        return content_mean_logprob(self.behaviour_logprobs[row], self.finished[row])

    def content_length(self, row: int) -> int:
        return len(self.response_ids[row]) - int(self.finished[row])


_DROPPED_MASK_WARNING = "We strongly recommend passing in an `attention_mask`"


class _DroppedMaskWarningFilter(logging.Filter):
    """Drops transformers' missing-attention-mask warning, and only it.

    ``generate`` discards an all-ones attention mask (a batch without padding) to go faster; once a
    row has finished, its next input is the pad token, and GPT-2's forward, now without a mask,
    warns that the input "may be padded". We did pass the mask, and a finished row's pad tokens are
    cut at its EOS, so in this call the warning is a false alarm.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_DROPPED_MASK_WARNING)


@contextlib.contextmanager
def dropped_mask_warning_silenced() -> Iterator[None]:
    """Within the block, transformers' modeling logger omits the dropped-mask false alarm."""
    logger = logging.getLogger("transformers.modeling_utils")
    quiet = _DroppedMaskWarningFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _BehaviourLogprobRecorder(LogitsProcessor):
    """Applies temperature and nucleus filtering itself and records each sampled token's log-prob.

    At generation step t the processor sees the token sampled at step t - 1 as the last input id,
    so it gathers that token's log-prob from the distribution it kept from the previous call.
    The recorded log-prob is log softmax(logits / T) — the distribution training recomputes —
    before nucleus truncation (as vLLM and verl report it).
    """

    def __init__(self, temperature: float, top_p: float) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.previous: Tensor | None = None
        self.steps: list[Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous, truncated = behaviour_distribution(scores, self.temperature, self.top_p)
        return truncated

    def finish(self, last_tokens: Tensor) -> Tensor:
        """[B, steps] log-probs, after the final sampled tokens are known."""
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(last_tokens.shape[0], 0)


@contextlib.contextmanager
def checkpoint_sampling_defaults_off(model: PreTrainedModel) -> Iterator[None]:
    """``generate`` fills every field that the engine's ``GenerationConfig`` leaves unset from the
    checkpoint's ``generation_config.json``: a repetition penalty, n-gram blocking or a minimum
    length (Qwen2.5-Instruct ships ``repetition_penalty``) would then reshape the distribution
    before the recorder logs it, and the behaviour log-probs would not be the logits / T that
    training recomputes. Sampling is set by ``rollout.*`` alone, as the vLLM engine's
    ``generation_config="vllm"`` does."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


#: The preallocated KV cache saves ``DynamicLayer``'s whole-cache copy per step, but attention then
#: reads keys and values through a strided view, and the buffers are fresh memory each call: on
#: short responses that costs more than it saves. Measured side by side (benchmarks/README.md,
#: "HF sampler"): 7-12% slower at 26 tokens per row on two CPUs; at 70, 15% faster with AVX2
#: kernels but 2-5% slower with AVX-512 ones. The samples are the same either way.
PREALLOCATE_FROM_TOKENS = 64


def preallocation_pays(max_new_tokens: int, device: torch.device) -> bool:
    """The HF engine's default: preallocate the KV cache for calls of ``PREALLOCATE_FROM_TOKENS``
    new tokens or more, except on a CPU whose torch kernels are AVX-512 ones."""
    if max_new_tokens < PREALLOCATE_FROM_TOKENS:
        return False
    return device.type != "cpu" or not torch.backends.cpu.get_cpu_capability().startswith("AVX512")


ChunkResults = dict[int, tuple[list[list[int]], list[Tensor], list[bool]]]
"""Generate-call chunk index -> (response ids, behaviour log-probs, finished) of its rows."""


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of generate-call chunk ``chunk`` (chunk 0: ``seed`` itself)."""
    return seed if chunk == 0 else (seed * 1_000_003 + chunk * 15_485_863) % (2**63 - 1)


class RolloutEngine(Protocol):
    """What training, validation and evaluation need of a sampler: one engine per policy
    (``rollout.engine``)."""

    max_batch_size: int
    """Rows (prompt x sample) per generate call; evaluation samples a benchmark in chunks of this
    many rows and verifies each chunk as soon as it is generated."""

    def generate(
        self, policy: Policy, problems: Sequence[str], params: SamplingParams, seed: int | None = None
    ) -> RolloutBatch:
        """n samples per problem on the policy's own prompt template, with behaviour log-probs.

        The same (weights, problems, params, seed) give the same samples."""
        ...

    def reseed(self, seed: int) -> None:
        """Restart the random stream that unseeded ``generate`` calls draw from: the same seed, then
        the same sequence of unseeded calls, give the same samples (evaluation's seeded runs)."""
        ...

    def sync_weights(self, policy: Policy) -> None:
        """Take the trainer's current weights (after every optimizer update of the policy)."""
        ...

    def close(self) -> None:
        """Free the engine's resources."""
        ...


class HFRolloutEngine:
    """Sampling with Hugging Face ``generate``; batched over prompts, KV cache on.

    It samples from the trainer's own model object, so ``sync_weights`` has nothing to do.
    """

    def __init__(
        self,
        max_batch_size: int = 512,
        preallocate_cache: bool | None = None,
        share_prompts: bool = True,
        compile: CompileSetting = "auto",
    ) -> None:
        self.max_batch_size = max_batch_size
        """Rows (prompt x sample) generated per ``generate`` call."""
        self.preallocate_cache = preallocate_cache
        """Give ``generate`` a KV cache allocated once per call (``models.kv_cache``): the same
        samples, without a full cache copy per step. False: ``generate``'s own DynamicCache.
        None (default): where it pays (``preallocation_pays``)."""
        self.share_prompts = share_prompts
        """Run each prompt's forward pass once for its n samples where that pays
        (``models.shared_prefill.sharing_pays``; the same samples on CPU). False: ``generate``
        repeats every prompt n times first."""
        self.compile = compile
        """``rollout.compile``: sample with a static KV cache and a compiled, CUDA-graph-replayed decode
        step (``models.compiled_decode``) instead of ``generate``: "auto" on CUDA where the model
        supports it, True wherever it does, False never."""
        self.timings: list[DecodeTiming] = []
        """Per compiled chunk of the last ``generate`` call: prefill, compile and decode seconds."""
        self.compile_seconds = 0.0
        """Seconds this engine spent compiling decode steps (kept out of ``timings``' decode_s)."""

    def _preallocates(self, params: SamplingParams, device: torch.device) -> bool:
        if self.preallocate_cache is not None:
            return self.preallocate_cache
        return preallocation_pays(params.max_new_tokens, device)

    def reseed(self, seed: int) -> None:
        """Unseeded calls sample from torch's global generator: seed it."""
        torch.manual_seed(seed)

    def sync_weights(self, policy: Policy) -> None:
        return None

    def close(self) -> None:
        return None

    @torch.no_grad()
    def generate(
        self,
        policy: Policy,
        problems: Sequence[str],
        params: SamplingParams,
        seed: int | None = None,
        *,
        rank: int = 0,
        world: int = 1,
        gather: Callable[[ChunkResults], ChunkResults] | None = None,
    ) -> RolloutBatch:
        """Chunks of ``max_batch_size // n`` prompts, chunk k seeded by ``chunk_seed(seed, k)``.

        Data-parallel ranks (``rank`` of ``world``) sample chunks k = rank, rank + world, ... and
        ``gather`` merges every rank's chunks: the samples do not depend on the number of ranks.
        """
        prompt_ids = policy.encode_prompts(problems)
        prompts_per_call = max(1, self.max_batch_size // params.n)
        chunks: ChunkResults = {}
        self.timings = []
        with policy.eval_mode():
            for k, start in enumerate(range(0, len(prompt_ids), prompts_per_call)):
                if k % world != rank:
                    continue
                if seed is not None:
                    torch.manual_seed(chunk_seed(seed, k))
                chunks[k] = self._generate_chunk(policy, prompt_ids[start : start + prompts_per_call], params)
        if gather is not None:
            chunks = gather(chunks)
        response_ids: list[list[int]] = []
        logprobs: list[Tensor] = []
        finished: list[bool] = []
        for k in sorted(chunks):
            ids, lps, done = chunks[k]
            response_ids += ids
            logprobs += lps
            finished += done
        texts = policy.decode_responses(
            [ids[:-1] if done else ids for ids, done in zip(response_ids, finished, strict=True)]
        )
        return RolloutBatch(prompt_ids, response_ids, logprobs, finished, texts, params.n)

    def _generate_chunk(
        self, policy: Policy, prompt_ids: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[int]], list[Tensor], list[bool]]:
        batch = policy.pad(prompt_ids, [[] for _ in prompt_ids])
        width = batch.prompt_width
        eos = policy.eos_token_id
        prompts = {"input_ids": batch.input_ids[:, :width], "attention_mask": batch.attention_mask[:, :width]}
        if compile_applies(self.compile, policy.model):
            with policy.autocast():
                generated, step_logprobs, timing = sample_compiled(
                    policy.model,
                    **prompts,
                    n=params.n,
                    share_prompts=self.share_prompts,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    max_new_tokens=params.max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=int(policy.tokenizer.pad_token_id),
                )
            self.timings.append(timing)
            self.compile_seconds += timing.compile_s
            return _cut_at_eos(generated, step_logprobs.cpu(), eos)
        recorder = _BehaviourLogprobRecorder(params.temperature, params.top_p)
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,  # the recorder applies temperature and top-p itself
            top_k=0,
            top_p=1.0,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n,
            eos_token_id=eos,
            pad_token_id=int(policy.tokenizer.pad_token_id),
            return_dict_in_generate=False,
        )
        model = policy.model
        cache = (
            preallocated_cache(model, width + params.max_new_tokens)
            if self._preallocates(params, model.device)
            else None
        )
        share = self.share_prompts and sharing_pays(len(prompt_ids), params.n)
        if cache is None and share:
            cache = dynamic_cache(model)
        with policy.autocast(), dropped_mask_warning_silenced(), checkpoint_sampling_defaults_off(model):
            if cache is not None and share:
                sequences = generate_sharing_prompts(
                    model,
                    **prompts,
                    config=config,
                    processor=recorder,
                    cache=cache,
                    cache_key=cache_argument(model),
                )
            else:
                extra = {} if cache is None else {cache_argument(model): cache}
                sequences = model.generate(
                    **prompts,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([recorder]),
                    **extra,
                )
        generated = sequences[:, width:]  # [P*n, steps]
        return _cut_at_eos(generated, recorder.finish(generated[:, -1]).cpu(), eos)


def _cut_at_eos(
    generated: Tensor, step_logprobs: Tensor, eos: int
) -> tuple[list[list[int]], list[Tensor], list[bool]]:
    """Each row's ids and log-probs up to its first EOS (included), and whether it has one.

    generated, step_logprobs: [rows, steps]; what follows a row's EOS is padding or filler."""
    out_ids, out_logprobs, out_finished = [], [], []
    for row, tokens in enumerate(generated.tolist()):
        done = eos in tokens
        length = tokens.index(eos) + 1 if done else len(tokens)
        out_ids.append(tokens[:length])
        out_logprobs.append(step_logprobs[row, :length].clone())
        out_finished.append(done)
    return out_ids, out_logprobs, out_finished
