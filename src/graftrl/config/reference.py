"""The configuration reference: every field with its default and docstring (`graftrl config-reference`)."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from graftrl.config.peers import PeerConfig, PeerSettings
from graftrl.config.schema import config_model


def config_reference(model: type[BaseModel] | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, description) for every field, once each, for `graftrl config-reference`.

    Descriptions are field docstrings folded onto one line (a table row each).
    """
    model = model or config_model()
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        description = " ".join((field.description or "").split())
        annotation = field.annotation
        item = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None
        if typing.get_origin(item) is typing.Annotated:
            item = typing.get_args(item)[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append((key, "", description))
            rows += config_reference(annotation, key + ".")
        elif item is PeerSettings:  # the union of the built-in kinds, each field once
            rows.append((key, "required" if field.is_required() else "", description))
            kinds = [
                row for kind in typing.get_args(PeerConfig) for row in config_reference(kind, key + "[].")
            ]
            rows += [row for i, row in enumerate(kinds) if row[0] not in {r[0] for r in kinds[:i]}]
        elif isinstance(item, type) and issubclass(item, BaseModel):
            rows.append((key, "required" if field.is_required() else "", description))
            rows += config_reference(item, key + "[].")
        else:
            rows.append((key, "required" if field.is_required() else repr(field.default), description))
    return rows


def config_reference_markdown() -> str:
    """docs/config.md's table (`graftrl config-reference --markdown`): one line per field.

    A `|` inside a cell is escaped, so a description cannot split its row.
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| key | default | description |", "|---|---|---|"]
    for key, default, description in config_reference():
        lines.append(f"| `{key}` | {f'`{cell(default)}`' if default else ''} | {cell(description)} |")
    return "\n".join(lines) + "\n"
