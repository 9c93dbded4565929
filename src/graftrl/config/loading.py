"""Reading a run configuration: YAML files, ``--set KEY=VALUE`` overrides, one-line errors."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from graftrl.config.schema import Config, config_model
from graftrl.errors import UserError
from graftrl.files import hub_id_like
from graftrl.storage.data import PROBLEM_SUFFIXES


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


def _resolved(value: Any, folder: Path, hub_id: bool = False) -> Any:
    """One path field of a config file in ``folder``: a relative path names ``folder / value``
    (made absolute, so the run's config.yaml names it from anywhere) when that exists; else, as
    configs were read before, the path from the current directory when that exists; else
    ``folder / value``, so the error that it is missing names the path looked for. ``hub_id``:
    a missing ``org/name`` stays a hub id."""
    if not isinstance(value, str) or not value or value.startswith("~") or Path(value).is_absolute():
        return value
    candidate = Path(os.path.abspath(folder / value))
    if candidate.exists():
        return str(candidate)
    if Path(value).exists() or (hub_id and hub_id_like(value)):
        return value
    return str(candidate)


def _resolved_spec(spec: Any, folder: Path) -> Any:
    """A ``validation.files`` list entry: ``NAME=PATH`` or ``PATH`` resolved as a path when it names
    a local file (a data suffix, or a file there); a built-in or hub name as written."""
    if not isinstance(spec, str):
        return spec
    name, sep, value = spec.partition("=")
    target = value.strip() if sep else spec.strip()
    local = target.lower().endswith(PROBLEM_SUFFIXES) or (folder / target).is_file() or Path(target).is_file()
    if not local:
        return spec
    return f"{name.strip()}={_resolved(target, folder)}" if sep else _resolved(target, folder)


def resolve_paths(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``raw`` (a config file's mapping) with every path field resolved against the file's
    ``folder``, as YAML users expect (``_resolved``): ``policies[].path``, ``data.train``,
    ``validation.files``, ``peers[].path`` and ``store.path``. A config in the current directory
    is returned as it is."""
    if folder.resolve() == Path.cwd().resolve():
        return raw
    raw = copy.deepcopy(raw)

    def entries(key: str) -> list[dict[str, Any]]:
        value = raw.get(key)
        return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) else []

    for policy in entries("policies"):
        if "path" in policy:
            policy["path"] = _resolved(policy["path"], folder, hub_id=True)
    for peer in entries("peers"):
        if "path" in peer:
            peer["path"] = _resolved(peer["path"], folder)
    for section, key in (("data", "train"), ("store", "path")):
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raw[section][key] = _resolved(raw[section][key], folder)
    validation = raw.get("validation")
    files = validation.get("files") if isinstance(validation, dict) else None
    if isinstance(files, dict):
        validation["files"] = {name: _resolved(path, folder) for name, path in files.items()}
    elif isinstance(files, list):
        validation["files"] = [_resolved_spec(spec, folder) for spec in files]
    return raw


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's mapping, its relative paths resolved against its folder (``resolve_paths``);
    a missing, non-UTF-8, non-YAML or non-mapping file is a ConfigError naming it."""
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
    return resolve_paths(raw, path.parent)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """The validated config of a YAML file (``read_config_file``) with ``--set`` overrides applied
    after its paths are resolved (an override's path is the command line's: the current directory's)."""
    raw = read_config_file(path)
    return config_from_dict(apply_overrides(raw, overrides or []), str(path))


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
