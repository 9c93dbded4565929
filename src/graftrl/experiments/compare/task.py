"""What `graftrl compare` trains and evaluates: a base config and the paper's evaluation (``CompareTask``).

``base_task(CONFIG)`` is the one way a task is made: the base config (with ``--set`` overrides),
its starting models' provenance, and the ``Evaluation``: the ``--bench`` benchmarks, or else the
config's ``validation.files`` benchmarks, with the paper's protocol (``evaluation.evaluate``: 8
samples at T = 0.6, top-p 0.95, the training prompt format and length limit, pass@1 per benchmark
and their unweighted average), on each policy's best checkpoint by validation average when the
config validates (``training.validation``; the trainer keeps ``RUN/best/``), else on its final
weights. The embedded task (``embedded_task``) is such a base config, written by
``graftrl.embedded.base`` into ``OUT/data`` and evaluated on its held-out split.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.config import apply_overrides, config_from_dict, load_config, read_config_file
from graftrl.embedded.base import (  # noqa: F401 - re-exported: the embedded sizes, as before
    DEFAULT,
    HELDOUT,
    QUICK,
    DemoSettings,
    EmbeddedBase,
    demo_config,
    demo_settings,
    write_embedded_base,
    write_problems,
)
from graftrl.embedded.task import DEFAULT_TASK
from graftrl.evaluation.benchmarks import Benchmark, load_benchmarks
from graftrl.evaluation.evaluate import EvalProtocol
from graftrl.experiments.matrix import CompareError
from graftrl.reporting.provenance import results_provenance
from graftrl.storage.data import MathProblem
from graftrl.storage.rundir import ExperimentDir
from graftrl.verifiers.registry import build_verifier

EVAL_SEED = 10_000
"""A cell of seed s samples its evaluation from seed ``EVAL_SEED + s`` (each benchmark alike)."""


@dataclass(frozen=True)
class Evaluation:
    """How every cell is evaluated: the paper's protocol on named benchmarks."""

    benchmarks: tuple[Benchmark, ...]
    samples: int = EvalProtocol.samples
    """Samples per problem (the paper's 8)."""
    content_key: bool = True
    """Key the cells by the benchmarks' content. False keys them by problem ids only: the embedded
    task's held-out split, a function of its ids, keyed so since before benchmarks had names (the
    committed cells' digests)."""

    @property
    def problems(self) -> list[MathProblem]:
        return [p for b in self.benchmarks for p in b.problems]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.benchmarks]

    def protocol(self, config: Any) -> EvalProtocol:
        """The cell's protocol: the paper's sampling with the run's prompt format, length limit
        (``validation.max_new_tokens`` when set, as validation uses, else the rollout's) and what
        counts as correct (``reward.success_threshold``)."""
        return EvalProtocol(
            samples=self.samples,
            max_new_tokens=config.validation.max_new_tokens or config.rollout.max_new_tokens,
            prompt_suffix=config.data.prompt_suffix,
            success_threshold=config.reward.success_threshold,
        )

    def key(self, config: Any) -> list[Any]:
        """The evaluation's part of a cell's digest: samples, length limit and problem ids (the
        embedded task's key), then what only other evaluations have: the benchmark split and the
        problems' content (for a verifier other than math, each row's extra fields too: a code
        row's tests). (The prompt format and the checkpoint rule are in the config's part.)"""
        key: list[Any] = [self.samples, self.protocol(config).max_new_tokens, [p.id for p in self.problems]]
        extra: dict[str, Any] = {}
        if len(self.benchmarks) > 1:
            extra["benchmarks"] = [[b.name, len(b.problems)] for b in self.benchmarks]
        if self.content_key:
            if config.reward.kind == "math":
                text = json.dumps([[p.id, p.problem, p.answer] for p in self.problems])
            else:  # what else the verifier reads: a code row's tests, a scorer's fields
                rows = [[p.id, p.problem, p.answer, dict(p.extra)] for p in self.problems]
                text = json.dumps(rows, sort_keys=True, default=str)
            extra["content"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return [*key, extra] if extra else key

    def summary(self, config: Any) -> dict[str, Any]:
        """What results.json records of the evaluation of a ``--base`` compare."""
        protocol = self.protocol(config)
        return {
            "benchmarks": {
                b.name: {"source": b.source, "problems": len(b.problems)} for b in self.benchmarks
            },
            "samples": protocol.samples,
            "temperature": protocol.temperature,
            "top_p": protocol.top_p,
            "max_new_tokens": protocol.max_new_tokens,
            "checkpoint": "best by validation average" if config.validation.files else "final",
        }


@dataclass(frozen=True)
class CompareTask:
    """What every cell trains and is evaluated on."""

    name: str
    base_config: dict[str, Any]
    """Raw config shared by all cells (policies, data, sizes); method and seed are set per cell."""
    evaluation: Evaluation
    provenance: dict[str, Any] = field(default_factory=dict)
    """Code commit and each starting model's weights hash and warm-start fingerprint
    (``reporting.provenance``), recorded in results.json."""
    settings: DemoSettings | None = None
    """The embedded task's sizes (results.json, the sweep's report); None for a ``--base`` config,
    whose report then has the paper's layout (a column per benchmark and their average)."""
    source: dict[str, Any] | None = None
    """A ``--base`` compare's config file and ``--set`` overrides, recorded in results.json."""

    @property
    def benchmark_columns(self) -> bool:
        """The report's tables have a column per benchmark (the embedded task keeps its
        models-as-columns tables, so its committed reports read the same)."""
        return self.settings is None

    @property
    def config(self) -> Any:
        """The validated base config (method and seed as the file has them)."""
        return config_from_dict(self.base_config, "(base config)")


def base_task(
    path: Path,
    overrides: Sequence[str] = (),
    benches: Sequence[str] = (),
    eval_samples: int | None = None,
    name: str | None = None,
    settings: DemoSettings | None = None,
    content_key: bool = True,
) -> CompareTask:
    """The task of ``graftrl compare --base PATH [--set KEY=VALUE ...] [--bench NAME=FILE ...]``.

    Refused in one line before anything trains when there is nothing to evaluate on (neither
    ``benches`` nor the config's ``validation.files``). ``eval_samples``: default the paper's 8.
    ``name``, ``settings``, ``content_key``: the embedded task's (``embedded_base_task``)."""
    config = load_config(path, list(overrides))  # errors name the file and the key
    raw = apply_overrides(read_config_file(path), list(overrides))  # paths as the config resolves them
    if benches:
        specs = list(benches)
    elif config.validation.files:
        specs = config.validation.specs()
    else:
        raise CompareError(
            f"--base {path}: nothing to evaluate the cells on: the config has no validation.files and "
            "no --bench was given; add --bench NAME=FILE (a JSONL with problem and answer) or "
            "validation.files to the config"
        )
    samples = EvalProtocol.samples if eval_samples is None else eval_samples
    if samples < 1:
        raise CompareError(f"--eval-samples must be >= 1, got {samples}")
    checker = build_verifier(config.reward)  # the rows as the cells' verifier reads them
    try:
        benchmarks = load_benchmarks(specs, check=checker.check_problem)
    finally:
        checker.close()
    evaluation = Evaluation(tuple(benchmarks), samples, content_key)
    local = {p.name: p.path for p in config.policies if Path(p.path).is_dir()}
    source = None if settings is not None else {"config": str(path), "set": list(overrides)}
    return CompareTask(name or path.name, raw, evaluation, results_provenance(local), settings, source)


def embedded_base_task(base: EmbeddedBase) -> CompareTask:
    """The embedded task's ``base_task``: evaluated on its held-out split with its sample count."""
    return base_task(
        base.config,
        benches=[f"{HELDOUT}={base.heldout}"],
        eval_samples=base.settings.eval_samples,
        name=base.label,
        settings=base.settings,
        content_key=False,
    )


def embedded_task(
    out_dir: Path,
    cache_dir: Path | None,
    quick: bool,
    console: Console,
    name: str = DEFAULT_TASK,
    mixes: Mapping[str, Mapping[str, float]] | None = None,
    warmstart: Mapping[str, float] | None = None,
    pin_dir: Path | None = None,
) -> CompareTask:
    """The demo's task ``name``, written as a base config into ``OUT/data`` (``embedded.base``):
    warm-started (cached) embedded models and a procedural train / held-out split. ``mixes``,
    ``warmstart``, ``pin_dir``: as ``write_embedded_base``."""
    folder = ExperimentDir(out_dir).train_data.parent
    base = write_embedded_base(folder, name, quick, cache_dir, console, mixes, warmstart, pin_dir)
    return embedded_base_task(base)


def evaluate_cell(
    policies: Sequence[Any], evaluation: Evaluation, config: Any, verifier: Any, seed: int
) -> dict[str, dict[str, Any]]:
    """policy -> {"pass_at_1", "per_family", "per_problem"} (and with several benchmarks
    "per_benchmark"): pass@1 on each benchmark, its unweighted mean over them, per family over every
    problem; "per_problem" is benchmark -> each problem's correct rate (the cell keeps it beside its
    done marker, ``problem_results``, not in its result rows)."""
    from graftrl.evaluation.evaluate import evaluate_pass_at_1, pass_at_1_by_family
    from graftrl.models.rollout import HFRolloutEngine

    protocol = evaluation.protocol(config)
    engine = HFRolloutEngine(config.rollout.max_batch_size, share_prompts=config.rollout.share_prompts)
    out = {}
    for policy in policies:
        results = [
            evaluate_pass_at_1(policy, b.problems, verifier, protocol, EVAL_SEED + seed, engine)
            for b in evaluation.benchmarks
        ]
        per_benchmark = {
            b.name: list(r["per_problem"]) for b, r in zip(evaluation.benchmarks, results, strict=True)
        }
        if len(results) == 1:
            out[policy.name] = {
                "pass_at_1": float(results[0]["pass_at_1"]),
                "per_family": results[0].get("per_family", {}),
                "per_problem": per_benchmark,
            }
            continue
        per_problem = [rate for result in results for rate in result["per_problem"]]
        out[policy.name] = {
            "pass_at_1": statistics.fmean(float(r["pass_at_1"]) for r in results),
            "per_family": pass_at_1_by_family(evaluation.problems, per_problem),
            "per_benchmark": {
                b.name: float(r["pass_at_1"]) for b, r in zip(evaluation.benchmarks, results, strict=True)
            },
            "per_problem": per_benchmark,
        }
    return out
