"""The run configuration's model: one pydantic section per YAML key, one docstring per field.

Defaults are the paper's (algorithm.md §1, Table 3). Unknown keys are rejected with the key named,
so a typo never silently falls back to a default. This module declares the sections every run has
(``RunConfig``); each method declares its own section, defaults and cross-section rules in its
module under ``graftrl.methods``, and ``Config`` adds every registered method's section as a
top-level key (``config_model``).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, create_model, model_validator

from graftrl.config.peers import PeerEntry
from graftrl.config.rewards import RewardConfig
from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED
from graftrl.core.contrast import MAX_PAIRS, MAX_TOKENS
from graftrl.core.losses import EPS_HIGH, EPS_LOW
from graftrl.methods import DEFAULT_METHOD, METHODS, ConfigSection
from graftrl.storage.data import PAPER_PROMPT_SUFFIX


class _Section(BaseModel):
    model_config = ConfigSection.model_config  # the methods' sections behave alike


class ResourcesConfig(_Section):
    num_gpus: float = Field(default=0, ge=0)
    """GPUs of the policy's Ray actor (trainer and its colocated rollout engine); fractions share a
    GPU. Ray sets CUDA_VISIBLE_DEVICES for the actor, so `device: auto` picks its own GPU. With
    `parallel.data: N`, the total over the policy's N rank actors (each gets num_gpus / N)."""
    num_cpus: float = Field(default=1, gt=0)
    """CPUs of the policy's Ray actor; also its torch intra-op threads (rounded down, at least 1).
    With `parallel.data: N`, the total over its N rank actors, as `num_gpus`."""


class ParallelConfig(_Section):
    data: int = Field(default=1, ge=1)
    """Data-parallel ranks of this policy's trainer (FSDP2 `fully_shard`: parameters, gradients and
    AdamW state sharded over N processes of one process group; each minibatch's rows split over
    them; same objective as one device). Set explicitly; it is never derived from `resources`.
    On GPUs rank r uses cuda:r of its node (`backend: ray`: each rank is an actor in the policy's
    placement group, `parallel.placement`, with `resources` / N, e.g. `resources.num_gpus: N` for
    one GPU per rank, and may run on another node). With `rollout.engine: vllm` each rank runs a
    vLLM engine (`rollout.vllm.tensor_parallel_size`)."""
    timeout_s: float = Field(default=600, gt=0)
    """Timeout of the ranks' collectives (gloo/NCCL): a rank stuck this long raises. With
    `backend: ray`, also how long to wait for the cluster to place the ranks."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """`backend: ray`: strategy of the policy's placement group (one bundle per rank, the
    policy's `resources` shared equally): PACK keeps the ranks on as few nodes as possible
    (fast collectives), SPREAD / STRICT_SPREAD put them on different nodes."""


class PolicyConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    """Short unique name; used in logs, records and checkpoint folders."""
    path: str
    """Folder of a Hugging Face checkpoint (model + tokenizer) or a hub id when online."""
    template: str = "{problem}"
    """Prompt template, a Python format string with `{problem}` (the problem text plus the data
    suffix). Ignored when `chat_template` is true."""
    chat_template: bool = False
    """Wrap the problem as a user message with the tokenizer's chat template."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of forward passes (the paper: bf16 on GPUs; CPU runs use float32). Below
    float32 it runs under autocast with `param_dtype` master weights and optimizer state."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the parameters and AdamW state; keep float32 unless memory forces otherwise (in
    pure bf16 an lr-1e-6 update mostly rounds away)."""
    device: str = "auto"
    """`auto` (cuda when present, else cpu), `cpu`, `cuda`, `cuda:1`, ..."""
    attn_implementation: str | None = None
    """Attention kernel of the training-side model, passed to `from_pretrained`: `sdpa`, `eager`,
    `flash_attention_2` (needs flash-attn, GPU), ...; None keeps transformers' default (`sdpa`
    where the model has it). Kernels differ in their last bits, so a run's samples may differ;
    `eager` keeps every layer's length² attention probabilities for backward (the memory estimate
    counts them); vLLM rollouts use vLLM's own."""
    disable_dropout: bool = True
    """Zero the model's dropout probabilities at load (its modules'; the checkpoint's config is kept):
    the update runs in training mode, and with dropout on the trainer's log-probs of the policy
    that sampled would not be the behaviour log-probs (GPT-2 checkpoints ship with 0.1). TRL's
    `disable_dropout`."""
    lr: float | None = Field(default=None, gt=0)
    """Per-policy learning rate; overrides `optim.lr` for this policy."""
    resources: ResourcesConfig = ResourcesConfig()
    """What the policy's Ray actor reserves (`backend: ray`); ignored by the local backend."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallelism inside the policy (`data`: FSDP2 data-parallel ranks)."""


class VLLMConfig(_Section):
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Share of the GPU's memory vLLM may take (weights + KV cache), leaving the rest to the
    colocated trainer."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture (faster start; graphs help only long runs of small batches)."""
    sleep: bool | None = None
    """Release vLLM's GPU memory while the trainer updates (vLLM sleep mode, CUDA only); None =
    on where supported."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Context length of the engine (None: the model's)."""
    kv_cache_space_gib: float = Field(default=1.0, gt=0)
    """KV-cache size of the CPU backend (VLLM_CPU_KVCACHE_SPACE); ignored on GPUs."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; `auto` = the policy's compute dtype, so behaviour and trainer log-probs agree
    (vLLM's own `auto` would run a float32 checkpoint in half precision)."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Sequences decoded together per engine step (None: vLLM's default)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Ranks that shard one vLLM engine (tensor parallelism). With `policies[].parallel.data: N`
    every rank of the policy runs an engine in vLLM's external-launcher mode, in the ranks'
    process group: N / tp data-parallel engines, each sampling its share of the prompts. Must
    divide every policy's `parallel.data` (so 1 for a one-rank policy)."""


class RolloutConfig(_Section):
    n: int = Field(default=8, ge=1)
    """Responses sampled per prompt per model (the group size); at least 2, since every method's
    advantages compare a response with the rest of its group (with n = 1 they are all 0)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; training log-probs use the same logits / T."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(default=4096, ge=1)
    """Response length limit; truncated responses are scored as generated."""
    max_batch_size: int = Field(default=512, ge=1)
    """Rows (prompt x sample) per generate call; lower it when memory is short. With `engine: vllm`
    only validation's chunk size (vLLM batches by itself)."""
    share_prompts: bool = True
    """`engine: hf`: run each prompt's forward pass once for its n samples (in calls of enough
    prompts, `models.shared_prefill.SHARE_FROM_PROMPTS`), as vLLM's prefix caching does. The samples
    are plain `generate`'s (bit for bit on CPU; on GPUs to the last bits); false: plain `generate`,
    which repeats every prompt n times first."""
    compile: Literal["auto"] | bool = "auto"
    """`engine: hf`: sample with a static KV cache and a compiled decode step, replayed as a CUDA
    graph (`models.compiled_decode`), instead of `generate`'s eager loop, which on a GPU is bound by
    Python and kernel launches. `auto`: on CUDA, where the model supports it (decoder-only,
    full-attention, `torch.compile`-able: Llama, Qwen2, ...; not under `parallel.data` > 1); `true`:
    also on CPU (needs a C compiler), an error where unsupported; `false`: `generate` always. Same
    distribution and behaviour log-probs as `generate`, not the same bits (compiled kernels round
    differently). The decode step compiles once per model and cache length (prompt width +
    max_new_tokens, rounded up to 256), and once more when a second row count makes the rows
    symbolic (rows are padded to a multiple of 8): seconds to a minute each, timed apart from
    sampling (`HFRolloutEngine.compile_seconds`). `engine: vllm` ignores it."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (`method: grpo` only): each policy drops its zero-variance groups and
    samples more prompts (from a second, deterministic prompt stream) until `train.batch_prompts`
    informative groups are kept or `max_sampling_rounds` is reached; it then trains on what it has."""
    max_sampling_rounds: int = Field(default=3, ge=1)
    """Cap on generation rounds per policy and step under `dynamic_sampling` (the first included)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Sampler: `hf` (transformers `generate` on the trainer's own weights) or `vllm` (a vLLM engine
    colocated with each policy's trainer; it takes the new weights after every update)."""
    vllm: VLLMConfig = VLLMConfig()
    """vLLM engine settings (`engine: vllm` only)."""
    tis_cap: float | None = Field(default=None, gt=0)
    """Truncated importance sampling for the rollout/trainer mismatch (off by default): when set,
    the trainer recomputes its own old log-probs for its own responses and weights each token's
    surrogate by min(pi_trainer / pi_rollout, tis_cap) (Yao et al. 2025; e.g. 2.0). Useful with
    `engine: vllm`, whose kernels give slightly different log-probs than the trainer's."""


class OptimConfig(_Section):
    lr: float = Field(default=1e-6, gt=0)
    """AdamW learning rate (constant)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global grad-norm clip per optimizer step."""


class TrainConfig(_Section):
    steps: int = Field(default=174, ge=1)
    """Rollout/update steps (paper: 3 epochs of 7,500 MATH problems at batch 128 = 174)."""
    batch_prompts: int = Field(default=128, ge=1)
    """Prompts per step, shared by every policy."""
    minibatch_prompts: int = Field(default=32, ge=1)
    """Prompt groups per optimizer step (4 steps per rollout batch at the defaults). When it does not
    divide `batch_prompts`, the last optimizer step of each epoch takes the remainder (fewer groups,
    its own token mean); `graftrl train` prints a note saying so. Unset, `method: hacpo` takes its
    recipe's half of `batch_prompts` (its section says so)."""
    update_epochs: int = Field(default=1, ge=1)
    """Passes over each rollout batch."""
    micro_batch_size: int = Field(default=64, ge=1)
    """Sequences per forward/backward pass (gradient accumulation within a minibatch)."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Size micro-batches by padded tokens instead (verl's dynamic batch size): length-sorted rows
    are packed so rows x (longest prompt + longest response) stays within this budget; a longer
    row goes alone. Also bounds the no-grad scoring passes. None: `micro_batch_size` rows each.
    Memory only, not the math (the loss denominators are per minibatch)."""
    logprob_chunk_tokens: int | None = Field(default=None, ge=1)
    """Apply the LM head and log-softmax to this many response positions at a time, each chunk
    recomputed in backward, so no [rows, response length, vocab] logits tensor is ever held
    (e.g. 1024). None: all positions at once. Same values within float tolerance; models that
    rescale or soft-cap logits (Gemma 2/3, Cohere, Granite) keep the unchunked path."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (Hugging Face gradient checkpointing,
    non-reentrant): a micro-batch keeps only each layer's input plus one layer's activations, for
    one more forward pass per layer in backward. Generation is unaffected."""
    eps_low: float = Field(default=EPS_LOW, ge=0)
    """Lower clip range of the token ratio."""
    eps_high: float = Field(default=EPS_HIGH, ge=0)
    """Upper clip range of the token ratio (DAPO clip-higher)."""
    adv_eps: float = Field(default=ADV_EPS, gt=0)
    """eps_adv in eq. 1."""
    adv_std_unbiased: bool = ADV_STD_UNBIASED
    """Unbiased (n - 1) group std in eq. 1, as verl; False uses the population std."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL penalty (k3 estimator, own responses) to a frozen copy of each initial policy; 0 = off,
    no reference model is kept. Unset, `method: hacpo` takes its recipe's value (its section says
    which)."""
    clip_ratio_c: float | None = Field(default=None, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020): a token with a < 0 contributes at
    most -c * a to the loss, however large its ratio. None = off, graftrl's default and the
    paper's eq. 10 (docs/algorithm.md); verl's default is 3.0 (and the paper trained on verl), so
    set 3.0 to match verl. Applies to the clipped surrogate (grpo, graft, sgt, pooling, luffy's own rows)."""
    log_ratio_clamp: float | None = Field(default=None, gt=0)
    """Clamp log(pi / pi_old) to [-x, x] before exp in the clipped surrogate, so one extreme token
    cannot overflow the ratio (e.g. 20). None = off (the ratio is exact)."""
    max_nonfinite_steps: int = Field(default=3, ge=1)
    """A minibatch whose loss or gradient norm is NaN/inf skips its optimizer step (grads zeroed,
    counted as `nonfinite_skips` in metrics.jsonl); after this many skipped optimizer steps in a
    row the run stops with a one-line error instead of training on garbage."""


class DataConfig(_Section):
    train: str
    """JSONL or Parquet file with `problem`, `answer` and optional `id` fields."""
    prompt_suffix: str | None = PAPER_PROMPT_SUFFIX
    """Appended to every problem (after a space); null for none."""


class LoggingConfig(_Section):
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the `tensorboard` extra)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the `wandb` extra)."""
    wandb_project: str = "graftrl"
    """W&B project name."""
    progress: bool = True
    """Show rich progress bars."""
    log_samples: int = Field(default=2, ge=0)
    """Example responses per model written to samples.jsonl each step."""
    log_transfers: bool = False
    """Also write each scored peer response's text and prompt id to compatibility.jsonl (for error
    analysis of what was transferred; about one response's size per transferred response)."""
    contrast_max_tokens: int = Field(default=MAX_TOKENS, ge=1)
    """Contrast diagnostic (`contrast_*` metrics): tokens of each moved response compared (its first)."""
    contrast_max_pairs: int = Field(default=MAX_PAIRS, ge=1)
    """Contrast diagnostic: responses of the other outcome each moved response is compared with."""


class CheckpointConfig(_Section):
    every: int = Field(default=0, ge=0)
    """Save every this many steps (0: only at the end)."""
    keep_last: int = Field(default=2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""


class ValidationConfig(_Section):
    files: dict[str, str] | list[str] = {}
    """Validation benchmarks: a mapping NAME -> local JSONL/Parquet file, or a list of benchmark specs
    (`NAME=PATH`, a file path, or a built-in name such as MATH500 loaded from the hub when online).
    Empty: no validation. Checkpoint selection keeps each policy's best aggregate in `run_dir/best/`."""
    every: int = Field(default=5, ge=1)
    """Validate after every this many completed steps (and after the last step)."""
    samples: int = Field(default=8, ge=1)
    """Samples per problem (pass@1 = mean correctness over samples, then problems)."""
    temperature: float = Field(default=0.6, gt=0)
    """Validation sampling temperature (paper: 0.6)."""
    top_p: float = Field(default=0.95, gt=0, le=1)
    """Validation nucleus mass (paper: 0.95)."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Response length limit; null: the rollout's `max_new_tokens` (same limit as training)."""
    max_problems: int | None = Field(default=None, ge=1)
    """Use only the first this many problems of each benchmark (null: all)."""

    def specs(self) -> list[str]:
        """The benchmarks as `graftrl.evaluation.benchmarks` specs."""
        if isinstance(self.files, dict):
            return [f"{name}={path}" for name, path in self.files.items()]
        return list(self.files)


class StoreConfig(_Section):
    record: bool = False
    """Record every rollout group of every policy (Parquet, one file per step) for replay."""
    path: str | None = None
    """Store folder; default `<run dir>/store`."""


class RayConfig(_Section):
    address: str | None = None
    """`ray.init(address=...)`: None starts a local Ray; `auto` or `ray://host:10001` joins an
    existing cluster (multi-node; the run folder must be on storage every node sees)."""
    num_cpus: int | None = Field(default=None, ge=1)
    """CPUs of a Ray started here (None: all)."""
    num_gpus: int | None = Field(default=None, ge=0)
    """GPUs of a Ray started here (None: all)."""


class RunConfig(_Section):
    """The sections every run has; ``Config`` adds one section per registered method."""

    seed: int = 0
    """Seed for prompt order, sampling and method randomness."""
    backend: Literal["local", "ray"] = "local"
    """`local`: every policy in this process, one after another. `ray`: each policy in its own Ray
    actor (`policies[].resources`), rollouts and updates of all policies concurrent, records moved
    through Ray's object store; same results as `local` for the same seed."""
    ray: RayConfig = RayConfig()
    """Ray cluster (`backend: ray` only)."""
    method: str = DEFAULT_METHOD
    """Training method, a name registered in graftrl.methods (grpo, graft, ...)."""
    policies: list[PolicyConfig] = Field(min_length=1)
    """The co-trained policies; all see the same prompt batch every step."""
    data: DataConfig
    """Training prompts."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    train: TrainConfig = TrainConfig()
    """Update schedule and loss."""
    reward: RewardConfig = RewardConfig()
    """Verifier."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics sinks."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    validation: ValidationConfig = ValidationConfig()
    """Validation during training and best-checkpoint selection (off unless `files` is set)."""
    peers: list[PeerEntry] = []
    """Peers, never loaded, never trained here: stored (algorithm.md §2.3, replayed from trajectory
    stores) or served (an OpenAI-compatible endpoint answers the all-fail prompts,
    docs/served-peer.md). Transfer from them is one-way, so GRAFT selects every candidate (no balancing)."""
    store: StoreConfig = StoreConfig()
    """Trajectory recording."""

    @model_validator(mode="before")
    @classmethod
    def _method_recipe(cls, data: Any) -> Any:
        """The ``train`` fields the config leaves unset take the method's recipe (``Method.recipe``:
        HACPO's KL and minibatch), so the run config says what trains and no preset repeats it."""
        if not isinstance(data, dict):
            return data
        method, train = data.get("method", DEFAULT_METHOD), data.get("train", {})
        if not isinstance(method, str) or method not in METHODS or not isinstance(train, dict):
            return data  # the field validators name what is wrong
        batch = train.get("batch_prompts", TrainConfig.model_fields["batch_prompts"].default)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            return data
        policies = data.get("policies")
        recipe = METHODS[method].recipe(batch, len(policies) if isinstance(policies, list) else 1)
        unset = {key: value for key, value in recipe.items() if key not in train}
        return {**data, "train": {**train, **unset}} if unset else data

    @model_validator(mode="before")
    @classmethod
    def _suffix_of_the_reward(cls, data: Any) -> Any:
        """`data.prompt_suffix` defaults to the paper's math instruction (`\\boxed{}`) only for
        `reward.kind: math`; for any other verifier an unset suffix is none (the rows say what to
        answer, and a code task asked for a box would be asked the wrong thing)."""
        if not isinstance(data, dict):
            return data
        reward, section = data.get("reward"), data.get("data")
        kind = reward.get("kind", "math") if isinstance(reward, dict) else getattr(reward, "kind", "math")
        if kind == "math" or not isinstance(section, dict) or "prompt_suffix" in section:
            return data
        return {**data, "data": {**section, "prompt_suffix": None}}

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.method not in METHODS:
            raise ValueError(f"method: unknown method {self.method!r}; choose one of {sorted(METHODS)}")
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policies: names must be unique, got {names}")
        peer_names = [p.name for p in self.peers]
        if set(peer_names) & set(names) or len(set(peer_names)) != len(peer_names):
            raise ValueError(f"peers: names must be unique and differ from the policies', got {peer_names}")
        if self.rollout.n < 2:
            raise ValueError(
                f"rollout.n: {self.rollout.n} response per prompt; method {self.method!r} computes "
                "advantages within each group of n, so n = 1 learns nothing: set rollout.n >= 2"
            )
        tp = self.rollout.vllm.tensor_parallel_size
        if self.rollout.engine == "vllm":
            for policy in self.policies:
                if policy.parallel.data % tp:
                    raise ValueError(
                        f"rollout.vllm.tensor_parallel_size ({tp}) must divide policies[{policy.name}]."
                        f"parallel.data ({policy.parallel.data}): each of its ranks runs one shard of an "
                        "engine; set a divisor of parallel.data"
                    )
        if self.train.minibatch_prompts > self.train.batch_prompts:
            raise ValueError(
                f"train.minibatch_prompts ({self.train.minibatch_prompts}) exceeds train.batch_prompts "
                f"({self.train.batch_prompts})"
            )
        METHODS[self.method].check(self)
        return self


def _method_sections() -> tuple[tuple[str, type[ConfigSection]], ...]:
    """(YAML key, section model) of every registered method that has a section, in registry order."""
    return tuple((m.section_key, m.section) for m in METHODS.values() if m.section is not None)


@functools.cache
def _config_model(sections: tuple[tuple[str, type[ConfigSection]], ...]) -> type[RunConfig]:
    fields: dict[str, Any] = {
        key: (section, Field(default_factory=section, description=inspect.getdoc(section)))
        for key, section in sections
    }
    model = create_model("Config", __base__=RunConfig, __module__=__name__, **fields)
    model.__doc__ = "A run's configuration: the generic sections plus one section per registered method."
    return model


def config_model() -> type[RunConfig]:
    """The run configuration model for the methods registered now (each method's section is a
    top-level key); rebuilt when a method is registered after import (a plug-in or a test)."""
    return _config_model(_method_sections())


if TYPE_CHECKING:
    Config = RunConfig
else:
    Config = config_model()
    """The configuration model of the built-in methods."""
