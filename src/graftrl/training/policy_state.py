"""One policy's part of a checkpoint: weights, tokenizer, optimizer state and update state.

One device: a ``save_pretrained`` folder plus ``optimizer.pt``. Data parallelism: the weights and
AdamW state go to ``DCP_FOLDER`` as a sharded torch.distributed.checkpoint (each rank writes its
shards; loadable on any number of ranks), and rank 0 also writes the plain ``save_pretrained``
folder that evaluation reads. A checkpoint of either kind loads into either layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from graftrl.errors import ModelError
from graftrl.models.model_loading import checkpoint_weights
from graftrl.models.policy import Policy
from graftrl.training.parallel import full_state_dict
from graftrl.training.update import NonfiniteGuard, Ranks

DCP_FOLDER = "dcp"
"""A policy checkpoint's sharded weights + optimizer state (torch.distributed.checkpoint)."""

UPDATE_STATE = "update_state.json"
"""A policy checkpoint's in-process update state: which parameters hold a gradient tensor (so a
minibatch with no trained row steps AdamW exactly as it would have in the uninterrupted process)
and the count of non-finite optimizer steps in a row."""

OPTIMIZER_FILE = "optimizer.pt"


def save_state(policy: Policy, folder: str | Path, guard: NonfiniteGuard, ranks: Ranks) -> None:
    """Weights and tokenizer (save_pretrained), optimizer state and update state into ``folder``
    (a collective under data parallelism: every rank calls it)."""
    folder = Path(folder)
    if ranks.world == 1 or ranks.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / UPDATE_STATE).write_text(json.dumps(update_state(policy, guard)))
    if ranks.world == 1:
        policy.save(str(folder))
        assert policy.optimizer is not None
        torch.save(policy.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(policy.model, policy.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / DCP_FOLDER)
    save_weights(policy, folder, ranks)


def save_weights(policy: Policy, folder: str | Path, ranks: Ranks) -> None:
    """Weights and tokenizer only (best-checkpoint copies, exports): a plain save_pretrained
    folder, gathered on rank 0 when the model is sharded."""
    if ranks.world == 1:
        policy.save(str(folder))
        return
    weights = full_state_dict(policy.model)
    if ranks.rank == 0:
        model = policy.model
        model.save_pretrained(str(folder), state_dict=weights)
        policy.save_tokenizer(str(folder))
        # The sharded model's class is FSDP<Name>; the folder names the plain architecture.
        config_file = Path(folder) / "config.json"
        config = json.loads(config_file.read_text())
        config["architectures"] = [type(model).__mro__[1].__name__]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    dist.barrier()


def load_state(policy: Policy, folder: str | Path, guard: NonfiniteGuard, ranks: Ranks) -> None:
    """Weights, optimizer state and update state from a ``save_state`` folder written with any
    number of ranks (a sharded checkpoint is resharded to this run's N)."""
    folder = Path(folder)
    if (folder / DCP_FOLDER).is_dir():
        _load_sharded(policy, folder / DCP_FOLDER)
    elif ranks.world == 1:
        _load_plain(policy, folder)
    else:
        _load_plain_into_shards(policy, folder)
    restore_update_state(policy, folder / UPDATE_STATE, guard)


def update_state(policy: Policy, guard: NonfiniteGuard) -> dict[str, Any]:
    """What the update keeps in this process besides weights and AdamW state (``UPDATE_STATE``).

    A parameter's gradient is None until the process's first backward reaches it and a zero
    tensor after every ``zero_grad(set_to_none=False)``; AdamW skips a None gradient but steps
    on a zero one (weight decay, moments). A minibatch whose rows all have zero advantage runs
    no backward, so whether it moves the weights depends on this state, which a resumed
    process must restore."""
    return {
        "gradients": [name for name, p in policy.model.named_parameters() if p.grad is not None],
        "nonfinite_in_row": guard.in_row,
    }


def restore_update_state(policy: Policy, path: Path, guard: NonfiniteGuard) -> None:
    """Gradients as the saving process held them (zero tensors where it held one; between
    steps every gradient is zero). A checkpoint written before ``UPDATE_STATE`` existed: a
    parameter with AdamW state has had a gradient (AdamW creates its state on one)."""
    optimizer = policy.optimizer
    assert optimizer is not None
    if path.is_file():
        state = json.loads(path.read_text())
        held = set(state["gradients"])
        guard.in_row = int(state.get("nonfinite_in_row", 0))
    else:
        held = {name for name, p in policy.model.named_parameters() if optimizer.state.get(p)}
    for name, p in policy.model.named_parameters():
        p.grad = torch.zeros_like(p) if name in held else None


def _check_keys(policy: Policy, folder: Path, weights: dict[str, Tensor]) -> None:
    # checkpoint_weights already names the model's own keys; a sharded model's must match too.
    expected = set(policy.model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ModelError(
            f"checkpoint {folder}: its weights do not fit the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); resume with the model the run was trained from"
        )


def _load_plain(policy: Policy, folder: Path) -> None:
    weights = checkpoint_weights(policy.model, folder)
    _check_keys(policy, folder, weights)
    policy.model.load_state_dict(weights)
    assert policy.optimizer is not None
    policy.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))


def _load_plain_into_shards(policy: Policy, folder: Path) -> None:
    """A one-device checkpoint (safetensors + optimizer.pt) into this run's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    weights = checkpoint_weights(policy.model, folder)
    _check_keys(policy, folder, weights)
    names = [name for name, _ in policy.model.named_parameters()]
    # optimizer.pt numbers parameters in model.parameters() order; DCP names them.
    raw = torch.load(folder / OPTIMIZER_FILE, weights_only=True)
    optimizer_state = {
        "state": {names[i]: value for i, value in raw["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in raw["param_groups"]
        ],
    }
    set_state_dict(
        policy.model,
        policy.optimizer,
        model_state_dict=weights,
        optim_state_dict=optimizer_state,
        options=StateDictOptions(full_state_dict=True, strict=False),
    )


def _load_sharded(policy: Policy, checkpoint: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(policy.model, policy.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(
        policy.model, policy.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
