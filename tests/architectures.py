"""Tiny random decoder LMs of many transformers architectures, built from their configs (no hub).

Each is a ``save_pretrained`` folder (hidden 16, 2 layers, a few thousand parameters) with the
embedded task's character tokenizer, so a test can train any of them for a few steps in a second.
The list is every decoder-only causal LM of the installed transformers that builds this small
from ``AutoConfig.for_model`` with the shared sizes below (plus the few keys an architecture
sizes differently); architectures whose checkpoints name weights differently from the model in
memory (GPT-NeoX's ``embed_out``, the mixtures of experts' per-expert tensors) are the point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import FIXTURES

MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
"""Mixture-of-experts sizes (each config reads the names it knows)."""

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gpt2": {},
    "gpt_neox": {},  # saved as embed_out.weight, lm_head.weight in memory
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "phi": {},
    "phi3": {},
    "mistral": {},
    "olmo": {},
    "olmo2": {},
    "olmo3": {},
    "stablelm": {},
    "starcoder2": {},
    "cohere": {},
    "cohere2": {},
    "granite": {},
    "gptj": {"rotary_dim": 4},  # its default 64 exceeds the head size
    "codegen": {"rotary_dim": 4},
    "falcon": {},
    "gpt_bigcode": {},
    "smollm3": {},
    "helium": {"head_dim": 8},
    "glm": {},
    "glm4": {},
    "exaone4": {},
    "seed_oss": {},
    "nemotron": {},
    "persimmon": {},
    "opt": {"ffn_dim": 32, "word_embed_proj_dim": 16},
    "mixtral": MOE,  # experts stacked in memory, one tensor per expert on disk
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 16},
    "qwen3_moe": MOE,
    "olmoe": MOE,
    "phimoe": MOE,
    "granitemoe": MOE,
}
"""model_type -> config keys beyond the shared sizes."""

DEFAULT_TIER = (
    "llama", "qwen2", "qwen3", "gpt2", "gpt_neox", "gemma2", "phi3", "mistral", "olmo2", "mixtral",
)  # fmt: skip
"""The architectures the default tier resumes (issue 46's list: about a second each); the slow
tier takes the rest of ``ARCHITECTURES``."""


def build_architecture(model_type: str, folder: Path, pad_token: bool = True) -> Path:
    """A tiny random ``model_type`` model and the character tokenizer, saved in ``folder``.
    ``pad_token`` False: the tokenizer has none (as many released tokenizers), so graftrl pads
    with its eos."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from graftrl.embedded.models import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if not pad_token:
        tokenizer.pad_token = None
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **ARCHITECTURES[model_type],
    )  # fmt: skip
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


MIXED = [[[1, 0], [0, 1]]]
"""Every group mixed on every step: each step trains every row (real updates to compare)."""


def one_policy_config(path: Path, steps: int) -> dict:
    """GRPO on one tiny policy: 2 prompts x 2 samples of 4 tokens a step, a checkpoint each step."""
    return {
        "method": "grpo",
        "seed": 3,
        "policies": [{"name": "policy", "path": str(path), "template": "{problem}="}],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 2, "max_new_tokens": 4},
        "train": {"steps": steps, "batch_prompts": 2, "minibatch_prompts": 1, "micro_batch_size": 4},
        "optim": {"lr": 1e-2},
        "checkpoint": {"every": 1, "keep_last": 2},
        "logging": {"progress": False},
    }
