"""vLLM rollout engine: the ``RolloutEngine`` contract of ``rollout.py`` on a colocated ``vllm.LLM``.

Needs vLLM (``scripts/setup_vllm.sh`` builds ``.venv-vllm``); importing this module does not.
Design, and why (checked against vLLM 0.32):

- **In-process engine.** The engine core and its single worker run inside the trainer's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``InprocClient`` + ``UniProcExecutor``). A weight push
  hands vLLM the trainer's own tensors by reference: no pickling, no copy through ZMQ, no CUDA
  IPC handles, no ``VLLM_ALLOW_INSECURE_SERIALIZATION`` for the function sent to the worker, and
  no ``if __name__ == "__main__"`` guard. It is also how verl colocates vLLM with its trainer.
  Costs: no overlap of vLLM's scheduler with the forward pass (small next to a training step),
  and the trainer's process carries vLLM's globals — a world-size-1 ``torch.distributed`` group
  shared by all engines of the process (so a trainer that runs its own ``torch.distributed`` job
  needs vLLM's external-launcher mode instead), its environment cache, on CUDA its memory pool.
- **Weights** go in through the worker's ``reload_weights`` (vLLM's in-place reload): it puts each
  layer back in checkpoint layout, runs the model's own ``load_weights`` — which maps HF names
  (fused qkv / gate_up for Llama, transposed Conv1D for GPT-2) — and re-runs
  ``process_weights_after_loading``. That last step matters on CPU, where vLLM repacks each
  linear weight for oneDNN and drops the plain tensor, so a bare ``model.load_weights`` would
  leave the engine sampling from the old weights. A tied ``lm_head`` needs one more step
  (``vllm_weights.worker_reload_weights``).
- **Behaviour log-probs** must be log softmax(logits / T) of the sampled token *before* top-p
  truncation (what ``Policy.response_logprobs`` recomputes). No ``logprobs_mode`` of vLLM gives
  that when top_p < 1: ``raw_logprobs`` is before the temperature, ``processed_logprobs`` after
  top-k/top-p, renormalised over the nucleus (off by -log(nucleus mass), ~0.1 at top_p = 0.9).
  So the engine folds T into the model's ``LogitsProcessor.scale`` (the logits leave the model
  already divided by T), samples with vLLM temperature 1 and the requested top_p, and reads
  ``raw_logprobs``: the sampling distribution is unchanged and the value reported is exactly
  log softmax(logits / T).
- **Data-parallel ranks** (``policies[].parallel.data: N``): each rank of the trainer's
  ``torch.distributed`` world builds its own engine in vLLM's external-launcher mode
  (``distributed_executor_backend="external_launcher"``), which reuses that world instead of
  creating a group of its own: ``tensor_parallel_size`` = ``VLLMOptions.tensor_parallel_size``
  (dividing N), data-parallel size N / tp. Each data-parallel group samples its share of the
  prompts (prompt p goes to group p mod dp); requests keep their (seed, prompt, sample) seeds,
  so the samples are those of one engine whatever N and tp. vLLM's data-parallel groups step in
  lockstep (an all-reduce per step), so every rank calls ``generate`` together, even with no
  prompts of its own. Weights arrive gathered from the FSDP shards (``sync_weights(weights=)``),
  and closing an engine leaves the trainer's world alone.
- **Sleep mode** (CUDA/ROCm; vLLM has none on CPU): after ``generate`` the engine sleeps at level 1
  (weights offloaded to CPU RAM, KV cache released), so the trainer's update gets the memory;
  ``generate``, ``sync_weights`` and ``close`` wake it first. vLLM's sleep allocator is one per
  process, so a sleeping engine takes the memory of every sleep-enabled engine of the process
  with it: such engines sleep and wake together.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import random
import struct
import tempfile
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from graftrl.models.policy import Policy
from graftrl.models.rollout import RolloutBatch, SamplingParams
from graftrl.models.vllm_process import in_process_vllm, keep_distributed_state, preserved_rng, quiet
from graftrl.models.vllm_weights import (
    checkpoint_names,
    save_for_engine,
    unique_tensors,
    worker_model,
    worker_reload_weights,
)

if TYPE_CHECKING:
    from vllm import LLM

_GIB = 1 << 30

PromptSamples = dict[int, list[tuple[list[int], list[float], bool]]]
"""Prompt index -> its n samples (response ids, behaviour log-probs, finished), for gathering the
shares of data-parallel engines."""

_OPEN_ENGINES: weakref.WeakSet[VLLMRolloutEngine] = weakref.WeakSet()
"""Engines of this process not yet closed; they share vLLM's process-global state. Weak, so that an
engine dropped without ``close()`` is still closed (by ``__del__``) the way this module does it."""


@dataclass(frozen=True)
class VLLMOptions:
    """Engine settings; the defaults suit an engine colocated with its trainer on one device."""

    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take (weights + KV cache + activations); the trainer's
    model, gradients and optimizer state need the rest. Not used on CPU (``kv_cache_space_gib``)."""
    kv_cache_space_gib: float = 1.0
    """KV-cache size in GiB on the CPU backend (vLLM's ``VLLM_CPU_KVCACHE_SPACE``, passed as
    ``kv_cache_memory_bytes``: vLLM would otherwise size it as a fraction of RAM minus this process's
    footprint, which includes the trainer). Ignored on GPUs (``gpu_memory_utilization`` there)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: start-up in seconds, and no graph memory held next to the
    trainer. False trades a slower start for faster decoding on long runs."""
    sleep: bool | None = None
    """Release the engine's GPU memory between rollouts (vLLM sleep mode). None: on where vLLM
    supports it (CUDA, ROCm), off on CPU. True where it is unsupported raises."""
    max_model_len: int | None = None
    """Prompt + response token limit (responses are cut there). None: the model's
    ``max_position_embeddings``."""
    dtype: str = "auto"
    """vLLM's weight/compute dtype. "auto": the trainer's compute dtype (the policy's autocast
    dtype, else its parameter dtype), so behaviour and training log-probs agree; vLLM's own
    "auto" would run a float32 checkpoint in half precision."""
    max_num_seqs: int | None = None
    """Sequences decoded together per step. None: vLLM's default."""
    tensor_parallel_size: int = 1
    """Ranks that shard one engine (tensor parallelism) when the engine is built inside a
    ``torch.distributed`` world of N ranks (external-launcher mode); it must divide N, and the
    world holds N / tp data-parallel engines. Outside such a world only 1."""


def _request_seed(seed: int, prompt: int, sample: int) -> int:
    """A 63-bit seed for one (call seed, prompt index, sample index).

    Hashing rather than seed + index keeps neighbouring calls' and prompts' streams apart.
    """
    packed = struct.pack("<QQQ", seed % 2**64, prompt, sample)
    digest = hashlib.blake2b(packed, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ----- functions run on the vLLM worker (an object of this process) ------------------------------
def _worker_logit_scales(worker: Any) -> list[float]:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    return [m.scale for m in worker_model(worker).modules() if isinstance(m, LogitsProcessor)]


def _worker_set_logit_scales(worker: Any, scales: list[float]) -> None:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    processors = [m for m in worker_model(worker).modules() if isinstance(m, LogitsProcessor)]
    for module, scale in zip(processors, scales, strict=True):
        module.scale = scale


class VLLMRolloutEngine:
    """Samples with a colocated, in-process vLLM engine; same contract and output as ``HFRolloutEngine``.

    One engine serves one policy. It holds its own copy of the weights, so the trainer must call
    ``sync_weights(policy)`` after every optimizer update (``HFRolloutEngine`` samples from the
    trainer's model object and needs none). Call ``close()`` (or use it as a context manager)
    to free the engine: several can live in one process.
    """

    def __init__(
        self, policy: Policy, options: VLLMOptions = VLLMOptions(), seed: int = 0, max_batch_size: int = 512
    ) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.options = options
        self.seed = seed
        """Engine seed: ``generate`` calls without a seed take theirs from a stream it starts."""
        self._call_seeds = random.Random(seed)
        self.max_batch_size = max_batch_size
        """Rows per ``generate`` call that evaluation sends (``RolloutEngine``); vLLM schedules
        whatever it is given in its own batches (``max_num_seqs``)."""
        self.policy_name = policy.name
        on_cpu = current_platform.is_cpu()
        supported = current_platform.is_sleep_mode_available() and not on_cpu
        if options.sleep and not supported:
            raise ValueError(f"vLLM has no sleep mode on {current_platform.device_name}")
        self.sleep_enabled: bool = supported if options.sleep is None else options.sleep
        """Whether the engine releases its GPU memory between rollouts."""
        self._asleep = False
        self._temperature = 1.0
        self._closed = True  # until the engine exists

        extra: dict[str, Any] = {}
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        tp = options.tensor_parallel_size
        if world % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the {world} rank(s) of this torch.distributed world"
            )
        self.external_launcher = world > 1
        """Built inside the trainer's torch.distributed world: one engine per rank (module docstring)."""
        if self.external_launcher:
            # vLLM reads the rank from the environment (torchrun's variables); spawned ranks set none.
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
            extra.update(
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=tp,
                data_parallel_size=world // tp,
            )
        if options.max_model_len is not None:
            extra["max_model_len"] = options.max_model_len
        if options.max_num_seqs is not None:
            extra["max_num_seqs"] = options.max_num_seqs
        if on_cpu:
            extra["kv_cache_memory_bytes"] = int(options.kv_cache_space_gib * _GIB)
            # vLLM 0.32 rewinds a seeded request's generator when a prefill chunk samples nothing,
            # and a CPU generator cannot rewind ("CPU Generator does not use offset"): a seeded
            # batch larger than one prefill step crashes. Whole prefills avoid the rewind (vLLM
            # then raises the token budget to at least max_model_len).
            extra["enable_chunked_prefill"] = False
        # Start from a checkpoint of the policy as it is now (built in memory, resumed, ...);
        # vLLM reads the config and weights from it once, then the folder can go.
        with tempfile.TemporaryDirectory(prefix="graftrl-vllm-") as folder:
            save_for_engine(policy, folder)
            with in_process_vllm():
                self.llm: LLM = LLM(
                    model=folder,
                    skip_tokenizer_init=True,  # prompts arrive as the policy's own token ids
                    dtype=self._dtype(policy),
                    seed=seed,
                    gpu_memory_utilization=options.gpu_memory_utilization,
                    enforce_eager=options.enforce_eager,
                    enable_sleep_mode=self.sleep_enabled,
                    generation_config="vllm",  # no sampling defaults or stop ids from the checkpoint
                    logprobs_mode="raw_logprobs",  # with T folded into the model (module docstring)
                    max_logprobs=0,
                    enable_prefix_caching=True,
                    **extra,
                )
        self._closed = False
        _OPEN_ENGINES.add(self)
        if not hasattr(self.llm.llm_engine, "model_executor"):
            self.close()
            raise RuntimeError("vLLM started a separate engine process; this engine needs it in-process")
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        self.data_parallel_rank: int = parallel.data_parallel_rank if self.external_launcher else 0
        self.data_parallel_size: int = parallel.data_parallel_size if self.external_launcher else 1
        """Engines that sample disjoint shares of a ``generate(gather=...)`` call's prompts."""
        self._base_scales: list[float] = self._rpc(_worker_logit_scales)
        self.sync_weights(policy)
        self._warm_up(policy, on_cpu)

    # ----- the RolloutEngine contract ------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self, policy: Policy, weights: Sequence[tuple[str, Tensor]] | None = None) -> None:
        """Load the trainer's current weights into the running engine, then drop its prefix cache.

        vLLM copies the tensors (passed by reference) into its own parameters, in its dtype and
        fused layout. Cached prefixes hold KV computed with the old weights, hence the reset.
        ``weights``: (the model's own name, full tensor) pairs, each tied tensor once, when the
        policy's own model cannot give them (FSDP shards: the caller gathers them on every rank); None: the
        policy's model as it is.
        """
        self._check(policy)
        weights = checkpoint_names(policy.model, unique_tensors(policy.model) if weights is None else weights)
        self._wake()
        with quiet("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.core.block_pool"):
            # layerwise: "RotaryEmbedding / ParallelLMHead: Failed to load weights" on every sync,
            # expected (no weights / tied to the embedding); block_pool: "reset prefix cache".
            self._rpc(worker_reload_weights, list(weights))
            self.llm.reset_prefix_cache()

    def generate(
        self,
        policy: Policy,
        problems: Sequence[str],
        params: SamplingParams,
        seed: int | None = None,
        *,
        gather: Callable[[PromptSamples], PromptSamples] | None = None,
    ) -> RolloutBatch:
        """n samples per problem, in ``HFRolloutEngine``'s format (prompt-major rows).

        Each (prompt, sample) is its own request with seed hash(seed, prompt, sample), so a
        seeded call is reproducible and a prompt's samples do not depend on the other prompts.
        A call without a seed takes the next one of a stream started from the engine seed: runs
        are reproducible, and the trainer's global RNG is neither used nor advanced.

        ``gather`` (data-parallel engines, every rank calling): this engine samples only the
        prompts p with p mod ``data_parallel_size`` = ``data_parallel_rank`` and ``gather`` merges
        every rank's share; the samples are those of one engine sampling all prompts. Without it,
        each engine samples every prompt.
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self._check(policy)
        if params.temperature <= 0:
            raise ValueError("temperature must be > 0 (behaviour log-probs are log softmax(logits / T))")
        self._wake()
        self._set_temperature(params.temperature)
        if seed is None:
            seed = self._call_seeds.getrandbits(62)
        prompt_ids = policy.encode_prompts(problems)
        eos = policy.eos_token_id
        mine = list(range(len(prompt_ids)))
        if gather is not None:
            mine = mine[self.data_parallel_rank :: self.data_parallel_size]
        prompts: list[TokensPrompt] = []
        sampling: list[VLLMSamplingParams] = []
        for p in mine:
            ids = prompt_ids[p]
            for i in range(params.n):
                prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
                sampling.append(
                    VLLMSamplingParams(
                        n=1,
                        temperature=1.0,  # T is applied inside the model (logit scale)
                        top_p=params.top_p,
                        top_k=0,
                        max_tokens=params.max_new_tokens,
                        seed=_request_seed(seed, p, i),
                        ignore_eos=True,  # stop at the policy's EOS only (stop_token_ids)
                        stop_token_ids=[eos],
                        logprobs=0,  # the sampled token's log-prob only
                        detokenize=False,
                    )
                )
        with preserved_rng():
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        samples: PromptSamples = {p: [] for p in mine}
        for k, output in enumerate(outputs):
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            steps = completion.logprobs or []
            samples[mine[k // params.n]].append(
                (
                    ids,
                    [step[t].logprob for step, t in zip(steps, ids, strict=True)],
                    completion.finish_reason == "stop" and bool(ids) and ids[-1] == eos,
                )
            )
        if gather is not None:
            samples = gather(samples)
        rows = [sample for p in range(len(prompt_ids)) for sample in samples[p]]
        response_ids = [ids for ids, _, _ in rows]
        logprobs = [torch.tensor(lps, dtype=torch.float32) for _, lps, _ in rows]
        finished = [done for _, _, done in rows]
        texts = [
            policy.decode_response(ids[:-1] if done else ids)
            for ids, done in zip(response_ids, finished, strict=True)
        ]
        self._sleep()
        return RolloutBatch(prompt_ids, response_ids, logprobs, finished, texts, params.n)

    def reseed(self, seed: int) -> None:
        """Restart the stream unseeded ``generate`` calls take their seeds from (the trainer's
        global RNG stays untouched)."""
        self._call_seeds = random.Random(seed)

    def close(self) -> None:
        """Shut the engine down and free its memory (weights, KV cache; the distributed state
        with the last open engine of the process). Idempotent."""
        if self._closed:
            return
        self._wake()  # freeing memory that is asleep is not supported by vLLM's allocator
        self._closed = True
        _OPEN_ENGINES.discard(self)
        llm = self.__dict__.pop("llm")
        # The trainer owns an external launcher's world; other open engines share vLLM's state.
        shared = _OPEN_ENGINES or self.external_launcher
        keep = keep_distributed_state() if shared else contextlib.nullcontext()
        with keep:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __del__(self) -> None:
        # Dropped without close(), the engine would be shut down by vLLM's own finalizer, which
        # also tears down the distributed state the other open engines share.
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- helpers -------------------------------------------------------------------------------
    def _rpc(self, fn: Any, *args: Any) -> Any:
        """``fn(worker, *args)`` on the single worker; in-process, arguments go by reference."""
        return self.llm.collective_rpc(fn, args=args)[0]

    def _warm_up(self, policy: Policy, on_cpu: bool) -> None:
        """One token from a one-token prompt, so that a model vLLM cannot run (e.g. a head size its
        CPU attention lacks) fails at start-up, with a hint, rather than in the first rollout."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        try:
            with preserved_rng():
                self.llm.generate(
                    [TokensPrompt(prompt_token_ids=[policy.eos_token_id])],
                    VLLMSamplingParams(max_tokens=1, seed=0, detokenize=False),
                    use_tqdm=False,
                )
        except RuntimeError as error:
            self.close()
            hint = ""
            if on_cpu and "attention" in str(error):
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

                sizes = CPUAttentionBackend.get_supported_head_sizes()
                hint = f" (vLLM's CPU attention needs a head size in {sizes})"
            raise RuntimeError(f"vLLM cannot run policy {policy.name!r}: {error}{hint}") from error

    def _dtype(self, policy: Policy) -> str:
        if self.options.dtype != "auto":
            return self.options.dtype
        dtype = policy.compute_dtype or next(policy.model.parameters()).dtype
        return str(dtype).removeprefix("torch.")

    def _set_temperature(self, temperature: float) -> None:
        if temperature != self._temperature:
            self._rpc(_worker_set_logit_scales, [scale / temperature for scale in self._base_scales])
            self._temperature = temperature

    def _sleep(self) -> None:
        """Sleep (level 1) with every other sleep-enabled engine: they share one allocator."""
        if not self.sleep_enabled:
            return
        for engine in list(_OPEN_ENGINES):
            if engine.sleep_enabled and not engine._asleep:
                engine.llm.sleep(level=1)
                engine._asleep = True

    def _wake(self) -> None:
        if not self._asleep:
            return
        for engine in list(_OPEN_ENGINES):
            if engine._asleep:
                engine.llm.wake_up()
                engine._asleep = False

    def _check(self, policy: Policy) -> None:
        if self._closed:
            raise RuntimeError("the vLLM engine is closed")
        if policy.name != self.policy_name:
            raise ValueError(f"this engine serves policy {self.policy_name!r}, not {policy.name!r}")
