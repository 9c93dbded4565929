"""Per-GPU memory estimate of a run, from the config and each model's config.json (no weights loaded).

Pure arithmetic on a model's shape (parameter count from a meta-device build, hidden size, layers,
MLP width, vocabulary) and the run's settings. Each policy's trainer keeps, per GPU, with N
data-parallel (FSDP) ranks:

- parameters, gradients and AdamW's two moments in ``param_dtype``, sharded: 4 x P x bytes / N
  (float32 parameters are the master weights; there is no separate copy);
- the compute-dtype copy when ``dtype`` is below ``param_dtype``: autocast caches a bf16 copy of
  every weight during a forward/backward (P x 2 / N; FSDP2 casts each shard before gathering);
- activations of one micro-batch: without gradient checkpointing ``ACT_VALUES_PER_TOKEN`` values
  per token per layer (11 h + 4 I: the norm, attention and SwiGLU inputs autograd saves, with
  fused SDPA attention), in the compute dtype; with it, the float32 residual input of every layer
  plus one layer's full activations (the layer being recomputed). ``attn_implementation: eager``
  adds each layer's attention probabilities, rows x heads x length² of them, saved as the float32
  softmax and, below float32, its compute-dtype cast (``EAGER_PROB_BYTES``);
- the log-prob logits: ``LOGIT_BYTES`` bytes per (position, vocabulary entry) — the LM head's
  output, its float32 copy and the float32 log-softmax — over every response position of the
  micro-batch, or over ``logprob_chunk_tokens`` positions per row when chunked;
- the colocated vLLM engine's share, ``gpu_memory_utilization`` x device memory; with sleep mode
  (the default on CUDA) it is released during the update, so the peak is the larger of the
  rollout and the update, else their sum;
- with the HF engine, generation (during the rollout, never beside the update): the KV cache of
  ``rollout.max_batch_size`` rows of full length (2 x layers x KV heads x head dim values per
  token, compute dtype), one step's float32 logits and log-softmax, and, for a sharded policy, the
  all-gathered compute-dtype weights (every rank samples on the full model).

Colocated policies (backend local, or Ray actors with fractional GPUs) add up on one GPU. Sequence
lengths are worst case: ``prompt_tokens`` (an argument) plus ``rollout.max_new_tokens`` per row.
The activation rule is a rule of thumb (Korthikanti et al., 2022, adapted to SwiGLU and fused
attention); benchmarks/memory_vs_length.py measures the real figure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from graftrl.config import Config, ConfigError, PolicyConfig

logger = logging.getLogger(__name__)

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACT_VALUES_PER_TOKEN = (11, 4)
"""Saved activation values per token per decoder layer: 11 x hidden + 4 x MLP width."""
LOGIT_BYTES = 2 + 4 + 4
"""Bytes per (position, vocab entry) held by a log-prob pass: head output, float32 copy, log-softmax.
In float32 compute the head output is already float32 (4 + 4 + 4)."""
EAGER_PROB_BYTES = 4
"""Bytes per attention probability eager attention saves for backward: the float32 softmax (plus
the compute-dtype copy the second matmul saves, when the compute dtype is narrower)."""
DEFAULT_PROMPT_TOKENS = 512
"""Prompt length assumed by the estimate (the paper's MATH prompts with template are ~100-400)."""


class MemoryEstimateError(ConfigError):
    """A policy cannot fit the device memory, or a model's config cannot be read."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model, read from its config.json."""

    parameters: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_width: int = 0
    """KV heads x head dim: a token's keys (or values) per layer."""
    heads: int = 0
    """Query heads (eager attention's probabilities are rows x heads x length²)."""
    attention: str | None = None
    """The attention kernel the model loads with (``config._attn_implementation`` of the build):
    transformers' default for the model unless the policy names one (Gemma 2: eager)."""
    context: int | None = None
    """Positions the model attends over (``max_position_embeddings``), None when unknown."""

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (all but the embeddings and the LM head), on average."""
        return max(0, self.parameters - 2 * self.vocab * self.hidden) // max(self.layers, 1)


def model_shape(path: str, attn_implementation: str | None = None, name: str = "?") -> ModelShape:
    """A model's shape from its config.json: parameters counted on a meta-device build (no weights,
    no memory), so the count is exact for any AutoModelForCausalLM, tied embeddings counted once.
    The build takes ``attn_implementation`` as loading does (``attention_kwargs``), so ``attention``
    is the kernel the run would train with."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from graftrl.models.model_loading import attention_error, attention_kwargs, context_of

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise MemoryEstimateError(
            f"memory estimate: cannot read the model config at {path!r} ({str(error).splitlines()[0]}); "
            "point policies[].path to a model folder with a config.json"
        ) from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **attention_kwargs(attn_implementation))
    except ImportError:  # a kernel this machine lacks (flash-attn): estimated as named, for another
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        model.config._attn_implementation = attn_implementation
    except ValueError as error:  # a kernel the model does not have: loading refuses it too
        raise MemoryEstimateError(str(attention_error(name, attn_implementation, error))) from None
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        hidden=hidden,
        layers=int(text.num_hidden_layers),
        intermediate=int(intermediate),
        vocab=int(text.vocab_size),
        kv_width=int(kv_heads) * int(head_dim),
        heads=heads,
        attention=getattr(model.config, "_attn_implementation", None) or attn_implementation,
        context=context_of(text),
    )


def data_parallel_size(spec: PolicyConfig) -> int:
    """FSDP ranks of a policy (``policies[].parallel.data``; 1 where the field does not exist)."""
    parallel = getattr(spec, "parallel", None)
    return int(getattr(parallel, "data", None) or 1)


@dataclass(frozen=True)
class PolicyEstimate:
    """Bytes per GPU of one policy, by component."""

    name: str
    ranks: int
    parameters: int
    model_states: float
    """Parameters + gradients + AdamW moments (sharded)."""
    compute_copy: float
    activations: float
    logits: float
    vllm: float
    vllm_sleeps: bool
    generation: float = 0.0
    """HF engine: KV cache, step logits and gathered weights while sampling (0 with vLLM)."""

    @property
    def resident(self) -> float:
        return self.model_states + self.compute_copy

    @property
    def update(self) -> float:
        """Transient memory of one micro-batch's forward and backward."""
        return self.activations + self.logits

    @property
    def peak(self) -> float:
        if self.vllm_sleeps:
            return self.resident + max(self.update, self.vllm)
        return self.resident + max(self.update, self.generation) + self.vllm


def estimate_policy(
    config: Config,
    spec: PolicyConfig,
    shape: ModelShape,
    *,
    device_bytes: float,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    ranks: int | None = None,
) -> PolicyEstimate:
    """Per-GPU bytes of one policy's trainer (and its vLLM engine), as the module docstring says."""
    train, rollout = config.train, config.rollout
    n = ranks or data_parallel_size(spec)
    param_bytes = DTYPE_BYTES[spec.param_dtype]
    compute_bytes = DTYPE_BYTES[spec.dtype]
    p = shape.parameters
    model_states = 4 * p * param_bytes / n  # weights, grads, AdamW m and v
    compute_copy = p * compute_bytes / n if compute_bytes < param_bytes else 0.0

    response = rollout.max_new_tokens
    sequence = prompt_tokens + response
    if train.micro_batch_tokens is not None:  # rows of full length within the token budget
        rows = max(1, train.micro_batch_tokens // sequence)
    else:
        rows = train.micro_batch_size
    tokens = rows * sequence
    per_token_layer = ACT_VALUES_PER_TOKEN[0] * shape.hidden + ACT_VALUES_PER_TOKEN[1] * shape.intermediate
    if train.gradient_checkpointing:
        activations = tokens * (shape.layers * shape.hidden * 4 + per_token_layer * compute_bytes)
    else:
        activations = tokens * shape.layers * per_token_layer * compute_bytes
    if attention_of(spec, shape) == "eager":  # the attention matrix is saved
        prob_bytes = EAGER_PROB_BYTES + (compute_bytes if compute_bytes < 4 else 0)
        layers_saved = 1 if train.gradient_checkpointing else shape.layers
        activations += rows * shape.heads * sequence**2 * prob_bytes * layers_saved
    positions = rows * min(train.logprob_chunk_tokens or response, response)
    logit_bytes = LOGIT_BYTES if compute_bytes < 4 else 12
    logits = positions * shape.vocab * logit_bytes

    vllm = generation = 0.0
    sleeps = False
    if rollout.engine == "vllm":
        vllm = rollout.vllm.gpu_memory_utilization * device_bytes
        sleeps = rollout.vllm.sleep is not False
    else:
        kv_cache = rollout.max_batch_size * sequence * 2 * shape.layers * shape.kv_width * compute_bytes
        step_logits = rollout.max_batch_size * shape.vocab * 4 * 2
        gathered = p * compute_bytes * (1 - 1 / n)  # the other ranks' shards, for sampling
        generation = kv_cache + step_logits + gathered
    return PolicyEstimate(
        spec.name, n, p, model_states, compute_copy, activations, logits, vllm, sleeps, generation
    )


def attention_of(spec: PolicyConfig, shape: ModelShape) -> str | None:
    """The kernel a policy trains with: its ``attn_implementation``, else the one its model loads
    with by default (``ModelShape.attention``)."""
    return getattr(spec, "attn_implementation", None) or shape.attention


def admitted_prompt_tokens(
    spec: PolicyConfig, shape: ModelShape, max_new_tokens: int, prompt_tokens: int
) -> int:
    """The assumed prompt length as training would admit it: train's context check
    (``models.prompts.check_response_budget``) refuses a response budget the model cannot hold, and
    refuses prompts longer than the context leaves, so no row is longer than the context."""
    from graftrl.errors import ModelError
    from graftrl.models.prompts import check_response_budget

    try:
        check_response_budget(spec.name, shape.context, max_new_tokens)
    except ModelError as error:
        raise MemoryEstimateError(str(error)) from None
    return prompt_tokens if shape.context is None else min(prompt_tokens, shape.context - max_new_tokens)


def colocated(config: Config) -> bool:
    """Whether the policies share GPUs: one process (local) or Ray actors with fractional GPUs."""
    return config.backend == "local" or any(0 < p.resources.num_gpus < 1 for p in config.policies)


def per_gpu_total(config: Config, estimates: list[PolicyEstimate]) -> float:
    """Peak bytes on one GPU: colocated policies' resident states add up; the engines' shares add
    up too, during the rollout only when they sleep; the largest update counts once (local backend),
    every update (Ray actors update concurrently)."""
    if not estimates:
        return 0.0
    if not colocated(config):
        return max(e.peak for e in estimates)
    resident = sum(e.resident for e in estimates)
    awake = sum(e.vllm for e in estimates if not e.vllm_sleeps)
    # Sleeping engines of one process wake together (vLLM's one sleep allocator per process).
    asleep = sum(e.vllm for e in estimates if e.vllm_sleeps)
    # The local backend samples and updates one policy after another; Ray actors concurrently.
    combine = sum if config.backend == "ray" else max
    update = combine(e.update for e in estimates)
    generation = combine(e.generation for e in estimates)
    return resident + awake + max(update, asleep + generation)


def estimate_config(
    config: Config,
    device_bytes: float,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    shapes: dict[str, ModelShape] | None = None,
    ranks: int | None = None,
) -> tuple[list[PolicyEstimate], float]:
    """Every policy's estimate and the per-GPU peak; shapes read from config.json unless given;
    ``ranks`` replaces every policy's data-parallel size (a what-if). Rows are at most the model's
    context, and a response budget it cannot hold is refused, as training does
    (``admitted_prompt_tokens``)."""
    estimates = []
    for spec in config.policies:
        shape = (shapes or {}).get(spec.name) or model_shape(spec.path, spec.attn_implementation, spec.name)
        prompt = admitted_prompt_tokens(spec, shape, config.rollout.max_new_tokens, prompt_tokens)
        estimates.append(
            estimate_policy(config, spec, shape, device_bytes=device_bytes, prompt_tokens=prompt, ranks=ranks)
        )
    return estimates, per_gpu_total(config, estimates)


def memory_table(estimates: list[PolicyEstimate], total: float, device_bytes: float) -> Any:
    """A rich table of the estimate, GiB per GPU."""
    from rich.table import Table

    table = Table(
        title=f"memory estimate per GPU, GiB (device {device_bytes / GIB:.0f} GiB)",
        caption="states: parameters + gradients + AdamW m, v, sharded over N FSDP ranks; copy: autocast "
        "compute-dtype weights; acts / logits: one micro-batch's forward + backward; HF gen: KV cache, step "
        "logits and gathered weights while sampling with the HF engine",
    )
    for column in ("policy", "params", "N", "states", "copy", "acts", "logits", "vLLM", "HF gen", "peak"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for e in estimates:
        vllm = f"{e.vllm / GIB:.1f}" + (" (sleeps)" if e.vllm_sleeps and e.vllm else "")
        table.add_row(
            e.name,
            f"{e.parameters / 1e9:.2f}B",
            str(e.ranks),
            *(f"{x / GIB:.1f}" for x in (e.model_states, e.compute_copy, e.activations, e.logits)),
            vllm,
            f"{e.generation / GIB:.1f}",
            f"{e.peak / GIB:.1f}",
        )
    table.add_row("per GPU", "", "", "", "", "", "", "", "", f"{total / GIB:.1f}", end_section=True)
    return table


def fit_message(total: float, device_bytes: float) -> str | None:
    """None when the estimate fits, else the one-line error with what to change."""
    if total <= device_bytes:
        return None
    return (
        f"memory estimate {total / GIB:.1f} GiB per GPU exceeds the {device_bytes / GIB:.1f} GiB available: "
        "raise policies[].parallel.data, or set train.gradient_checkpointing, train.logprob_chunk_tokens, "
        "a smaller train.micro_batch_tokens, rollout.max_batch_size or rollout.vllm.gpu_memory_utilization "
        "(`graftrl estimate-memory CONFIG` shows the parts)"
    )


def check_before_loading(config: Config, console: Any = None) -> None:
    """At start-up, before any weights load: on CUDA print the estimate and raise
    ``MemoryEstimateError`` when it exceeds the device's free memory; on CPU only log it."""
    import torch

    from graftrl.models.policy import resolve_device

    devices = [resolve_device(p.device) for p in config.policies]
    cuda = next((d for d in devices if d.type == "cuda"), None)
    if cuda is None:  # CPU memory is the host's: log, never refuse
        if logger.isEnabledFor(logging.INFO):
            try:
                _, total = estimate_config(config, device_bytes=0.0)
                logger.info("memory estimate (CPU run): %.2f GiB", total / GIB)
            except Exception as error:  # an estimate never stops a CPU run
                logger.info("memory estimate unavailable: %s", error)
        return
    free, device_total = torch.cuda.mem_get_info(cuda)
    try:
        estimates, total = estimate_config(config, device_bytes=device_total)
    except MemoryEstimateError as error:  # loading will name the missing folder itself
        logger.warning("%s", error)
        return
    if console is None:
        from rich.console import Console

        console = Console()
    console.print(memory_table(estimates, total, device_total))
    message = fit_message(total, free)
    if message is not None:
        raise MemoryEstimateError(message)
