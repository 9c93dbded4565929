"""The embedded task of `graftrl compare`: its sizes (``DemoSettings``), the warm-started models,
the procedural train / held-out split and the base config every cell starts from (``CompareTask``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.console import TaskBars
from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.task import DEFAULT_TASK, get_task
from graftrl.reporting.provenance import results_provenance
from graftrl.storage.data import MathProblem
from graftrl.storage.rundir import ExperimentDir


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


def warm_start_status(info: Mapping[str, Any]) -> str:
    """A warm-start's progress in words: its sampled accuracy against the target it stops at (the
    time left shown beside it runs to ``max_steps``, so it is at most that)."""
    accuracy = info.get("accuracy")
    measured = "not measured yet" if accuracy is None else f"{accuracy:.0%}"
    return f"sampled accuracy {measured}, stops at {info['target']:.0%} (or step {info['max_steps']})"


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
    """The demo's task ``name``: warm-started (cached) embedded models and a procedural
    train/held-out split. ``mixes``: the models' warm-start family mixes, default the task's;
    ``warmstart``: stop settings replacing the task's. ``pin_dir``: the experiment's own copy of
    its starting weights (``embedded.shipped.pin_models``), used on any machine once written, so
    its committed cells stay valid where a local warm-start would give other last bits."""
    from graftrl.embedded.shipped import pin_models, pinned_models
    from graftrl.embedded.task import make_split
    from graftrl.embedded.warmstart import model_keys
    from graftrl.storage.data import load_problems

    settings = demo_settings(name, quick)
    pinned = pinned_models(pin_dir, model_keys(quick, 0, name, mixes, warmstart)) if pin_dir else None
    if pinned is not None:
        console.print(f"models: the experiment's pinned starting weights (SHA-256 verified) in {pin_dir}")
    paths = pinned or _prepare_models(cache_dir, quick, console, name, mixes, warmstart)
    if pin_dir is not None and pinned is None:
        paths = pin_models(paths, pin_dir)
        console.print(f"models pinned in {pin_dir}: this experiment starts from them on any machine")
    train, heldout = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=name)
    out = ExperimentDir(out_dir)
    write_problems(train, out.train_data)
    write_problems(heldout, out.heldout_data)
    base = demo_config(paths, out.train_data, "grpo", 0, settings)
    # "embedded" stays the arith task's name so earlier reports read the same.
    label = "embedded" if name == "arith" else f"embedded-{name}"
    provenance = results_provenance(paths)
    return CompareTask(label, base, load_problems(out.heldout_data), settings, provenance)


def _prepare_models(
    cache_dir: Path | None,
    quick: bool,
    console: Console,
    name: str,
    mixes: Mapping[str, Mapping[str, float]] | None,
    warmstart: Mapping[str, float] | None,
) -> dict[str, Path]:
    """The task's models from the cache, graftrl's shipped pair or a warm-start, with progress bars."""
    from graftrl.embedded.warmstart import prepare_embedded_models

    cache_dir = cache_dir or Path.home() / ".cache" / "graftrl" / "embedded"
    console.print(
        f"[bold]preparing the embedded models[/bold] for task {name!r}: cached in {cache_dir}, "
        "else installed from graftrl's shipped pair or warm-started"
    )
    started = time.perf_counter()
    bars = TaskBars(console)
    try:
        paths = prepare_embedded_models(
            cache_dir,
            quick=quick,
            seed=0,
            task=name,
            mixes=mixes,
            settings=warmstart,
            on_progress=lambda model, info: bars.update(
                f"warm-start {model}", info["step"], info["max_steps"], warm_start_status(info)
            ),
        )
    finally:
        bars.close()
    console.print(
        f"models ready in {time.perf_counter() - started:.0f}s: "
        + ", ".join(f"{k} -> {v}" for k, v in paths.items())
    )
    return paths
