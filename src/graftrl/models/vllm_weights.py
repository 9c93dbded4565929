"""The policy's weights as a vLLM engine takes them (``rollout_vllm``): each tied tensor once, in
the names and groups ``save_pretrained`` writes, a checkpoint folder to start the engine from, and
the worker-side in-place reload after every update (vLLM's ``reload_weights``, plus the step a
tied ``lm_head`` needs). Importing this module does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graftrl.models.policy import Policy


def unique_tensors(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """The model's state in its own names, each shared (tied) tensor once, as save_pretrained.

    A tied ``lm_head.weight`` is the embedding itself: it is sent once, under the embedding's name.
    """
    seen: set[tuple[int, int]] = set()
    out = []
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, tensor.detach()))
    return out


def checkpoint_names(
    model: torch.nn.Module, weights: Sequence[tuple[str, Tensor]]
) -> list[tuple[str, Tensor]]:
    """``weights`` as ``save_pretrained`` names and groups them (what vLLM loads): transformers'
    reverse of its load conversions (GPT-NeoX's ``lm_head`` -> ``embed_out``; stacked experts ->
    one tensor each). The identity for an architecture transformers loads as it is stored."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(model, dict(weights)).items())


def save_for_engine(policy: Policy, folder: str) -> None:
    """A checkpoint vLLM can start from: config and weights (the engine reads no tokenizer).

    In a torch.distributed world, transformers' ``save_pretrained`` writes on rank 0 only, and
    every rank's engine needs its own copy (ranks may sit on different nodes): written directly.
    """
    if not torch.distributed.is_initialized():
        policy.save(folder)
        return
    import json

    from safetensors.torch import save_file

    config = policy.model.config.to_dict()
    config["architectures"] = [type(policy.model).__name__]
    Path(folder, "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    named = checkpoint_names(policy.model, unique_tensors(policy.model))
    tensors = {name: tensor.contiguous() for name, tensor in named}
    save_file(tensors, str(Path(folder, "model.safetensors")), metadata={"format": "pt"})


# ----- run on the vLLM worker (an object of this process) ---------------------------------------
def worker_model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def worker_reload_weights(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    # A tied lm_head shares the embedding's parameter, so the reload counts it as "not loaded"
    # and keeps what was derived from the old values: on CPU, the oneDNN-packed copy the logits
    # matmul reads. Re-deriving it is idempotent for embeddings (their weight stays in place).
    for module in worker_model(worker).modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
