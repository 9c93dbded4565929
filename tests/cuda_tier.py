"""Shared parts of the CUDA tier (tests/test_cuda.py): device and sizes, the figures file, the
random-init models, run configs and the numerical helpers. See tests/test_cuda.py for the tier.

Environment (read at import):

- ``GRAFTRL_CUDA_TIER_ON_CPU=1``: without CUDA, run the tier on CPU at tiny size (the dry run);
- ``GRAFTRL_CUDA_TIER_REQUIRE_CUDA=1``: fail, not skip, when torch sees no GPU (the GPU run);
- ``GRAFTRL_CUDA_TIER_SIZE=tiny``: the tiny sizes on CUDA too (a quick run);
- ``GRAFTRL_GPU_CHECK_OUT``: folder for ``cuda_tier.json``, the figures each test measured
  (written before the test asserts, so a failing check still reports its numbers);
- ``GRAFTRL_CUDA_TIER_MODELS``: folder to build the models in (kept; reused when present).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# cuBLAS picks deterministic workspaces only when told before its first handle (exact resume).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch
import yaml
from conftest import CONFIGS, FIXTURES

from graftrl.models.policy import Policy


def _tier_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("GRAFTRL_CUDA_TIER_ON_CPU") == "1":
        return "cpu"
    return None


DEVICE = _tier_device()
if DEVICE is None and os.environ.get("GRAFTRL_CUDA_TIER_REQUIRE_CUDA") == "1":  # the GPU run
    raise RuntimeError("GRAFTRL_CUDA_TIER_REQUIRE_CUDA=1 but torch sees no CUDA device")
CUDA = DEVICE == "cuda"


@dataclass(frozen=True)
class TierSize:
    """Model shapes and run sizes of the tier."""

    name: str
    qwen: dict[str, int]
    """Qwen2 (byte-level BPE of ``qwen_tokenizer_vocab`` tokens, the model's vocabulary padded to ``vocab``)."""
    llama: dict[str, int]
    """Llama with the character tokenizer."""
    small: dict[str, int] | None
    """Both architectures at this size for the FSDP and resume checks (None: the main pair)."""
    new_tokens: int
    """rollout.max_new_tokens of the GRPO / GRAFT / resume runs."""
    chunk: int
    """train.logprob_chunk_tokens where chunking is on."""
    paths_widths: tuple[int, ...]
    """Response widths of the rows of the log-prob path comparison (prompt widths follow)."""
    estimate: dict[str, int] = field(default_factory=dict)
    """The memory-estimate run: prompts, n, new tokens, micro-batch rows, micro-batch tokens."""


QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151_936}
FULL = TierSize(
    "full",
    qwen={**QWEN_05B, "tokenizer_vocab": 32_000, "positions": 4096},
    llama={"hidden": 1536, "layers": 20, "heads": 12, "kv_heads": 4, "intermediate": 4096, "positions": 4096},
    small={
        "hidden": 256,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 768,
        "tokenizer_vocab": 1000,
    },
    new_tokens=64,
    chunk=256,
    paths_widths=(1024, 700, 333, 1),
    estimate={"prompts": 8, "n": 4, "new_tokens": 256, "micro_rows": 8, "micro_tokens": 2048},
)
TINY = TierSize(
    "tiny",
    qwen={
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab": 2048,
        "tokenizer_vocab": 300,
        "positions": 512,
    },
    llama={"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "positions": 512},
    small=None,
    new_tokens=8,
    chunk=5,
    paths_widths=(24, 17, 6, 1),
    estimate={"prompts": 4, "n": 2, "new_tokens": 16, "micro_rows": 4, "micro_tokens": 96},
)
SIZE = FULL if CUDA and os.environ.get("GRAFTRL_CUDA_TIER_SIZE") != "tiny" else TINY
DTYPE = "bfloat16"  # on CPU too: CPU autocast runs the same bf16 code paths
# bf16 tolerances of one model path against another (same weights, same inputs).
LOGP_ATOL = 0.05
"""Per-token log-prob difference (nats): bf16 rounds logits to ~3 significant digits."""
GRAD_REL = 0.05
"""Relative L2 error of a parameter's gradient against the plain path's."""


# ----- figures ------------------------------------------------------------------------------------
class Figures:
    """Figures per test, rewritten to GRAFTRL_GPU_CHECK_OUT/cuda_tier.json after every record."""

    def __init__(self) -> None:
        folder = os.environ.get("GRAFTRL_GPU_CHECK_OUT")
        self.path = Path(folder) / "cuda_tier.json" if folder else None
        self.data: dict[str, Any] = {"device": None, "size": SIZE.name, "tests": {}}

    def record(self, test: str, **values: Any) -> None:
        self.data["device"] = self.data["device"] or device_info()
        self.data["tests"].setdefault(test, {}).update(values)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2, default=str))


def device_info() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "device": DEVICE,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


FIGURES = Figures()
"""The tier's figures (one file for the whole session)."""


# ----- models -------------------------------------------------------------------------------------
def _corpus(seed: int, lines: int) -> list[str]:
    """Generated text for the BPE tokenizer: pseudo-words and sums, as in benchmarks/gpu_step.py."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(4 * lines)]
    return [
        " ".join(rng.choice(words) for _ in range(30)) + f" {rng.randint(0, 999)}+{rng.randint(0, 99)}="
        for _ in range(lines)
    ]


def build_model(folder: Path, arch: str, shape: dict[str, int]) -> Path:
    """A random-init model + its tokenizer saved with save_pretrained (bf16 on disk); reused if present."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from graftrl.embedded.models import build_bpe_tokenizer, build_char_tokenizer

    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    if arch == "qwen2":
        vocab = shape["tokenizer_vocab"]
        tokenizer = build_bpe_tokenizer(_corpus(0, max(2000, vocab // 2)), vocab_size=vocab)
        config_class, model_class = Qwen2Config, Qwen2ForCausalLM
    else:
        tokenizer = build_char_tokenizer()
        config_class, model_class = LlamaConfig, LlamaForCausalLM
    config = config_class(
        # Qwen's vocabulary is wider than its tokenizer: ids past it decode to nothing.
        vocab_size=max(shape.get("vocab", 0), len(tokenizer)),
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape.get("positions", 1024),
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):  # initialised on the GPU: seconds, not a minute of CPU init
        model = model_class(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)  # loaded back as float32 master weights
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    (folder / "bench_model.json").write_text(
        json.dumps({"arch": arch, **shape, "vocab": config.vocab_size, "parameters": parameters})
    )
    return folder


def build_pair(root: Path, shapes: tuple[dict[str, int], dict[str, int]], prefix: str) -> dict[str, Path]:
    """``llama`` (character tokenizer) first, ``qwen`` (byte-level BPE) second, under ``root``."""
    return {
        "llama": build_model(root / f"{prefix}-llama", "llama", shapes[0]),
        "qwen": build_model(root / f"{prefix}-qwen", "qwen2", shapes[1]),
    }


def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("GRAFTRL_CUDA_TIER_MODELS")
    return Path(folder) if folder else tmp_path_factory.mktemp("cuda_models")


def two_policy_config(paths: dict[str, Path], method: str, steps: int = 2) -> dict[str, Any]:
    """Both policies in bf16 on the tier's device; 4 prompts x n = 4 per step (CROSSED's shape)."""
    return {
        "method": method,
        "seed": 3,
        "policies": [
            {"name": name, "path": str(path), "template": "{problem}=", "dtype": DTYPE, "device": DEVICE}
            for name, path in paths.items()
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        # Eager sampling: a fresh model object compiles its decode step anew (tens of seconds on
        # the GPU), which 64-token rollouts do not repay; tests/test_cuda_decode.py checks that path.
        "rollout": {"n": 4, "max_new_tokens": SIZE.new_tokens, "max_batch_size": 16, "compile": False},
        "train": {"steps": steps, "batch_prompts": 4, "minibatch_prompts": 2, "micro_batch_size": 8},
        "optim": {"lr": 1e-5},
        "graft": {"balance": False},  # every candidate moves: llama admits qwen's responses
        "logging": {"progress": False, "log_samples": 1},
        "checkpoint": {"every": 0},
    }


def scale_config(paths: dict[str, Path]) -> dict[str, Any]:
    """configs/pair1-graft-4gpu.yaml on the tier's pair: its method and train settings (gradient
    checkpointing, chunked log-probs, token-sized micro-batches), at a size that runs in seconds."""
    raw = yaml.safe_load((CONFIGS / "pair1-graft-4gpu.yaml").read_text())
    base = two_policy_config(paths, raw["method"])
    raw.pop("validation", None)
    prompt_and_response = 64 + SIZE.new_tokens
    raw.update(
        policies=base["policies"],  # one rank each (one GPU); no chat template in these tokenizers
        data=base["data"],
        logging=base["logging"],
        checkpoint=base["checkpoint"],
        rollout={**raw["rollout"], **base["rollout"]},
        graft={**raw["graft"], **base["graft"]},
        train={
            **raw["train"],
            **base["train"],
            "logprob_chunk_tokens": max(1, SIZE.new_tokens // 4),  # several chunks per response
            "micro_batch_tokens": 4 * prompt_and_response,  # several micro-batches per minibatch
        },
    )
    assert raw["train"]["gradient_checkpointing"] is True
    return raw


def no_final_checkpoint(monkeypatch) -> None:
    """A run always checkpoints its last step; at ~0.5B that is 6 GB per policy (weights and AdamW
    state, hashed into the manifest): left out where the test is about the steps (the resume test
    checkpoints)."""
    from graftrl.training.trainer_checkpoints import TrainerCheckpoints

    monkeypatch.setattr(TrainerCheckpoints, "save", lambda self, step: None)


def step_figures(run: Path) -> dict[str, Any]:
    from graftrl.storage.rundir import read_metrics

    keys = ("time_rollout", "time_update", "time_peer_logprob", "time_step", "memory_peak_mb")
    keys += ("train_tokens", "peer_responses", "peer_admitted", "loss", "grad_norm", "optimizer_steps")
    out: dict[str, Any] = {}
    for row in read_metrics(run):
        out.setdefault(row["model"], []).append({k: row.get(k) for k in keys if k in row})
    return out


def peak_and_grads(
    policy: Policy, batch, upstream
) -> tuple[torch.Tensor, dict[str, torch.Tensor], float | None]:
    """One forward + backward of sum(logp * upstream): log-probs, gradients, peak MB above the start."""
    policy.model.zero_grad(set_to_none=True)
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    logp = policy.response_logprobs(batch)
    (logp * upstream).sum().backward()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if CUDA else None
    grads = {n: p.grad.detach().float().clone() for n, p in policy.model.named_parameters()}
    return logp.detach(), grads, peak


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale > 0 else float((a - b).norm())


def gradient_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How far ``grads`` are from ``reference``: the relative L2 error of the whole gradient, and the
    largest per-parameter error relative to max(its own norm, its share of the whole norm), so a
    parameter whose exact gradient is ~0 (a key bias: softmax ignores a shift shared by all keys)
    is judged against the model's gradient scale, not its own rounding noise."""
    total = sum(g.numel() for g in reference.values())
    scale = float(torch.sqrt(sum((g.double() ** 2).sum() for g in reference.values())))
    whole_error = float(torch.sqrt(sum(((grads[n] - g).double() ** 2).sum() for n, g in reference.items())))
    worst, worst_name = 0.0, ""
    for name, g in reference.items():
        floor = max(float(g.norm()), scale * (g.numel() / total) ** 0.5)
        error = float((grads[name] - g).norm()) / floor if floor > 0 else 0.0
        if error > worst:
            worst, worst_name = error, name
    return {
        "whole": whole_error / scale if scale > 0 else whole_error,
        "worst": worst,
        "worst_parameter": worst_name,
    }


# ----- FSDP2 on one rank --------------------------------------------------------------------------
@contextlib.contextmanager
def one_rank_group(folder: Path):
    """A process group of one rank in this process: NCCL on the GPU, else gloo."""
    import torch.distributed as dist

    if CUDA:
        torch.cuda.set_device(0)
    backend = "nccl" if CUDA else "gloo"
    dist.init_process_group(backend, init_method=f"file://{folder / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def deterministic_kernels():
    """CUDA kernels that give the same bits when a step is recomputed (math attention,
    deterministic algorithms); CPU kernels already do."""
    if not CUDA:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a sharded parameter or gradient), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train_step(policy: Policy, prompts, responses, advantages) -> dict[str, Any]:
    """One optimizer step on a token-mean policy-gradient loss, as training.update.optimize takes it."""
    batch = policy.pad(prompts, responses)
    upstream = torch.tensor(advantages, device=policy.device)[:, None] * batch.response_mask
    policy.model.train()
    assert policy.optimizer is not None
    policy.optimizer.zero_grad(set_to_none=True)
    logp = policy.response_logprobs(batch)
    loss = -(logp * upstream).sum() / batch.response_mask.sum()
    loss.backward()
    norm = whole(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0))
    grads = {n: whole(p.grad).detach().float().cpu() for n, p in policy.model.named_parameters()}
    policy.optimizer.step()
    return {
        "logp": logp.detach().float()[batch.response_mask].cpu(),
        "loss": float(loss.detach()),
        "grad_norm": float(norm),
        "grads": grads,
    }


def optimizer_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, state = get_state_dict(policy.model, policy.optimizer)
    return {
        f"{name}.{key}": whole(value).detach().cpu()
        for name, values in state["state"].items()
        for key, value in values.items()
        if isinstance(value, torch.Tensor)
    }


# ----- the memory estimate ------------------------------------------------------------------------
class MixedRewards:
    """0, 1, 0, 1, ... in every group: every row has an advantage, so every micro-batch is full."""

    def score(self, responses, answers) -> list[float]:
        return [float(i % 2) for i in range(len(responses))]

    def close(self) -> None:
        pass
