"""Matrices of `graftrl compare`: variants (a method and config overrides) x seeds, the presets
(``table1``, ``table2``, ``demo``, ``mastery``) and YAML matrix files.

A *matrix* is a list of variants, each ``{variant: NAME, method: METHOD, set: {dotted.key: value}}``;
a matrix file is YAML: either a list of variants or a mapping ``{variants: [...], baseline: NAME,
reference: NAME}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from graftrl.embedded.base import DEFAULT
from graftrl.errors import UserError
from graftrl.evaluation.stats import WARM_START
from graftrl.methods.hacpo import HACPO

_NAME = re.compile(r"^[A-Za-z0-9_.+\-]+$")


_ROW_FIELDS = {"variant", "method", "set"}


class CompareError(UserError):
    """A matrix or comparison problem; the message names the variant and what to fix."""


@dataclass(frozen=True)
class Variant:
    """One row of the matrix: a method and config overrides on the task's base config."""

    name: str
    method: str
    set: dict[str, Any] = field(default_factory=dict)
    """Dotted config key -> value, applied after the base config (and ``--steps``)."""

    def overrides(self) -> list[str]:
        """``KEY=VALUE`` strings for ``apply_overrides`` (values as YAML that reads back the same)."""
        return [f"{key}={yaml_value(value)}" for key, value in self.set.items()]


@dataclass(frozen=True)
class Matrix:
    variants: list[Variant]
    baseline: str | None = None
    """Table 1 deltas are against this variant (default: ``grpo-n8``, else the first grpo row)."""
    reference: str | None = None
    """Table 2 deltas are against this variant (default: ``graft``, else the first plain graft row)."""
    source: str = ""
    """Where the matrix came from (preset name or file), for the report."""

    @property
    def baseline_name(self) -> str | None:
        return self.baseline or _first(self.variants, "grpo-n8", "grpo", plain=False)

    @property
    def reference_name(self) -> str | None:
        return self.reference or _first(self.variants, "graft", "graft", plain=True)


def _first(variants: Sequence[Variant], name: str, method: str, plain: bool) -> str | None:
    """``name`` if a variant has it, else the first ``method`` variant (without overrides if ``plain``)."""
    names = [v.name for v in variants]
    if name in names:
        return name
    return next((v.name for v in variants if v.method == method and not (plain and v.set)), None)


def yaml_value(value: Any) -> str:
    """JSON is YAML, except that PyYAML reads ``1e-10`` (no dot) as a string: write ``1.0e-10``."""
    text = json.dumps(value)
    if isinstance(value, float) and re.fullmatch(r"-?\d+e[-+]?\d+", text):
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


PRESETS = ("table1", "table2", "demo", "mastery", "hint", "rule")


def preset_matrix(name: str, batch_prompts: int = DEFAULT.batch_prompts, policies: int = 2) -> Matrix:
    """A built-in matrix; ``batch_prompts`` and ``policies`` (the task's) size HACPO's minibatch."""
    if name == "table1":
        variants = [
            Variant("grpo-n8", "grpo"),
            Variant("grpo-n16", "grpo", {"rollout.n": 16}),
            Variant("grpo-n32", "grpo", {"rollout.n": 32}),
            Variant("sgt", "sgt"),
            # HACPO's recipe (HACPO.recipe: KL 1e-3, a minibatch of half the prompt batch), written
            # out: a base config's own train.minibatch_prompts would win over the method's default.
            Variant(
                "hacpo", "hacpo", {f"train.{k}": v for k, v in HACPO.recipe(batch_prompts, policies).items()}
            ),
            Variant("graft", "graft"),
        ]
        return Matrix(variants, baseline="grpo-n8", reference="graft", source="preset table1")
    if name == "table2":
        variants = [
            Variant("graft", "graft"),
            Variant("no-gate", "graft", {"graft.gate": False}),
            Variant("delta-0", "graft", {"graft.delta": 0.0}),
            Variant("delta-0.7", "graft", {"graft.delta": 0.7}),
            Variant("delta-0.9", "graft", {"graft.delta": 0.9}),
            Variant("no-balance", "graft", {"graft.balance": False}),
            Variant("sequence-ratio", "graft", {"graft.ratio_level": "sequence"}),
            Variant("random-prompts", "graft", {"graft.selection": "random_prompts"}),
            Variant("random-admission", "graft", {"graft.admission": "random"}),
            Variant("peer-first", "graft", {"graft.peer_position": "first"}),
            Variant("peer-uniform", "graft", {"graft.peer_position": "uniform"}),
            Variant("pooled", "graft", {"graft.groups": "pooled"}),
            Variant("success-only", "graft", {"graft.transfer": "success_only"}),
            Variant("luffy", "luffy"),
            Variant("sgt+graft-which", "sgt", {"sgt.selection": "balanced"}),
        ]
        return Matrix(variants, reference="graft", source="preset table2")
    if name == "demo":
        # `graftrl demo`: GRPO (n = 8) and GRAFT on the same prompts, steps and rollout budget.
        variants = [Variant("grpo", "grpo"), Variant("graft", "graft")]
        return Matrix(variants, baseline="grpo", reference="graft", source="preset demo")
    if name in ("mastery", "hint", "rule"):
        # `graftrl sweep --knob mastery`: which transfer rule wins where. GRAFT and success-only
        # transfer log the transferred texts, for the error classes of the moved wrong responses.
        # `hint` adds the peer in the prompt (CoRe's rescue round) beside them: the same cells
        # otherwise, so a mastery line's committed cells are reused by digest. `rule` keeps only
        # GRPO and GRAFT, the cells that score the probe's rule (docs/results.md §7).
        texts = {"logging.log_transfers": True}
        variants = [
            Variant("grpo", "grpo"),
            Variant("graft", "graft", texts),
            Variant("success-only", "graft", {"graft.transfer": "success_only", **texts}),
            Variant("sgt", "sgt"),
        ]
        if name == "hint":  # with the rescued responses' texts (rescues.jsonl), for their errors
            variants.append(Variant("hint", "hint", texts))
        if name == "rule":
            variants = variants[:2]
        return Matrix(variants, baseline="grpo", reference="graft", source=f"preset {name}")
    raise CompareError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def parse_matrix(raw: Any, source: str = "<matrix>") -> Matrix:
    """A matrix from parsed YAML: a list of rows, or ``{variants: [...], baseline:, reference:}``."""
    baseline = reference = None
    if isinstance(raw, dict):
        unknown = set(raw) - {"variants", "baseline", "reference"}
        if unknown:
            raise CompareError(
                f"{source}: unknown top-level key(s) {sorted(unknown)} (allowed: variants, baseline, reference)"
            )
        baseline, reference, raw = raw.get("baseline"), raw.get("reference"), raw.get("variants")
    if not isinstance(raw, list) or not raw:
        raise CompareError(f"{source}: expected a non-empty list of variants ({{variant:, method:, set:}})")
    variants: list[Variant] = []
    for index, row in enumerate(raw):
        where = f"{source} variant {index}"
        if not isinstance(row, dict):
            raise CompareError(f"{where}: expected a mapping with 'variant' and 'method', got {row!r}")
        name = row.get("variant")
        if isinstance(name, str):
            where = f"{source} variant {name!r}"
        unknown = set(row) - _ROW_FIELDS
        if unknown:
            raise CompareError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: variant, method, set)")
        if not isinstance(name, str) or not _NAME.match(name) or name == WARM_START:
            raise CompareError(
                f"{where}: 'variant' must be a name of letters, digits and _ . + - (not {WARM_START!r}), "
                f"got {name!r}"
            )
        method = row.get("method")
        if not isinstance(method, str) or not method:
            raise CompareError(f"{where}: 'method' must be a method name, got {method!r}")
        overrides = row.get("set") or {}
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            raise CompareError(f"{where}: 'set' must map dotted config keys to values, got {overrides!r}")
        for key in ("method", "seed"):
            if key in overrides:
                raise CompareError(
                    f"{where}: 'set' may not hold {key!r} (the row's method and --seeds decide it)"
                )
        variants.append(Variant(name, method, dict(overrides)))
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CompareError(f"{source}: duplicate variant name(s) {duplicates}")
    for label, value in (("baseline", baseline), ("reference", reference)):
        if value is not None and value not in names:
            raise CompareError(f"{source}: {label} {value!r} is not one of the variants {names}")
    return Matrix(variants, baseline=baseline, reference=reference, source=source)


def load_matrix(path: str | Path) -> Matrix:
    path = Path(path)
    if not path.is_file():
        raise CompareError(f"matrix file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise CompareError(
            f"matrix file {path} is not UTF-8 text (byte {error.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as error:
        raise CompareError(f"matrix file {path} is not valid YAML: {error}") from None
    return parse_matrix(raw, str(path))


def check_methods(matrix: Matrix) -> None:
    """Every variant's method must be registered now; the error names the variant."""
    from graftrl.methods import METHODS

    for variant in matrix.variants:
        if variant.method not in METHODS:
            raise CompareError(
                f"variant {variant.name!r}: method {variant.method!r} is not registered in this "
                f"installation (registered: {', '.join(sorted(METHODS))}); remove the row or add the method"
            )
