"""The cells of `graftrl compare`: one (variant, seed) run each, trained and evaluated, or reused.

Every cell trains in ``OUT/runs/<variant>-seed<seed>/``; when it starts it records what it is
trained from (``cell.json``, ``cell_inputs``: config, data and starting weights by content, and
the evaluation apart), and when done it writes ``done.json`` there with its result rows and a
digest of everything that determines it. A rerun skips cells whose marker matches. Otherwise the
record decides: a cell recorded with the same training inputs continues from its last checkpoint
(the trainer's exact resume; a finished one whose evaluation alone changed is re-evaluated, not
retrained); a cell recorded with other inputs, or with no record, is discarded and retrained from
step 0, with one line naming what changed. Paths play no part: a folder moved with its content
unchanged continues. A finished cell with the same digest in another folder (``--reuse``) is
copied instead of trained. Who runs the cells (one after the other, side by side, on a Ray
cluster) is ``launchers``'.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from graftrl.config import ConfigError, apply_overrides, config_from_dict
from graftrl.errors import UserError
from graftrl.evaluation.stats import WARM_START
from graftrl.experiments.cell_inputs import WEIGHTS, CellInputs, changes, read_record
from graftrl.experiments.compare.task import CompareTask, evaluate_cell
from graftrl.experiments.matrix import CompareError, Variant
from graftrl.reporting.problem_results import PER_PROBLEM, problem_results
from graftrl.reporting.run_logs import read_run_metrics
from graftrl.storage.checkpoint import list_checkpoints
from graftrl.storage.rundir import ExperimentDir, RunDir, append_jsonl, read_jsonl


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


def cell_name(variant: str, seed: int) -> str:
    """A cell's name (its run folder under ``OUT/runs``, ``--only-cell``'s argument)."""
    return ExperimentDir(Path()).run(variant, seed).root.name


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


CELL_VERSION = 1
"""Part of every cell's digest. Bump it with any change that alters what a cell computes — a
changed default, a fix in training or evaluation — so that finished cells are retrained rather
than reused. (The key leaves out fields at their defaults, so a new config field, whose default
keeps today's behaviour, does not invalidate the cells already run.)"""

WHERE_IT_RUNS = ("ray",)
"""Config sections that say where a cell runs, not what it computes: left out of its digest (a
cell run on one cluster is the same cell on another)."""


def _by_content(path: str) -> str:
    """A local file by its SHA-256 (a cell is recognised in another checkout), else as written."""
    from graftrl.files import sha256_file

    return sha256_file(Path(path))[0] if Path(path).is_file() else path


def _scorer_by_content(path: str) -> str:
    """``reward.function.path`` with its file by SHA-256 (``<sha256>:compute_score``): a cell is
    recognised in another checkout, and retrained when the scorer's code changes; an import path
    (``package.module:function``) as written."""
    from graftrl.verifiers.function import parse_scorer_path  # the scorer's own reading of it

    try:
        target, function, is_file = parse_scorer_path(path)
    except UserError:  # refused when the verifier is built, in one line
        return path
    return f"{_by_content(target)}:{function}" if is_file else path


def _cell_key(task: CompareTask, config: Any) -> dict[str, Any]:
    """The cell's config without the fields at their defaults, its files named by content, not
    location: each policy's path by its starting weights' hash, the training and validation files
    and a scorer file (``reward.function.path``) by their hash. A finished cell committed from one
    checkout (or cache folder) is then recognised in another. Whether progress bars show, and
    where it runs, are left out."""
    from graftrl.evaluation.benchmarks import parse_benchmark_spec

    raw = config.model_dump(mode="json", exclude_defaults=True)
    for section in WHERE_IT_RUNS:
        raw.pop(section, None)
    raw.get("logging", {}).pop("progress", None)
    if raw.get("logging") == {}:
        del raw["logging"]
    models = task.provenance.get("models", {})
    for policy in raw["policies"]:
        if policy["name"] in models:
            policy["path"] = models[policy["name"]]["weights_sha256"]
    raw["data"]["train"] = _by_content(raw["data"]["train"])
    scorer = raw.get("reward", {}).get("function", {})
    if scorer.get("path"):
        scorer["path"] = _scorer_by_content(scorer["path"])
    files = raw.get("validation", {}).get("files")
    if isinstance(files, dict):
        raw["validation"]["files"] = {name: _by_content(path) for name, path in files.items()}
    elif isinstance(files, list):
        sources = [parse_benchmark_spec(spec) for spec in files]
        raw["validation"]["files"] = [
            f"{s.name}={_by_content(str(s.path))}" if s.path is not None else spec
            for s, spec in zip(sources, files, strict=True)
        ]
    return raw


def _cell_digest(task: CompareTask, config: Any) -> str:
    """What a cell's done marker must match: its config (files by content) and the evaluation."""
    return _digest(CELL_VERSION, _cell_key(task, config), task.evaluation.key(config))


def _store_by_content(path: str) -> str:
    """A stored peer's store by its fingerprint, else as written (a store that does not read)."""
    from graftrl.storage.store import TrajectoryStore

    try:
        return TrajectoryStore(path).fingerprint()
    except (OSError, UserError):
        return path


def _cell_inputs(task: CompareTask, config: Any) -> CellInputs:
    """The cell's inputs by content with each file apart, so that a change can be named: what
    trains it (``_cell_key``, split) and how it is evaluated."""
    key = copy.deepcopy(_cell_key(task, config))
    training: dict[str, Any] = {"cell version": CELL_VERSION, "data.train": key["data"].pop("train")}
    for policy in key["policies"]:
        training[WEIGHTS + policy["name"]] = policy.pop("path")
    if "files" in key.get("validation", {}):
        training["validation.files"] = key["validation"].pop("files")
    for peer in key.get("peers", []):
        training[f"peers.{peer['name']}"] = _store_by_content(peer.pop("path"))
    training["config"] = key
    return CellInputs(training, _digest(task.evaluation.key(config)))


def _read_done(path: Path, digest: str) -> dict[str, Any] | None:
    try:
        done = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):  # missing, or damaged (not UTF-8, not JSON): the cell runs again
        return None
    return done if isinstance(done, dict) and done.get("digest") == digest else None


def write_json_atomic(path: Path, data: Any) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=2))
    staging.replace(path)


MEASURED_FIELDS = ("wall_s", "train_cpu_s", "step_s_per_model", "reward_s_per_model")
"""Fields of a cell's marker (and of its rows) that measure this machine's time, not results: two
runs of one cell agree on everything else."""


def _compute_per_model(run_dir: Path, batch_prompts: int, n: int) -> dict[str, float]:
    """Mean over the models of each one's run totals: responses sampled (dynamic sampling logs its
    prompts per step), rows trained and optimizer steps (what HACPO's pooled batch doubles), and
    the seconds of its steps and of their verifying (``time_step``, ``time_reward``: what a code
    task's sandbox costs)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in read_run_metrics(run_dir):
        model = totals[row["model"]]
        # a rescue round (method: hint) samples n more responses per rescued prompt
        prompts = int(row.get("prompts_sampled") or batch_prompts) + int(row.get("rescue_attempted") or 0)
        model["rollouts_per_model"] += prompts * n
        model["rows_trained_per_model"] += int(row.get("train_rows") or 0)
        model["optimizer_steps_per_model"] += int(row.get("optimizer_steps") or 0)
        model["step_s_per_model"] += float(row.get("time_step") or 0.0)
        model["reward_s_per_model"] += float(row.get("time_reward") or 0.0)
    keys = ("rollouts_per_model", "rows_trained_per_model", "optimizer_steps_per_model")
    out = {k: statistics.fmean(m[k] for m in totals.values()) if totals else 0.0 for k in keys}
    for k in ("step_s_per_model", "reward_s_per_model"):
        out[k] = round(statistics.fmean(m[k] for m in totals.values()), 2) if totals else 0.0
    return out


class Verifiers:
    """One verifier per distinct ``reward:`` section, shared by the cells that use it (a variant
    may change the reward's extraction or timeouts); closed together."""

    def __init__(self) -> None:
        self._by_section: dict[str, Any] = {}

    def __call__(self, reward: Any) -> Any:
        from graftrl.verifiers.registry import build_verifier, start_verifier

        key = json.dumps(reward.model_dump(mode="json"), sort_keys=True)
        if key not in self._by_section:  # started before the cell's models load (math: lazily)
            self._by_section[key] = start_verifier(build_verifier(reward), reward.kind)
        return self._by_section[key]

    def close(self) -> None:
        for verifier in self._by_section.values():
            verifier.close()
        self._by_section.clear()

    def __enter__(self) -> Verifiers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CLOCK = "cell_clock.jsonl"
"""Per cell: after each training step, the training wall-clock and CPU seconds spent on the
steps kept so far (a resumed cell continues from the clock of its checkpoint's step, so its
compute is that of one uninterrupted run, not of the work a kill threw away)."""


class _CellClock:
    """The step callback that keeps ``CLOCK``; ``totals()`` at the end of training."""

    def __init__(self, run_dir: Path, on_step: Callable[[int, int], None] | None, steps: int) -> None:
        self.path, self.on_step, self.steps = run_dir / CLOCK, on_step, steps
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.offset: tuple[float, float] | None = None

    def _offset(self, first_step: int) -> tuple[float, float]:
        if self.offset is None:
            rows = read_jsonl(self.path) if self.path.exists() and first_step > 0 else []
            kept = [r for r in rows if r.get("step") == first_step - 1]
            self.offset = (kept[-1]["wall_s"], kept[-1]["cpu_s"]) if kept else (0.0, 0.0)
        return self.offset

    def totals(self, first_step: int) -> tuple[float, float]:
        wall, cpu = self._offset(first_step)
        return (
            wall + time.perf_counter() - self.started,
            cpu + time.process_time() - self.cpu_started,
        )

    def step(self, trainer: Any, step: int) -> None:
        wall, cpu = self.totals(trainer.start_step)
        append_jsonl(self.path, {"step": step, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
        if self.on_step is not None:
            self.on_step(step + 1, self.steps)


def _continuable(run_dir: Path, inputs: CellInputs, label: str, console: Console) -> bool:
    """Whether the cell folder ``run_dir`` (not finished under this digest) continues: only when
    its record says it was trained from ``inputs``' training inputs and it has a checkpoint (a
    finished one is then re-evaluated: its evaluation changed, or its marker is damaged).
    Otherwise it starts over, and a folder with something to lose says why in one line."""
    files = RunDir(run_dir)
    checkpoints = list_checkpoints(files.checkpoints)
    finished = files.done.exists()
    recorded = read_record(files.cell_inputs)
    if recorded is None:
        if checkpoints or finished:
            console.print(
                f"{label}: {run_dir} does not record what it was trained from (cell.json missing or "
                "unreadable; written by graftrl since cells record their inputs): retraining it from step 0",
                soft_wrap=True,
            )
        return False
    if recorded.training_digest != inputs.training_digest:
        changed = "; ".join(changes(recorded, inputs))
        console.print(
            f"{label}: {changed} changed since it was trained: retraining it from step 0", soft_wrap=True
        )
        return False
    if not checkpoints:  # killed before its first checkpoint, or copied by --reuse without weights
        if finished:
            console.print(
                f"{label}: {run_dir} keeps no checkpoint to evaluate again "
                "(a cell copied by --reuse leaves its weights behind): retraining it from step 0",
                soft_wrap=True,
            )
        return False
    if finished and recorded.evaluation != inputs.evaluation:
        console.print(
            f"{label}: its evaluation changed, its training did not: re-evaluating it", soft_wrap=True
        )
    return True


def run_cell(
    task: CompareTask,
    variant: Variant,
    seed: int,
    steps: int | None,
    out_dir: Path,
    verifiers: Verifiers,
    console: Console,
    resume: bool = True,
    progress: bool = True,
    donors: Mapping[str, Path] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Train and evaluate one (variant, seed) cell, or reuse its done marker. Returns (done, ran).

    ``resume`` False: the cell trains afresh and writes no marker (the demo's way). ``progress``
    False: no live progress bar (cells running side by side would draw over each other).
    ``donors``: finished cells elsewhere by digest (``donor_cells``), copied instead of trained.
    ``on_step(steps done, steps)``: after every training step (a display in another process).
    """
    from graftrl.training.trainer import Trainer

    config = cell_config(task, variant, seed, steps)
    run_dir = ExperimentDir(out_dir).run(variant.name, seed).root
    digest = _cell_digest(task, config)
    done = _finished(run_dir, digest, variant, seed, console, donors or {}) if resume else None
    if not progress:  # how a run is displayed does not change its result (nor its digest)
        config = config.model_copy(update={"logging": config.logging.model_copy(update={"progress": False})})
    if done is not None:
        return done, False
    inputs = _cell_inputs(task, config)
    label = f"{variant.name} seed {seed}"
    continuing = resume and run_dir.exists() and _continuable(run_dir, inputs, label, console)
    if run_dir.exists() and not continuing:
        shutil.rmtree(run_dir)
    if resume:  # before the first step: a checkpoint is only ever continued under this record
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(RunDir(run_dir).cell_inputs, inputs.to_json())
    method = "" if variant.method == variant.name else f" ({variant.method})"
    how = "continuing from its last checkpoint" if continuing else f"{config.train.steps} steps"
    console.print(f"[bold]{variant.name}[/bold]{method} seed {seed}: {how}")
    clock = _CellClock(run_dir, on_step, config.train.steps)
    verifier = verifiers(config.reward)
    trainer = Trainer(
        config, run_dir, verifier=verifier, step_callback=lambda step, _: clock.step(trainer, step)
    )
    # forced: the record showed the same content, which the trainer's own check would refuse when
    # a folder moved (it compares paths) and compare has no --force to offer
    trainer.train(resume=continuing, force=continuing)
    wall, cpu = clock.totals(trainer.start_step)
    policies, checkpoint_steps = _trained_policies(trainer, config, run_dir)
    scores = evaluate_cell(policies, task.evaluation, config, verifier, seed)
    per_problem = {model: score.pop("per_problem") for model, score in scores.items()}
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
            **({"checkpoint_steps": checkpoint_steps[model]} if checkpoint_steps else {}),
        }
        for model, score in scores.items()
    ]
    done = {
        "digest": digest,
        "rows": rows,
        "set": variant.set,
        **_compute_per_model(run_dir, config.train.batch_prompts, config.rollout.n),
    }
    if config.backend == "local":  # under Ray the policies' work is in their actors' processes
        done["train_cpu_s"] = round(cpu, 1)
    if resume:  # the per-problem results first: a done marker always has them beside it
        write_json_atomic(run_dir / PER_PROBLEM, problem_results(per_problem, task.evaluation))
        write_json_atomic(RunDir(run_dir).done, done)
    return done, True


def _trained_policies(trainer: Any, config: Any, run_dir: Path) -> tuple[list[Any], dict[str, int]]:
    """The policies a cell is evaluated with, and each one's training steps when it is not the
    last: the best checkpoint by validation average when the run validated (``RUN/best/``), else
    the final weights (in memory; from the last checkpoint under Ray)."""
    from graftrl.evaluation.targets import ModelTarget

    files = RunDir(run_dir)
    if config.validation.files:
        best = json.loads(files.best_index.read_text())
        policies = [ModelTarget.of_policy(p, path=str(files.best / p.name)).load() for p in config.policies]
        return policies, {p.name: int(best[p.name]["completed_steps"]) for p in config.policies}
    if config.backend == "local":
        return trainer.policies, {}
    last = list_checkpoints(files.checkpoints)[-1]
    return [ModelTarget.of_policy(p, path=str(last / p.name)).load() for p in config.policies], {}


def _warm_start_config(task: CompareTask) -> Any:
    return config_from_dict({**copy.deepcopy(task.base_config), "method": "grpo"})


def _warm_start_digest(task: CompareTask, config: Any) -> str:
    """The starting weights and the evaluation, and the reward section when its verifier is not
    math (which every warm-start digest before other verifiers left out, and still does)."""
    key = _cell_key(task, config)
    verifier = [key["reward"]] if key.get("reward", {}).get("kind", "math") != "math" else []
    return _digest(CELL_VERSION, key["policies"], task.evaluation.key(config), *verifier)


def finished_warm_start(task: CompareTask, out_dir: Path) -> dict[str, Any] | None:
    """The warm-start evaluation's done marker when it holds this task's digest, else None."""
    run_dir = ExperimentDir(out_dir).run(WARM_START).root
    return _read_done(RunDir(run_dir).done, _warm_start_digest(task, _warm_start_config(task)))


def warm_start_cell(
    task: CompareTask, out_dir: Path, verifiers: Verifiers, console: Console, resume: bool = True
) -> dict[str, Any]:
    """pass@1 of the untrained policies (evaluated once; its marker is reused like any cell's).

    ``resume`` False: evaluated afresh, nothing written.
    """
    from graftrl.evaluation.targets import ModelTarget

    config = _warm_start_config(task)
    run_dir = ExperimentDir(out_dir).run(WARM_START).root
    digest = _warm_start_digest(task, config)
    done = _read_done(RunDir(run_dir).done, digest) if resume else None
    if done is not None:
        return done
    if resume:
        console.print("[bold]warm-start[/bold]: evaluating the initial policies")
        run_dir.mkdir(parents=True, exist_ok=True)
    policies = [ModelTarget.of_policy(p).load() for p in config.policies]
    scores = evaluate_cell(policies, task.evaluation, config, verifiers(config.reward), seed=0)
    for score in scores.values():
        score.pop("per_problem")
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
        write_json_atomic(RunDir(run_dir).done, done)
    return done


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
                digest = json.loads(marker.read_bytes().decode("utf-8")).get("digest")
            except (OSError, ValueError, AttributeError):  # a damaged marker donates nothing
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
    write_json_atomic(RunDir(run_dir).done, done)
    console.print(f"[dim]{variant.name} seed {seed}: the same cell finished in {source}, reused[/dim]")
    return done
