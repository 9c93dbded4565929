"""The embedded task as a base config: what `graftrl compare --base` (and `graftrl train`) reads.

``write_embedded_base(folder, ...)`` prepares the task's warm-started models (the cache, graftrl's
shipped pair, an experiment's pinned copy, or a warm-start), draws the procedural train / held-out
split and writes ``folder/config.yaml`` (a run config on those models), ``folder/train.jsonl`` and
``folder/heldout.jsonl``. `graftrl compare` without ``--base`` does exactly this in ``OUT/data``
and then runs the ``--base`` path on it, evaluating on ``heldout.jsonl``; `graftrl embedded` does
it for a user, who can then run `graftrl compare --base` or `graftrl train` on the files.

The sizes of the embedded comparison (``DemoSettings``) live here too: the config carries the RL
settings, the settings the split's sizes and the evaluation's samples.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from graftrl.console import TaskBars
from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.task import DEFAULT_TASK, get_task, problem_row
from graftrl.storage.data import MathProblem, write_verl_parquet
from graftrl.storage.rundir import BaseConfigDir

HELDOUT = "heldout"
"""The benchmark name of the embedded task's held-out problems."""
DEFAULT_CACHE = Path.home() / ".cache" / "graftrl" / "embedded"
"""Where warm-started embedded models are cached unless ``--cache`` says otherwise."""


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
    paths: Mapping[str, Path], train_file: Path, method: str, seed: int, settings: DemoSettings
) -> dict[str, Any]:
    """The raw config of one embedded cell: the warm-started models at ``paths`` on ``train_file``."""
    task_sections = copy.deepcopy(get_task(settings.task).run_config)
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
        **task_sections,
    }


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` whole: jobs of one Slurm array may write the same base folder at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(staging, 0o644)
    os.replace(staging, path)


def write_problems(problems: Sequence[MathProblem], path: Path, task: str = DEFAULT_TASK) -> None:
    """Problems as JSONL rows (``problem_row``; what ``load_problems`` reads)."""
    _write_atomic(path, "".join(json.dumps(problem_row(p, task)) + "\n" for p in problems))


def verl_copy(jsonl: Path, problems: Sequence[MathProblem], task: str) -> Path:
    """The same problems as verl's Parquet beside ``jsonl`` (``<stem>.parquet``): the data in the
    format a verl user has, for every command that reads a problem file."""
    rows = [problem_row(p, task) for p in problems]
    return write_verl_parquet(rows, jsonl.with_suffix(".parquet"), f"graftrl/embedded-{task}", jsonl.stem)


@dataclass(frozen=True)
class EmbeddedBase:
    """The files ``write_embedded_base`` wrote and what they were made of."""

    config: Path
    train: Path
    heldout: Path
    models: dict[str, Path]
    """Spec name -> the starting checkpoint folder."""
    settings: DemoSettings
    label: str
    """The task's name in reports: ``embedded`` for the original arithmetic task, else
    ``embedded-<task>`` (so earlier reports read the same)."""


def write_embedded_base(
    folder: Path,
    task: str = DEFAULT_TASK,
    quick: bool = False,
    cache_dir: Path | None = None,
    console: Console | None = None,
    mixes: Mapping[str, Mapping[str, float]] | None = None,
    warmstart: Mapping[str, float] | None = None,
    pin_dir: Path | None = None,
) -> EmbeddedBase:
    """The embedded task ``task`` as a base config in ``folder`` (paths in it are absolute).

    ``quick``: smoke-test sizes and models; ``cache_dir``: where warm-started models live;
    ``mixes``: the models' warm-start family mixes, default the task's; ``warmstart``: stop
    settings replacing the task's. ``pin_dir``: the experiment's own copy of its starting weights
    (``embedded.shipped.pin_models``), used on any machine once written, so its committed cells
    stay valid where a local warm-start would give other last bits."""
    from graftrl.embedded.shipped import pin_models, pinned_models
    from graftrl.embedded.task import make_split
    from graftrl.embedded.warmstart import model_keys

    console = console or Console()
    settings = demo_settings(task, quick)
    pinned = pinned_models(pin_dir, model_keys(quick, 0, task, mixes, warmstart)) if pin_dir else None
    if pinned is not None:
        console.print(f"models: the experiment's pinned starting weights (SHA-256 verified) in {pin_dir}")
    paths = pinned or prepare_models(cache_dir, quick, console, task, mixes, warmstart)
    if pin_dir is not None and pinned is None:
        paths = pin_models(paths, pin_dir)
        console.print(f"models pinned in {pin_dir}: this experiment starts from them on any machine")
    files = BaseConfigDir(folder.resolve())
    train, heldout = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=task)
    write_problems(train, files.train, task)
    write_problems(heldout, files.heldout, task)
    if get_task(task).tests is not None:  # the code task: its rows in verl's format too
        verl_copy(files.train, train, task)
        verl_copy(files.heldout, heldout, task)
    models = {name: Path(path).resolve() for name, path in paths.items()}
    config = demo_config(models, files.train, "grpo", 0, settings)
    _write_atomic(files.config, yaml.safe_dump(config, sort_keys=False))
    label = "embedded" if task == "arith" else f"embedded-{task}"
    return EmbeddedBase(files.config, files.train, files.heldout, models, settings, label)


def warm_start_status(info: Mapping[str, Any]) -> str:
    """A warm-start's progress in words: its sampled accuracy against the target it stops at (the
    time left shown beside it runs to ``max_steps``, so it is at most that)."""
    accuracy = info.get("accuracy")
    measured = "not measured yet" if accuracy is None else f"{accuracy:.0%}"
    return f"sampled accuracy {measured}, stops at {info['target']:.0%} (or step {info['max_steps']})"


def prepare_models(
    cache_dir: Path | None,
    quick: bool,
    console: Console,
    name: str,
    mixes: Mapping[str, Mapping[str, float]] | None,
    warmstart: Mapping[str, float] | None,
) -> dict[str, Path]:
    """The task's models from the cache, graftrl's shipped pair or a warm-start, with progress bars."""
    from graftrl.embedded.warmstart import prepare_embedded_models

    cache_dir = cache_dir or DEFAULT_CACHE
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
