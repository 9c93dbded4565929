"""What a compare cell was trained from: recorded when it starts, checked before anything of it is
continued or reused.

A cell's done marker holds one digest of its training inputs and its evaluation together, so a
rerun whose digest differs cannot tell by the marker alone whether the cell's training still is
the one asked for. ``RUN/cell.json`` (``RunDir.cell_inputs``), written when the cell starts, keeps
the two apart, by content, never by path:

- ``training``: graftrl's cell version, the config (without where it runs, its files named by
  content), the training data's SHA-256, each policy's starting weights' SHA-256, the validation
  benchmarks by content and each stored peer's store fingerprint;
- ``evaluation``: the digest of the evaluation (benchmarks, samples, length limit).

``changes`` names what differs between the record and a rerun's inputs, in words a user can act on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_VERSION = 1
"""The layout of ``cell.json`` (a record of another layout is treated as missing)."""

WEIGHTS = "starting weights of "
"""Prefix of a policy's entry in ``training`` (``starting weights of qwen``)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CellInputs:
    """A cell's inputs by content: what trains it and how it is evaluated."""

    training: dict[str, Any]
    """Label -> content: ``cell version``, ``config`` (a dict), ``data.train``,
    ``starting weights of NAME``, ``validation.files``, ``peers.NAME``."""
    evaluation: str
    """Digest of the evaluation's key."""

    @property
    def training_digest(self) -> str:
        return _digest(self.training)

    def to_json(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "training": self.training, "evaluation": self.evaluation}


def read_record(path: Path) -> CellInputs | None:
    """The inputs recorded in ``path``; None when missing, damaged or of another layout (the cell
    then cannot be shown to be this one, and starts over)."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
        return None
    training, evaluation = raw.get("training"), raw.get("evaluation")
    if not isinstance(training, dict) or not isinstance(evaluation, str):
        return None
    return CellInputs(training, evaluation)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as dotted keys (``train.steps``, ``policies.0.template``)."""
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, inner in items:
        flat.update(_flat(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat or {prefix: value}


def changes(recorded: CellInputs, now: CellInputs) -> list[str]:
    """What differs in the training inputs, in words: ``the starting weights of qwen``,
    ``data.train's content``, ``config keys train.steps, optim.lr``."""
    found = []
    for label in sorted(set(recorded.training) | set(now.training)):
        old, new = recorded.training.get(label), now.training.get(label)
        if old == new:
            continue
        if label == "config" and isinstance(old, dict) and isinstance(new, dict):
            flat_old, flat_new = _flat(old), _flat(new)
            keys = sorted(k for k in set(flat_old) | set(flat_new) if flat_old.get(k) != flat_new.get(k))
            found.append(f"config key{'s' if len(keys) > 1 else ''} {', '.join(keys)}")
        elif label.startswith(WEIGHTS):
            found.append(f"the {label}")
        elif label == "cell version":
            found.append("graftrl's cell version (a change in what a cell computes)")
        else:
            found.append(f"{label}'s content")
    return found
