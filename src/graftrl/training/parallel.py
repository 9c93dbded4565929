"""Data parallelism inside one policy: the primitives a rank uses (FSDP2 sharding, collectives).

A policy with ``parallel.data: N > 1`` runs as N processes (ranks) that each hold a
``PolicyWorker`` and execute every call in lockstep (SPMD); the processes and the proxy the
trainer talks to are ``graftrl.training.ranks``. This module holds what the worker calls inside
a rank, and imports no worker.

Inside the ranks:

- the model is wrapped by ``fully_shard`` per transformer block, then at the root (as torchtitan
  and verl do), with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when the
  policy computes in bf16, float32 master weights and AdamW state sharded across the ranks;
- sampling and scoring (no gradient) run on the unsharded module (``gathered``): one all-gather
  per block, then every rank generates independently without collectives; with
  ``rollout.engine: vllm`` each rank holds a vLLM engine instead (external-launcher mode,
  ``rollout_vllm``), which takes the full weights gathered on every rank after each update;
- each minibatch's rows are dealt to the ranks by ``split_rows`` (token-balanced), every rank
  computes the loss of its rows over the *whole* minibatch's denominators (which every rank
  knows: each holds all rows), and the gradient is the sum over ranks — FSDP's reduce-scatter
  averages, so the loss is scaled by N first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


def split_rows(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Deal row indices to ``ranks`` ranks, balancing token counts; each rank's rows in input order.

    Greedy longest-first (LPT): the longest remaining row goes to the rank with the fewest tokens
    so far (ties: fewer rows, then lower rank). Rows are never cut into contiguous slices, so the
    peer rows of a minibatch spread over the ranks like any other rows. Pure and deterministic:
    every rank computes every rank's share without communicating.
    """
    tokens = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        rank = min(range(ranks), key=lambda k: (tokens[k], len(shares[k]), k))
        tokens[rank] += lengths[row]
        shares[rank].append(row)
    return [sorted(share) for share in shares]


def rank_device(device: str, rank: int) -> str:
    """The GPU of rank r: cuda:LOCAL_RANK, the index among the GPUs its process sees (torchrun's
    convention). Spawned ranks of a local run set it to r (they share the node's GPUs); a Ray rank
    sees only the GPU of its placement-group bundle, so it sets 0."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "auto":
        return f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return f"cuda:{local}"
    return device


def shard_model(model: torch.nn.Module, mixed_precision: torch.dtype | None) -> None:
    """FSDP2 in place: ``fully_shard`` on every transformer block (the classes HF lists in
    ``_no_split_modules``), then on the root (embeddings, final norm, LM head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh}
    if mixed_precision is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"parallel.data: {type(model).__name__} lists no transformer block class in "
            "`_no_split_modules`, so it cannot be sharded per block"
        )
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """The model's full parameters on every rank for no-grad work (generate, score).

    One all-gather per FSDP unit on entry (a collective: every rank enters together); inside,
    forwards run without collectives, so ranks may generate different prompts and lengths.
    """
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(model):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True)


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (on every rank)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sum_across_ranks(values: Sequence[float]) -> list[float]:
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def full_state_dict(model: torch.nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU: on rank 0 of a sharded model (other ranks get {}),
    else the model's own state. ``every_rank``: on every rank of a sharded model, on the model's
    device (a rollout engine per rank takes them); a collective either way."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    full = get_model_state_dict(model, options=options)
    # The gathered copies no longer share storage: drop the aliases of tied parameters (a tied LM
    # head), as save_pretrained does for the unsharded model (named_parameters lists each once).
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()
    }
    for name in aliases:
        full.pop(name, None)
    return full
