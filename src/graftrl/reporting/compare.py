"""`graftrl compare`: a matrix of methods (and switches) x seeds on one task, with paper-style tables.

A *matrix* is a list of variants, each ``{variant: NAME, method: METHOD, set: {dotted.key: value}}``;
the overrides are applied (``graftrl.config.apply_overrides``) on the task's base config, which
gives every variant the same prompts, steps and per-model rollout budget unless the row changes
it (e.g. GRPO ``rollout.n: 16``). Built-in presets: ``table1`` (paper Table 1: GRPO n = 8/16/32,
SGT, HACPO, GRAFT), ``table2`` (GRAFT and each ablation switch of algorithm.md §2.4) and ``demo`` (GRPO
and GRAFT: what ``graftrl demo`` runs, with its own report, ``demo.DemoReport``). A matrix file is
YAML: either a list of variants or a mapping ``{variants: [...], baseline: NAME, reference: NAME}``.

The default task is the embedded one of ``graftrl demo`` (warm-started heterogeneous tiny models,
procedural problems, held-out pass@1 with the paper's sampling protocol). Every (variant, seed)
cell trains in ``OUT/runs/<variant>-seed<seed>/`` and, when done, writes ``done.json`` there with
its result rows and a digest of everything that determines it. A rerun skips cells whose marker
matches, and restarts any other cell from scratch (an interrupted run directory is deleted, not
resumed), so a partly finished matrix continues where it stopped.

Outputs in OUT: ``results.json`` (rows ``{"variant","method","model","seed","n","pass_at_1",
"steps","wall_s"}``; ``wall_s`` is the training wall-clock of the cell, evaluation excluded),
``results.csv`` (the same rows), ``report.md`` (Table 1: pass@1 mean ± std over seeds per model,
Δ vs the GRPO n = 8 baseline; Table 2: Δ vs full GRAFT; wall-clock and rollouts per variant) and
plots ``training_curves.png`` (reward per step, mean over seeds) and ``pass_at_1.png``.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import re
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from graftrl.config import ConfigError, apply_overrides, config_from_dict
from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.task import DEFAULT_TASK, get_task
from graftrl.errors import UserError
from graftrl.evaluation.stats import WARM_START, family_rows, summarize
from graftrl.reporting.diagnostics import (
    AdvantageMass,
    GateOutcome,
    advantage_mass,
    family_progress,
    gate_by_outcome,
    summarize_exchange,
)
from graftrl.reporting.provenance import results_provenance, signature, written_by
from graftrl.reporting.render import (
    advantage_markdown,
    diagnostics_markdown,
    gate_markdown,
    paired_markdown,
    progress_markdown,
    table_markdown,
)
from graftrl.storage.data import MathProblem
from graftrl.storage.rundir import ExperimentDir, RunDir, read_jsonl, read_metrics

__all__ = [
    "DEFAULT",
    "QUICK",
    "ROW_KEYS",
    "CompareError",
    "CompareReport",
    "CompareRun",
    "CompareTask",
    "DemoSettings",
    "Matrix",
    "Variant",
    "demo_config",
    "demo_settings",
    "embedded_task",
    "evaluate_policies",
    "load_matrix",
    "preset_matrix",
    "run_compare",
    "write_problems",
]

ROW_KEYS = ("variant", "method", "model", "seed", "n", "pass_at_1", "per_family", "steps", "wall_s")
"""Columns of results.csv (results.json rows hold the same keys)."""
PAIRED_NOTE = (
    "mean [95% paired t interval over seeds] in points; `*` marks an interval that excludes 0, "
    "the only differences the seeds run resolve"
)
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
        return [f"{key}={_yaml_value(value)}" for key, value in self.set.items()]


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


def _yaml_value(value: Any) -> str:
    """JSON is YAML, except that PyYAML reads ``1e-10`` (no dot) as a string: write ``1.0e-10``."""
    text = json.dumps(value)
    if isinstance(value, float) and re.fullmatch(r"-?\d+e[-+]?\d+", text):
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


# --------------------------------------------------------------------------------------------
# The embedded task's sizes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the embedded comparison. The RL settings are the paper's except where noted."""

    task: str = DEFAULT_TASK
    """Embedded task by name (``graftrl.embedded.task.TASKS``): its problems, format and models."""
    steps: int = 60
    """RL steps per method."""
    batch_prompts: int = 32
    """Prompts per step (paper: 128; scaled to the CPU)."""
    minibatch_prompts: int = 8
    """Prompt groups per optimizer step: 4 optimizer steps per batch, as the paper's 128/32."""
    n: int = 8
    """Rollouts per prompt per model (the paper's n = 8)."""
    lr: float = 1e-4
    """Tiny randomly initialised models need a far larger rate than the paper's 1e-6."""
    max_new_tokens: int | None = None
    """Response length limit; None: the task's (``EmbeddedTask.max_new_tokens``)."""
    n_train: int = 1200
    """Procedural RL training problems."""
    n_eval: int = 256
    """Held-out problems, disjoint from training."""
    eval_samples: int = 8
    """Samples per held-out problem (paper protocol: 8 at T = 0.6, top-p 0.95)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            object.__setattr__(self, "max_new_tokens", get_task(self.task).max_new_tokens)


DEFAULT = DemoSettings()
QUICK = DemoSettings(steps=4, batch_prompts=16, minibatch_prompts=4, n_train=200, n_eval=48, eval_samples=4)


def demo_settings(task: str = DEFAULT_TASK, quick: bool = False) -> DemoSettings:
    """The demo's sizes (``quick``: smoke-test sizes) on the embedded task ``task``."""
    return replace(QUICK if quick else DEFAULT, task=task, max_new_tokens=get_task(task).max_new_tokens)


def demo_config(
    paths: dict[str, Path], train_file: Path, method: str, seed: int, settings: DemoSettings
) -> dict[str, Any]:
    """The raw config of one embedded cell: the warm-started models at ``paths`` on ``train_file``."""
    return {
        "seed": seed,
        "method": method,
        "policies": [
            {"name": name, "path": str(path), "template": MODEL_SPECS[name]["template"]}
            for name, path in paths.items()
        ],
        "data": {"train": str(train_file), "prompt_suffix": None},
        "rollout": {"n": settings.n, "temperature": 1.0, "max_new_tokens": settings.max_new_tokens},
        "optim": {"lr": settings.lr},
        "train": {
            "steps": settings.steps,
            "batch_prompts": settings.batch_prompts,
            "minibatch_prompts": settings.minibatch_prompts,
            "micro_batch_size": 128,
        },
        "logging": {"progress": True, "log_samples": 1},
    }


def write_problems(problems: Sequence[MathProblem], path: Path) -> None:
    """Problems as JSONL rows {id, problem, answer, family} (what ``load_problems`` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer, "family": p.family}) + "\n"
            for p in problems
        )
    )


def evaluate_policies(
    policies: Sequence[Any], heldout: Sequence[MathProblem], verifier: Any, settings: DemoSettings, seed: int
) -> dict[str, dict[str, Any]]:
    """policy -> {"pass_at_1", "per_family"} on the held-out problems (paper protocol)."""
    from graftrl.evaluation.evaluate import EvalProtocol, evaluate_pass_at_1

    protocol = EvalProtocol(samples=settings.eval_samples, max_new_tokens=settings.max_new_tokens)
    out = {}
    for policy in policies:
        result = evaluate_pass_at_1(policy, heldout, verifier, protocol, seed=10_000 + seed)
        out[policy.name] = {
            "pass_at_1": float(result["pass_at_1"]),
            "per_family": result.get("per_family", {}),
        }
    return out


# --------------------------------------------------------------------------------------------
# Matrices
# --------------------------------------------------------------------------------------------

PRESETS = ("table1", "table2", "demo", "mastery")


def preset_matrix(name: str, batch_prompts: int = DEFAULT.batch_prompts) -> Matrix:
    """A built-in matrix; ``batch_prompts`` (the task's) sizes HACPO's minibatch (half the batch)."""
    if name == "table1":
        variants = [
            Variant("grpo-n8", "grpo"),
            Variant("grpo-n16", "grpo", {"rollout.n": 16}),
            Variant("grpo-n32", "grpo", {"rollout.n": 32}),
            Variant("sgt", "sgt"),
            # HACPO's recipe (algorithm.md §3): KL 1e-3, minibatch half the prompt batch (64/128) x n
            # rows of the pooled batch: 4 optimizer steps over own + peer groups (hacpo.minibatch: rows).
            Variant(
                "hacpo",
                "hacpo",
                {"train.kl_coef": 1e-3, "train.minibatch_prompts": max(1, batch_prompts // 2)},
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
    if name == "mastery":
        # `graftrl sweep --knob mastery`: which transfer rule wins where. GRAFT and success-only
        # transfer log the transferred texts, for the error classes of the moved wrong responses.
        texts = {"logging.log_transfers": True}
        variants = [
            Variant("grpo", "grpo"),
            Variant("graft", "graft", texts),
            Variant("success-only", "graft", {"graft.transfer": "success_only", **texts}),
            Variant("sgt", "sgt"),
        ]
        return Matrix(variants, baseline="grpo", reference="graft", source="preset mastery")
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
        raw = yaml.safe_load(path.read_text())
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


# --------------------------------------------------------------------------------------------
# The task and its cells
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompareTask:
    """What every cell trains and is evaluated on."""

    name: str
    base_config: dict[str, Any]
    """Raw config shared by all cells (policies, data, sizes); method and seed are set per cell."""
    heldout: list[MathProblem]
    """Held-out problems for pass@1."""
    settings: DemoSettings
    """Evaluation samples and response limit (``eval_samples``, ``max_new_tokens``), for the report."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """Code commit and each starting model's weights hash and warm-start fingerprint
    (``reporting.provenance``), recorded in results.json."""


def embedded_task(
    out_dir: Path,
    cache_dir: Path | None,
    quick: bool,
    console: Console,
    name: str = DEFAULT_TASK,
    mixes: Mapping[str, Mapping[str, float]] | None = None,
    warmstart: Mapping[str, float] | None = None,
) -> CompareTask:
    """The demo's task ``name``: warm-started (cached) embedded models and a procedural
    train/held-out split. ``mixes``: the models' warm-start family mixes, default the task's;
    ``warmstart``: stop settings replacing the task's."""
    from graftrl.embedded.task import make_split
    from graftrl.embedded.warmstart import prepare_embedded_models
    from graftrl.storage.data import load_problems

    settings = demo_settings(name, quick)
    cache_dir = cache_dir or Path.home() / ".cache" / "graftrl" / "embedded"
    console.print(f"[bold]warm-starting the embedded models[/bold] for task {name!r} (cached in {cache_dir})")
    started = time.perf_counter()
    paths = prepare_embedded_models(
        cache_dir, quick=quick, seed=0, task=name, mixes=mixes, settings=warmstart
    )
    console.print(
        f"models ready in {time.perf_counter() - started:.0f}s: "
        + ", ".join(f"{k} -> {v}" for k, v in paths.items())
    )
    train, heldout = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=name)
    out = ExperimentDir(out_dir)
    write_problems(train, out.train_data)
    write_problems(heldout, out.heldout_data)
    base = demo_config(paths, out.train_data, "grpo", 0, settings)
    # "embedded" stays the arith task's name so earlier reports read the same.
    label = "embedded" if name == "arith" else f"embedded-{name}"
    provenance = results_provenance(paths)
    return CompareTask(label, base, load_problems(out.heldout_data), settings, provenance)


def cell_config(task: CompareTask, variant: Variant, seed: int, steps: int | None) -> Any:
    """The validated Config of one cell; errors name the variant."""
    raw = copy.deepcopy(task.base_config)
    raw.update(method=variant.method, seed=seed)
    try:
        if steps is not None:
            apply_overrides(raw, [f"train.steps={steps}"])
        apply_overrides(raw, variant.overrides())
        config = config_from_dict(raw, "(base config + the row's overrides)")
    except (ConfigError, KeyError, IndexError, TypeError, ValueError) as error:
        raise CompareError(f"variant {variant.name!r}: {error}") from None
    from graftrl.methods import build_method

    try:
        build_method(config.method, config)
    except ValueError as error:
        raise CompareError(f"variant {variant.name!r}: {error}") from None
    return config


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


PROGRESS_WINDOW = 10
"""Steps at each end of training over which the report averages the per-family training reward."""

CELL_VERSION = 1
"""Part of every cell's digest. Bump it with any change that alters what a cell computes — a
changed default, a fix in training or evaluation — so that finished cells are retrained rather
than reused. (The key leaves out fields at their defaults, so a new config field, whose default
keeps today's behaviour, does not invalidate the cells already run.)"""


def _cell_key(task: CompareTask, config: Any) -> dict[str, Any]:
    """The cell's config without the fields at their defaults, its files named by content, not
    location: each policy's path by its starting weights' hash, the training file by its hash. A
    finished cell committed from one checkout (or cache folder) is then recognised in another."""
    from graftrl.files import sha256_file

    raw = config.model_dump(mode="json", exclude_defaults=True)
    models = task.provenance.get("models", {})
    for policy in raw["policies"]:
        if policy["name"] in models:
            policy["path"] = models[policy["name"]]["weights_sha256"]
    train = Path(raw["data"]["train"])
    if train.is_file():
        raw["data"]["train"] = sha256_file(train)[0]
    return raw


def _cell_digest(task: CompareTask, config: Any) -> str:
    """What a cell's done marker must match: its config (files by content) and the evaluation."""
    return _digest(CELL_VERSION, _cell_key(task, config), _eval_key(task))


def _eval_key(task: CompareTask) -> list[Any]:
    s = task.settings
    return [s.eval_samples, s.max_new_tokens, [p.id for p in task.heldout]]


def _read_done(path: Path, digest: str) -> dict[str, Any] | None:
    try:
        done = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return done if done.get("digest") == digest else None


def _write_json_atomic(path: Path, data: Any) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=2))
    staging.replace(path)


def _compute_per_model(run_dir: Path, batch_prompts: int, n: int) -> dict[str, float]:
    """Mean over the models of each one's run totals: responses sampled (dynamic sampling logs its
    prompts per step), rows trained and optimizer steps (what HACPO's pooled batch doubles)."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in read_metrics(run_dir):
        model = totals[row["model"]]
        model["rollouts_per_model"] += int(row.get("prompts_sampled") or batch_prompts) * n
        model["rows_trained_per_model"] += int(row.get("train_rows") or 0)
        model["optimizer_steps_per_model"] += int(row.get("optimizer_steps") or 0)
    keys = ("rollouts_per_model", "rows_trained_per_model", "optimizer_steps_per_model")
    return {k: statistics.fmean(m[k] for m in totals.values()) if totals else 0.0 for k in keys}


def run_cell(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    verifier: Any,
    console: Console,
    resume: bool = True,
    progress: bool = True,
    donors: Mapping[str, Path] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Train and evaluate one (variant, seed) cell, or reuse its done marker. Returns (done, ran).

    ``resume`` False: the cell trains afresh and writes no marker (the demo's way). ``progress``
    False: no live progress bar (cells running side by side would draw over each other).
    ``donors``: finished cells elsewhere by digest (``donor_cells``), copied instead of trained.
    """
    from graftrl.training.trainer import Trainer

    config = cell_config(task, variant, seed, steps)
    run_dir = ExperimentDir(out_dir).run(variant.name, seed).root
    digest = _cell_digest(task, config)
    done = _finished(run_dir, digest, variant, seed, console, donors or {}) if resume else None
    if not progress:  # after the digest: how a run is displayed does not change its result
        config = config.model_copy(update={"logging": config.logging.model_copy(update={"progress": False})})
    if done is not None:
        return done, False
    if run_dir.exists():  # unfinished, or finished under another config: start it over
        if resume:
            console.print(f"{variant.name} seed {seed}: discarding the unfinished run in {run_dir}")
        shutil.rmtree(run_dir)
    method = "" if variant.method == variant.name else f" ({variant.method})"
    console.print(f"[bold]{variant.name}[/bold]{method} seed {seed}: {config.train.steps} steps")
    start = time.perf_counter()
    trainer = Trainer(config, run_dir, verifier=verifier)
    trainer.train()
    wall = time.perf_counter() - start
    scores = evaluate_policies(trainer.policies, task.heldout, verifier, task.settings, seed)
    rows = [
        {
            "variant": variant.name,
            "method": variant.method,
            "model": model,
            "seed": seed,
            "n": config.rollout.n,
            **score,
            "steps": config.train.steps,
            "wall_s": round(wall, 2),
        }
        for model, score in scores.items()
    ]
    done = {
        "digest": digest,
        "rows": rows,
        "set": variant.set,
        **_compute_per_model(run_dir, config.train.batch_prompts, config.rollout.n),
    }
    if resume:
        _write_json_atomic(RunDir(run_dir).done, done)
    return done, True


def warm_start_cell(
    task: CompareTask, out_dir: Path, verifier: Any, console: Console, resume: bool = True
) -> dict[str, Any]:
    """pass@1 of the untrained policies (evaluated once; its marker is reused like any cell's).

    ``resume`` False: evaluated afresh, nothing written.
    """
    from graftrl.models.policy import Policy

    config = config_from_dict({**copy.deepcopy(task.base_config), "method": "grpo"})
    run_dir = ExperimentDir(out_dir).run(WARM_START).root
    digest = _digest(CELL_VERSION, _cell_key(task, config)["policies"], _eval_key(task))
    done = _read_done(RunDir(run_dir).done, digest) if resume else None
    if done is not None:
        return done
    if resume:
        console.print("[bold]warm-start[/bold]: evaluating the initial policies")
        run_dir.mkdir(parents=True, exist_ok=True)
    policies = [
        Policy.from_pretrained(
            p.name, p.path, dtype=p.dtype, device=p.device, template=p.template, chat_template=p.chat_template
        )
        for p in config.policies
    ]
    scores = evaluate_policies(policies, task.heldout, verifier, task.settings, seed=0)
    rows = [
        {
            "variant": WARM_START,
            "method": WARM_START,
            "model": model,
            "seed": 0,
            "n": config.rollout.n,
            **score,
            "steps": 0,
            "wall_s": 0.0,
        }
        for model, score in scores.items()
    ]
    done = {"digest": digest, "rows": rows, "set": {}, "rollouts_per_model": 0.0}
    if resume:
        _write_json_atomic(RunDir(run_dir).done, done)
    return done


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _curves(out_dir: Path, names: Sequence[str], seeds: int) -> dict[str, list[dict[str, Any]]]:
    """variant -> per (step, model) reward on the shared prompt batch, mean over the seeds run."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        points: dict[tuple[int, str], list[float]] = defaultdict(list)
        for seed in range(seeds):
            run = ExperimentDir(out_dir).run(name, seed)
            if run.holds_run():
                for row in read_metrics(run.root):
                    # the reward on the step's shared batch (dynamic sampling trains on other prompts)
                    value = row.get("shared_reward_mean", row.get("reward_mean"))
                    if value is not None:
                        points[(row["step"], row["model"])].append(value)
        if points:
            curves[name] = [
                {"step": step, "model": model, "reward_mean": statistics.fmean(v)}
                for (step, model), v in sorted(points.items())
            ]
    return curves


def _family_runs(out_dir: Path, names: Sequence[str], seeds: int) -> dict[str, list[dict[str, Any]]]:
    """Metrics rows per "<variant> seed <s>" (the per-family curves and the exchange diagnostics)."""
    out = ExperimentDir(out_dir)
    return {
        f"{name} seed {seed}": read_metrics(out.run(name, seed).root)
        for name in names
        for seed in range(seeds)
        if out.run(name, seed).holds_run()
    }


def _compatibility_records(out_dir: Path, variant: str, seeds: int) -> list[dict[str, Any]]:
    """Every ``compatibility.jsonl`` row of ``variant``'s runs over seeds 0..seeds-1."""
    out = ExperimentDir(out_dir)
    logs = [RunDir(out.run(variant, seed).root).compatibility for seed in range(seeds)]
    return [record for log in logs if log.is_file() for record in read_jsonl(log)]


def _exchange_tables(
    out_dir: Path, matrix: Matrix, task: CompareTask, seeds: int, steps: int | None
) -> tuple[dict[str, dict[str, dict[str, GateOutcome]]], dict[str, dict[str, AdvantageMass]]]:
    """One pass over each variant's compatibility logs (seeds run) for the two transfer tables.

    Gates: variant -> ``gate_by_outcome``, for every variant that transferred responses.
    Masses: variant -> ``advantage_mass``, for the GRAFT variants whose logged peer responses are
    whole source groups weighted by eq. 8 (replaced groups, every response, the gate or no gate);
    pooled groups, success-only transfer and random admission train other weights or advantages
    than the log can rebuild."""
    gates, masses = {}, {}
    for variant in matrix.variants:
        if not (records := _compatibility_records(out_dir, variant.name, seeds)):
            continue
        config = cell_config(task, variant, 0, steps)
        graft, train = config.graft, config.train
        gates[variant.name] = gate_by_outcome(records, graft.delta)
        whole_groups = graft.groups == "replace" and graft.transfer == "all" and graft.admission == "gate"
        if variant.method != "graft" or not whole_groups:
            continue
        delta = graft.delta if graft.gate else None
        if mass := advantage_mass(records, config.rollout.n, delta, train.adv_eps, train.adv_std_unbiased):
            masses[variant.name] = mass
    return gates, masses


def compatibility_scores(out_dir: Path, variant: str, seeds: int) -> dict[str, list[float]]:
    """Receiver -> every compatibility score s logged by ``variant``'s runs over seeds 0..seeds-1."""
    from graftrl.reporting.plots import read_compatibility

    scores: dict[str, list[float]] = defaultdict(list)
    for seed in range(seeds):
        for receiver, values in read_compatibility(ExperimentDir(out_dir).run(variant, seed).root).items():
            scores[receiver] += values
    return dict(scores)


def _exchange_plots(
    out_dir: Path,
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: str | None,
    reference: str | None,
    seeds: int,
    footer: str,
) -> dict[str, str]:
    """The demo's exchange figures for the baseline and the reference variant (GRPO and GRAFT in
    the demo preset): complementarity per step and the reference's compatibility scores."""
    from graftrl.reporting.plots import plot_compatibility_histogram, plot_complementarity

    made = {}
    pair = {name for name in (baseline, reference) if name}
    runs = {label: rows for label, rows in metrics.items() if label.split(" seed ")[0] in pair}
    if any(key.startswith("complementarity/") for rows in runs.values() for row in rows for key in row):
        plot_complementarity(runs, out_dir / "complementarity.png", footer=footer)
        made["complementarity.png"] = (
            f"share of all-fail prompts the peer solves, {' and '.join(sorted(pair))}"
        )
    scores = compatibility_scores(out_dir, reference, seeds) if reference else {}
    if scores:
        plot_compatibility_histogram(scores, out_dir / "compatibility_hist.png", footer=footer)
        made["compatibility_hist.png"] = f"compatibility scores s of {reference}'s transferred responses"
    return made


def _write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(ROW_KEYS), extrasaction="ignore")
        writer.writeheader()
        # per_family ({family: pass@1}) as a JSON object in its cell
        writer.writerows({**row, "per_family": json.dumps(row.get("per_family") or {})} for row in rows)


def _mean_of(done: Sequence[Mapping[str, Any]], key: str) -> str:
    """A compute column: the mean over seeds, blank for cells finished before it was recorded."""
    values = [d[key] for d in done if key in d]
    return f"{statistics.fmean(values):,.0f}" if values else ""


def write_report(
    out_dir: Path,
    matrix: Matrix,
    rows: Sequence[Mapping[str, Any]],
    cells: Mapping[str, Sequence[Mapping[str, Any]]],
    task: CompareTask,
    seeds: int,
    steps: int | None,
    total_wall_s: float,
) -> Path:
    """report.md with Table 1 (Δ vs baseline) and Table 2 (Δ vs reference), and the plots."""
    from graftrl.reporting.plots import plot_family_curves, plot_pass_at_1, plot_training_curves

    summary = summarize(rows)
    made_by = signature(task.provenance)
    names = [v.name for v in matrix.variants]
    extra: dict[str, dict[str, str]] = {}
    for variant in matrix.variants:
        done = cells.get(variant.name, [])
        walls = [float(r["wall_s"]) for d in done for r in d["rows"][:1]]
        extra[variant.name] = {
            "method": variant.method,
            "overrides": ", ".join(f"`{k}={_yaml_value(v)}`" for k, v in variant.set.items()) or "",
            "n": str(done[0]["rows"][0]["n"]) if done else "",
            "rollouts/model": _mean_of(done, "rollouts_per_model"),
            "rows trained/model": _mean_of(done, "rows_trained_per_model"),
            "optimizer steps/model": _mean_of(done, "optimizer_steps_per_model"),
            "seeds": str(len(done)),
            "train wall-clock (s/seed)": f"{statistics.fmean(walls):.1f}" if walls else "",
            "total (s)": f"{sum(walls):.1f}" if walls else "",
        }
    extra[WARM_START] = {"method": "—", "seeds": "1"}
    s = task.settings
    base = task.base_config
    lines = [
        f"# graftrl compare: {matrix.source or 'matrix'} on the {task.name} task",
        "",
        f"{written_by(task.provenance)}; the cells' digests, starting weights and warm-start fingerprints "
        "are in results.json.",
        "",
        f"Seeds: {seeds} per variant (the `seeds` column counts those finished). Steps: {steps or base['train']['steps']}; per step, every model gets "
        f"{base['train']['batch_prompts']} prompts x n rollouts ({base['rollout']['n']} unless a row "
        f"sets `rollout.n`), minibatch {base['train']['minibatch_prompts']} prompts. Held-out pass@1: "
        f"{len(task.heldout)} problems x {s.eval_samples} samples at T = 0.6, top-p 0.95, "
        f"{s.max_new_tokens} new tokens; mean ± std over seeds (sample std), in percent. "
        "Wall-clock is training only (evaluation excluded), per seed.",
        "",
    ]
    baseline, reference = matrix.baseline_name, matrix.reference_name
    if baseline is not None:
        lines += [
            f"## Table 1: pass@1 per model, Δ vs {baseline}",
            "",
            table_markdown(summary, baseline, [WARM_START, *names], extra, f"Δ vs {baseline}"),
            "",
            f"Paired by seed (same warm-start, prompts and evaluation problems), Δ vs {baseline}: "
            f"{PAIRED_NOTE}.",
            "",
            paired_markdown(rows, baseline, names),
            "",
        ]
    # with only the baseline beside it, Table 2 would mirror Table 1 (the demo preset)
    if reference is not None and set(names) - {baseline, reference}:
        lines += [
            f"## Table 2: ablations, Δ vs full GRAFT ({reference})",
            "",
            table_markdown(summary, reference, names, extra, f"Δ vs {reference}"),
            "",
            f"Paired by seed, Δ vs {reference}: {PAIRED_NOTE}.",
            "",
            paired_markdown(rows, reference, names),
            "",
        ]
    if baseline is None and reference is None:
        lines += ["## Results", "", table_markdown(summary, None, [WARM_START, *names], extra), ""]
    if by_family := family_rows(rows):
        lines += ["## Held-out pass@1 per problem family", ""]
        lines += [table_markdown(summarize(by_family), baseline or reference, [WARM_START, *names]), ""]
        if baseline or reference:
            lines += [paired_markdown(by_family, baseline or reference, names), ""]
    metrics = _family_runs(out_dir, names, seeds)
    if progress := family_progress(metrics, PROGRESS_WINDOW):
        lines += [
            f"Training reward per problem family (percent, pooled over the seeds run): mean over the first "
            f"{PROGRESS_WINDOW} steps → over the last {PROGRESS_WINDOW}; the curves are in `family_curves.png`.",
            "",
            progress_markdown(progress, PROGRESS_WINDOW),
            "",
        ]
    if diagnostics := summarize_exchange(metrics):
        lines += [
            "## Regime and exchange diagnostics (training prompts; mean per step over the seeds run)",
            "",
            "All-fail share: the receiver's prompts on which all n of its rollouts failed. Complementarity: "
            "of those, the share on which a peer's group is mixed. Groups moved: prompt groups replaced by a "
            "peer's per step; peer responses: their total; admitted: the share with compatibility weight "
            "w > 0 (the gate). Clipped own / peer: trained tokens whose ratio was clipped, on own and on "
            "peer rows (percent).",
            "",
            diagnostics_markdown(diagnostics, names),
            "",
        ]
    gates, masses = _exchange_tables(out_dir, matrix, task, seeds, steps)
    if gates:
        lines += [
            "Transferred responses by outcome: the share that passes the gate (s > δ, the variant's "
            "delta; for a method without the gate, such as HACPO, the share it would pass) and the median "
            "compatibility score s, for correct and for wrong peer responses. "
            "The gate should filter foreign style; when it passes fewer correct responses than wrong "
            "ones it is filtering out the lesson (docs/task_design.md).",
            "",
            gate_markdown(gates),
            "",
        ]
    if masses:
        lines += [
            "Advantage mass of the moved groups: per moved group, the sum of w·A over the peer's correct "
            "responses, over its wrong ones, and both (source advantages, eq. 1; weights, eq. 8), for the "
            "GRAFT variants that move whole groups. GRPO's advantages sum to 0 over a group, so without "
            "the gate the net is 0: tokens that all the peer's responses share, a step the receiver lacks "
            "included, get no net push; only what separates the peer's correct responses from its wrong "
            "ones does.",
            "",
            advantage_markdown(masses),
            "",
        ]
    missing = [n for n in names if n not in summary]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    plots = {"training_curves.png": "reward per step, mean over seeds", "pass_at_1.png": "per seed"}
    curves = _curves(out_dir, names, seeds)
    if curves:
        plot_training_curves(curves, out_dir / "training_curves.png", footer=made_by)
    if rows:
        plot_pass_at_1(
            [{**r, "method": r["variant"]} for r in rows], out_dir / "pass_at_1.png", footer=made_by
        )
    if plot_family_curves(metrics, out_dir / "family_curves.png", footer=made_by):
        plots["family_curves.png"] = "training reward per problem family"
    plots.update(_exchange_plots(out_dir, metrics, baseline, reference, seeds, made_by))
    lines += [
        "Plots: " + ", ".join(f"`{name}` ({what})" for name, what in plots.items()) + ".",
        f"Total wall-clock of this invocation: {total_wall_s:.0f} s.",
        "",
    ]
    report = ExperimentDir(out_dir).report
    report.write_text("\n".join(lines))
    return report


@dataclass
class CompareRun:
    """A comparison in progress: the cells run so far and their result rows, in run order."""

    out_dir: Path
    matrix: Matrix
    task: CompareTask
    seeds: int
    steps: int | None
    console: Console
    started: float = field(default_factory=time.perf_counter)
    rows: list[dict[str, Any]] = field(default_factory=list)
    cells: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    """Variant -> the done record of each seed run, in seed order (set when every cell is done)."""
    ran: list[str] = field(default_factory=list)
    """Cells trained by this invocation ("<variant>-seed<seed>"), not reused."""

    @property
    def wall_s(self) -> float:
        return round(time.perf_counter() - self.started, 1)

    def results(self) -> dict[str, Any]:
        """compare's results.json."""
        return {
            "rows": self.rows,
            "variants": [asdict(v) for v in self.matrix.variants],
            "baseline": self.matrix.baseline_name,
            "reference": self.matrix.reference_name,
            "task": self.task.name,
            "settings": asdict(self.task.settings),
            "seeds": self.seeds,
            "steps": self.steps,
            "ran": self.ran,
            "total_wall_s": self.wall_s,
            "provenance": self.task.provenance,
        }


class CompareReport:
    """How a comparison is written: results.json (after every cell, so progress survives a crash),
    then results.csv, report.md and the plots. ``graftrl demo`` writes its own (``demo.DemoReport``).

    ``echo``: print report.md when done (``graftrl sweep`` prints its own summary instead).
    """

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo

    def progress(self, run: CompareRun) -> None:
        _write_json_atomic(ExperimentDir(run.out_dir).results, run.results())

    def finish(self, run: CompareRun) -> dict[str, Any]:
        out_dir = run.out_dir
        order = {WARM_START: -1, **{v.name: i for i, v in enumerate(run.matrix.variants)}}
        run.rows.sort(key=lambda r: (order[r["variant"]], r["seed"], r["model"]))
        final = run.results()
        _write_json_atomic(ExperimentDir(out_dir).results, final)
        _write_csv(run.rows, ExperimentDir(out_dir).results_csv)
        report = write_report(
            out_dir, run.matrix, run.rows, run.cells, run.task, run.seeds, run.steps, final["total_wall_s"]
        )
        if self.echo:
            run.console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
        run.console.print(f"wrote {out_dir}/report.md, results.json, results.csv and plots")
        return final


def run_compare(
    out_dir: Path,
    matrix: Matrix | str,
    seeds: int = 1,
    steps: int | None = None,
    quick: bool = False,
    cache_dir: Path | None = None,
    console: Console | None = None,
    task: CompareTask | None = None,
    embedded: str = DEFAULT_TASK,
    resume: bool = True,
    report: CompareReport | None = None,
    jobs: int = 1,
    reuse: Sequence[Path] = (),
    report_only: bool = False,
) -> dict[str, Any]:
    """Run (or continue) every (variant, seed) cell, then write results and the report.

    ``report_only``: train nothing; report the cells finished so far (here or in ``reuse``), e.g.
    while the rest still run elsewhere. Each row then says how many seeds it has.

    ``jobs``: cells trained side by side, each in its own process with an equal share of this
    process's torch threads (on 2 cores, two 1-thread cells finish sooner than one after the other
    on 2 threads: the models are too small for 2 threads to pay). ``reuse``: other output folders
    whose finished cells with the same digest (models, data, config and evaluation, under any
    variant name) are copied instead of trained.

    ``matrix``: a Matrix or a preset name (sized on the task's batch). ``task``: default the
    embedded task called ``embedded`` (``quick``: its smoke-test sizes, ``cache_dir``: where
    warm-started models live). ``resume``: reuse cells finished earlier (False: train every
    cell afresh, write no markers). ``report``: how results are written (default compare's).
    Returns what the report wrote as results.json.
    """
    from graftrl.models.rewards import MathVerifier

    console = console or Console()
    report = report or CompareReport()
    if seeds < 1:
        raise CompareError(f"--seeds must be >= 1, got {seeds}")
    if jobs < 1:
        raise CompareError(f"--jobs must be >= 1, got {jobs}")
    if report_only and not resume:
        raise CompareError("--report-only reports finished cells, so it cannot be combined with retraining")
    spec = preset_matrix(matrix) if isinstance(matrix, str) else matrix
    check_methods(spec)  # before the warm-start
    donors = donor_cells(reuse) if resume else {}
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    if task is None:
        # The default task keeps the four-argument call (tests substitute ``embedded_task``).
        task = (
            embedded_task(out_dir, cache_dir, quick, console)
            if embedded == DEFAULT_TASK
            else embedded_task(out_dir, cache_dir, quick, console, embedded)
        )
    if isinstance(matrix, str):
        spec = preset_matrix(matrix, task.base_config["train"]["batch_prompts"])
    for variant in spec.variants:  # every config is checked before the first cell trains
        cell_config(task, variant, 0, steps)
    run = CompareRun(out_dir, spec, task, seeds, steps, console, started)

    cells = [(seed, variant) for seed in range(seeds) for variant in spec.variants]
    finished: dict[tuple[int, str], dict[str, Any]] = {}

    def record(seed: int, variant: Variant, done: dict[str, Any], did_run: bool) -> None:
        finished[(seed, variant.name)] = done
        run.rows += done["rows"]
        if did_run:
            run.ran.append(f"{variant.name}-seed{seed}")
        report.progress(run)

    with MathVerifier() as verifier:
        run.rows += warm_start_cell(task, out_dir, verifier, console, resume)["rows"]
        if report_only:
            for seed, variant in cells:
                if (done := finished_cell(task, variant, seed, steps, out_dir, console, donors)) is not None:
                    record(seed, variant, done, False)
        elif jobs <= 1:
            for seed, variant in cells:
                ran = run_cell(task, variant, seed, steps, out_dir, verifier, console, resume, donors=donors)
                record(seed, variant, *ran)
        else:
            _run_cells_in_parallel(cells, jobs, task, steps, out_dir, console, resume, record, donors)
    # each variant's cells in seed order, whatever order they finished in
    for seed, variant in cells:
        if (seed, variant.name) in finished:
            run.cells[variant.name].append(finished[(seed, variant.name)])
    return report.finish(run)


def _cell_job(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    resume: bool,
    threads: int,
) -> tuple[dict[str, Any], bool]:
    """One cell in a worker process of ``run_compare(jobs > 1)``: its own torch threads and
    verifier, no live progress bar."""
    import torch

    from graftrl.models.rewards import MathVerifier

    torch.set_num_threads(threads)
    with MathVerifier() as verifier:
        return run_cell(task, variant, seed, steps, out_dir, verifier, Console(), resume, progress=False)


def _run_cells_in_parallel(
    cells: Sequence[tuple[int, Variant]],
    jobs: int,
    task: CompareTask,
    steps: int | None,
    out_dir: Path,
    console: Console,
    resume: bool,
    record: Any,
    donors: Mapping[str, Path],
) -> None:
    """Train ``cells`` in ``jobs`` spawned processes sharing this process's torch threads; cells
    finished earlier are reused here without a process. ``record(seed, variant, done, ran)`` is
    called as each cell ends."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    pending = []
    for seed, variant in cells:
        done = finished_cell(task, variant, seed, steps, out_dir, console, donors) if resume else None
        if done is not None:
            record(seed, variant, done, False)
        else:
            pending.append((seed, variant))
    if not pending:
        return
    threads = max(1, torch.get_num_threads() // jobs)
    console.print(f"training {len(pending)} cells, {jobs} at a time ({threads} torch thread(s) each)")
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {
            pool.submit(_cell_job, task, variant, seed, steps, out_dir, resume, threads): (seed, variant)
            for seed, variant in pending
        }
        try:
            for future in as_completed(futures):
                seed, variant = futures[future]
                done, did_run = future.result()
                console.print(f"{variant.name} seed {seed}: done")
                record(seed, variant, done, did_run)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def finished_cell(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    console: Console,
    donors: Mapping[str, Path] | None = None,
) -> dict[str, Any] | None:
    """The cell's done marker when it finished under the same config and evaluation (here, or in
    a donor folder: then copied here), else None."""
    config = cell_config(task, variant, seed, steps)
    run_dir = ExperimentDir(out_dir).run(variant.name, seed).root
    return _finished(run_dir, _cell_digest(task, config), variant, seed, console, donors or {})


def donor_cells(folders: Sequence[Path]) -> dict[str, Path]:
    """Finished cells under ``folders`` (compare, demo-preset or sweep outputs), by digest."""
    cells: dict[str, Path] = {}
    for folder in folders:
        if not Path(folder).is_dir():
            raise CompareError(f"--reuse: {folder} is not a folder (give compare or sweep output folders)")
        for marker in sorted(Path(folder).rglob(RunDir(Path()).done.name)):
            try:
                digest = json.loads(marker.read_text()).get("digest")
            except (OSError, json.JSONDecodeError, AttributeError):
                continue
            if isinstance(digest, str) and marker.parent.parent.name == ExperimentDir(Path()).runs.name:
                cells.setdefault(digest, marker.parent)
    return cells


def _finished(
    run_dir: Path, digest: str, variant: Variant, seed: int, console: Console, donors: Mapping[str, Path]
) -> dict[str, Any] | None:
    done = _read_done(RunDir(run_dir).done, digest)
    if done is not None:
        console.print(f"[dim]{variant.name} seed {seed}: finished earlier, skipped[/dim]")
        return done
    source = donors.get(digest)
    if source is None or source.resolve() == run_dir.resolve():
        return None
    # The same models, data, config and evaluation: the cell is the donor's, under this row's name.
    if run_dir.exists():
        shutil.rmtree(run_dir)
    bulky = [path.name for path in RunDir(source).bulky()]
    shutil.copytree(source, run_dir, ignore=lambda folder, names: bulky if Path(folder) == source else [])
    done = json.loads(RunDir(run_dir).done.read_text())
    done["rows"] = [{**row, "variant": variant.name} for row in done["rows"]]
    _write_json_atomic(RunDir(run_dir).done, done)
    console.print(f"[dim]{variant.name} seed {seed}: the same cell finished in {source}, reused[/dim]")
    return done
