"""Reading a run configuration: YAML files, ``--set KEY=VALUE`` overrides, one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from graftrl.config.schema import Config, config_model
from graftrl.errors import UserError


class ConfigError(UserError):
    """A configuration problem, described with the offending key and what to do."""


def minibatch_note(config: Config) -> str | None:
    """How a remainder of `batch_prompts` over `minibatch_prompts` is trained (None: it divides)."""
    batch, minibatch = config.train.batch_prompts, config.train.minibatch_prompts
    if batch % minibatch == 0:
        return None
    return (
        f"train.batch_prompts ({batch}) is not a multiple of train.minibatch_prompts ({minibatch}): "
        f"each epoch's last optimizer step takes the remaining {batch % minibatch} group(s)"
    )


def _format_validation_error(error: ValidationError, source: str) -> str:
    """One line: the file, then every offending key with what is wrong."""
    parts = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            parts.append(
                f"{key}: unknown key (check the spelling; `graftrl config-reference` lists every field)"
            )
        else:
            message = str(item["msg"]).removeprefix("Value error, ")
            parts.append(message if key == "<root>" else f"{key}: {message}")
    return f"invalid config {source}: " + "; ".join(parts)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.steps=10' -> (['train', 'steps'], 10); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.steps=10")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value)


def _list_index(node: list[Any], part: str, text: str, where: str) -> int:
    """``part`` as an index into the list at ``where``, or a ConfigError naming both."""
    try:
        index = int(part)
    except ValueError:
        index = None
    if index is None or not 0 <= index < len(node):
        raise ConfigError(
            f"--set {text!r}: {where} is a list of {len(node)}; use an index 0..{len(node) - 1} "
            f"(got {part!r}), e.g. --set {where}.0.<key>=VALUE"
        )
    return index


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = raw
        for i, part in enumerate(path):
            where = ".".join(path[:i]) or "<top level>"
            if not isinstance(node, dict | list):
                raise ConfigError(f"--set {text!r}: {where} is not a section")
            if i == len(path) - 1:
                if isinstance(node, list):
                    node[_list_index(node, part, text, where)] = value
                else:
                    node[part] = value
            elif isinstance(node, list):
                node = node[_list_index(node, part, text, where)]
            else:
                node = node.setdefault(part, {})
    return raw


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return config_model().model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} {'is a folder' if path.is_dir() else 'does not exist'}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {error.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return config_from_dict(apply_overrides(raw, overrides or []), str(path))


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
