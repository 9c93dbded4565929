"""Loading a checkpoint's model safely: the folder checked first, one-line errors naming the fix,
weights checked finite, dropout zeroed for RL, the device resolved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from graftrl.errors import ModelError, is_out_of_memory
from graftrl.files import hub_id_like

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
    looks_like_path = not hub_id_like(path) or folder.exists()
    if offline or looks_like_path:
        raise ModelError(
            f"policy {name!r}: model folder {path} does not exist; fix policies[].path (a local folder "
            "written by `save_pretrained`, or a hub id such as org/name when online)"
        )


JSON_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "model.safetensors.index.json",
)
"""The JSON files of a model folder that loading reads (generation_config.json is not used)."""

_REFETCH = "re-copy or re-save the folder (save_pretrained), or point policies[].path at an intact copy"


def _json_problem(path: Path) -> str | None:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        return f"not UTF-8 text (byte {error.start})"
    except json.JSONDecodeError as error:
        return f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
    return None if isinstance(value, dict) else "not a JSON object"


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing (None when intact): the 8-byte header length,
    the JSON header, and the tensor data's extent against the file size. Cheap (the header only), so
    a truncated or overwritten file is named before a loader fails deep inside with its own error."""
    size = path.stat().st_size
    if size < 8:
        return f"{size} bytes: shorter than a safetensors header (empty or truncated)"
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length > size - 8:
            return f"its header claims {length} bytes, the file holds {size} (truncated or not safetensors)"
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError):
        return "its header is not a valid safetensors header (overwritten or not safetensors)"
    data = size - 8 - length
    if max(ends, default=0) != data:
        return f"its tensors need {max(ends, default=0)} bytes of data, the file holds {data} (truncated or extended)"
    return None


def check_model_files(name: str, path: str) -> None:
    """Refuse, naming the file, a model folder whose JSON files or safetensors framing are damaged
    (truncated, emptied, overwritten): transformers and safetensors would fail with tracebacks that
    do not say which file, or misattribute it (a broken config.json reads as a tokenizer error)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    for file in [folder / n for n in JSON_FILES] + sorted(folder.glob("*.safetensors")):
        if not file.is_file():
            continue
        problem = safetensors_problem(file) if file.suffix == ".safetensors" else _json_problem(file)
        if problem:
            raise ModelError(f"policy {name!r}: {file}: {problem}; {_REFETCH}")


def load_failure(name: str, path: str, what: str, error: BaseException) -> ModelError:
    """A library's error while loading a model folder, as one line naming the folder and the fix."""
    return ModelError(
        f"policy {name!r}: cannot load {what} from {path} ({type(error).__name__}: {first_line(error)}); "
        f"{_REFETCH}"
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


def attention_kwargs(attn_implementation: str | None) -> dict[str, str]:
    """What loading passes to transformers for ``policies[].attn_implementation``: the same for a
    real load and the memory estimate's meta-device build, so both resolve the same kernel (None:
    the model's own default, e.g. eager for Gemma 2)."""
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def attention_error(name: str, attn_implementation: str | None, error: BaseException) -> ModelError:
    """A kernel transformers refuses for this model or machine, as one line naming the field."""
    return ModelError(
        f"policy {name!r}: attn_implementation {attn_implementation!r} does not load here "
        f"({first_line(error)}); set policies[].attn_implementation to one this model and "
        "machine support (`sdpa`, `eager`), or leave it unset for transformers' default"
    )


def load_causal_lm(
    name: str, path: str, param_dtype: torch.dtype, attn_implementation: str | None = None
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained``; what fails to load is a ModelError naming the field."""
    attention = attention_kwargs(attn_implementation)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=param_dtype, **attention)
    except Exception as error:  # safetensors, tokenizers and torch raise their own types
        if is_out_of_memory(error):
            raise
        # transformers refuses an unknown or unavailable kernel with a ValueError / ImportError
        if attention and (isinstance(error, ImportError) or "attn" in str(error)):
            raise attention_error(name, attn_implementation, error) from None
        if isinstance(error, ImportError):
            raise
        raise load_failure(name, path, "a causal LM (config.json + *.safetensors)", error) from None


def checkpoint_weights(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """A ``save_pretrained`` folder's weights on CPU under the names of ``model``'s own state dict.

    Read by transformers' own loading, not by the file's raw keys: ``save_pretrained`` writes the
    architecture's on-disk layout, which differs from the model in memory wherever transformers
    renames or regroups weights on load (GPT-NeoX's ``embed_out`` is ``lm_head``; a mixture of
    experts stores one tensor per expert and stacks them). Loaded in the dtype of ``model``'s
    parameters, which ``save_pretrained`` kept, so the values are the saved bits. A checkpoint
    that does not fit the architecture (a missing, unexpected or reshaped weight) is refused in
    one line rather than loaded with transformers' random init for the gaps (a ModelError, not a
    CheckpointError: a resume treats an unverifiable legacy checkpoint that fails so as damaged)."""
    dtype = next(model.parameters()).dtype
    loaded, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    problems = [
        f"{what} {', '.join(sorted(keys)[:3])}{' ...' if len(keys) > 3 else ''}"
        for what, keys in (
            ("missing", info["missing_keys"]),
            ("unexpected", info["unexpected_keys"]),
            ("reshaped", {key[0] for key in info["mismatched_keys"]}),
        )
        if keys
    ]
    if problems:
        raise ModelError(
            f"checkpoint {folder}: its weights do not fit the {type(loaded).__name__} they load into "
            f"({'; '.join(problems)}); resume with the model the run was trained from"
        )
    return {name: value.detach() for name, value in loaded.state_dict().items()}


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


def load_tokenizer(name: str, path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, its files checked first (``check_model_files``); any
    failure is one line naming the folder. Every model folder graftrl loads comes through here."""
    check_model_folder(name, path)
    check_model_files(name, path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # tokenizers raises plain Exceptions
        if is_out_of_memory(error):
            raise
        raise load_failure(
            name,
            path,
            "a tokenizer (tokenizer.json / tokenizer_config.json, as save_pretrained writes)",
            error,
        ) from None


def model_context(name: str, path: str) -> int | None:
    """Positions a model folder's model attends over (``max_position_embeddings``, GPT-2's
    ``n_positions``), from its config.json alone: no weights loaded."""
    from transformers import AutoConfig

    check_model_folder(name, path)
    check_model_files(name, path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        raise load_failure(name, path, "the model config (config.json)", error) from None
    return context_of(config)


def context_of(config: object) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
