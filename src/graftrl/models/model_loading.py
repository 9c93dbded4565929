"""Loading a checkpoint's model safely: the folder checked first, one-line errors naming the fix,
weights checked finite, dropout zeroed for RL, the device resolved."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from graftrl.errors import ModelError

DROPOUT_SUFFIXES = ("dropout", "pdrop")
"""Float attributes of a module whose names end so are dropout probabilities read at forward time
(Llama-style attention's ``attention_dropout``, OPT's ``dropout``, ...)."""


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A model folder holding none of these has no tokenizer (``AutoTokenizer`` needs one of them)."""


def check_model_folder(name: str, path: str) -> None:
    """Refuse a policy path that is neither a model folder nor (online) a plausible hub id."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelError(
                f"policy {name!r}: {path} has no config.json, so it is not a Hugging Face model folder; "
                "point policies[].path at the folder `save_pretrained` wrote"
            )
        if not any((folder / file).is_file() for file in TOKENIZER_FILES):
            raise ModelError(
                f"policy {name!r}: cannot load a tokenizer from {path}: none of {', '.join(TOKENIZER_FILES)} "
                "is there; save the tokenizer into the model folder (tokenizer.save_pretrained)"
            )
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ) not in ("", "0")
    looks_like_path = path.startswith(("/", ".", "~")) or path.count("/") != 1 or folder.exists()
    if offline or looks_like_path:
        raise ModelError(
            f"policy {name!r}: model folder {path} does not exist; fix policies[].path (a local folder "
            "written by `save_pretrained`, or a hub id such as org/name when online)"
        )


def check_finite_weights(name: str, path: str, model: torch.nn.Module) -> None:
    """Refuse weights holding NaN or inf, naming the first such tensor: sampling from them would
    fail deep inside ``torch.multinomial`` and training would only spread them."""
    for tensor_name, value in model.state_dict().items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ModelError(
                f"policy {name!r}: weight {tensor_name!r} in {path} holds NaN or inf; the checkpoint is "
                "damaged or diverged: point policies[].path at an earlier or re-exported checkpoint"
            )


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_causal_lm(
    name: str, path: str, param_dtype: torch.dtype, attn_implementation: str | None = None
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained``; what fails to load is a ModelError naming the field."""
    attention = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=param_dtype, **attention)
    except (OSError, ValueError, ImportError) as error:
        # transformers refuses an unknown or unavailable kernel with a ValueError / ImportError
        if attention and (isinstance(error, ImportError) or "attn" in str(error)):
            raise ModelError(
                f"policy {name!r}: attn_implementation {attn_implementation!r} does not load here "
                f"({first_line(error)}); set policies[].attn_implementation to one this model and "
                "machine support (`sdpa`, `eager`), or leave it unset for transformers' default"
            ) from None
        if isinstance(error, ImportError):
            raise
        raise ModelError(
            f"policy {name!r}: cannot load a causal LM from {path} ({first_line(error)}); give the folder "
            "of a Hugging Face checkpoint (config.json + *.safetensors)"
        ) from None


def zero_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 (``nn.Dropout`` modules and the float
    probabilities attention modules apply themselves); returns how many were above 0.

    The update runs the model in training mode while the rollout sampled in eval mode: with dropout
    on, the trainer's log-probs of the very policy that sampled would differ from the behaviour
    log-probs, so on-policy ratios would not be 1 (GPT-2 checkpoints ship with 0.1). The model's
    config is left as it is, so a saved checkpoint keeps its own values.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
        for attribute, value in list(vars(module).items()):
            if isinstance(value, float) and attribute.endswith(DROPOUT_SUFFIXES):
                changed += value > 0
                setattr(module, attribute, 0.0)
    return changed
