"""`graftrl analyze RUN_DIR`: the paper's diagnostics for one run.

This module reads the run and computes the numbers (``RunAnalysis`` and its parts, from pure
functions of the loaded rows; the equations from ``graftrl.core``); it writes nothing:
``analysis_report`` writes them as analysis.md and ``plots`` draws the figures.

Inputs (all in the run folder): metrics.jsonl (required), compatibility.jsonl, validation.jsonl,
config.yaml, best/best.json and a trajectory store (``store/``), each used when present.

Definitions used (algorithm.md §5, paper Figure 1, Table 9, Appendix D):

- complementarity of (receiver R, peer S) at a step: fraction of R's all-fail prompts on which S
  succeeds at least once (metrics key ``complementarity/S`` of R). Steps where R has no all-fail
  prompt (``all_fail_frac == 0``) are undefined and left out of the mean. With a store, the value
  is recomputed from the stored rewards and compared step by step.
- exchange per direction S -> R, for every method that trains on peer rows, from the plan keys
  each logs (``EXCHANGE_KEYS``): candidates and selected prompts (GRAFT, LUFFY: ``candidates/S``,
  ``selected/S``; SGT: ``eligible/S`` and ``nll_responses/S``, the prompts whose one correct S
  response trains with the NLL term; pooling: ``pooled/S``; HACPO: ``omega/S``, every prompt of
  the batch); transferred responses and the admitted ones (w > 0: they entered the loss) from
  compatibility.jsonl (fallback: R's ``peer_responses`` / ``peer_admitted`` when R has one source).
- w: the weight each transferred response was trained with, as compatibility.jsonl logs it; a
  log written before it did is recomputed with the run's rule from config.yaml (``weights``:
  eq. 8 with ``graft.delta``, default 0.8; w = 1 without the gate), with a note.
- clipping: mean over steps of the per-step clipped-token fractions; the zero-peer-clipping share
  counts, among (step, receiver) pairs that trained on peer tokens (``clip_frac_peer`` logged),
  those with ``clip_frac_peer == 0``.
- compute: accelerator-hours = accelerators x summed per-step wall-clock ``time_step`` / 3600.
  ``time_step`` is the sum of the step's rollout, reward, peer log-prob and update phases, so it
  excludes validation and checkpointing. A policy's accelerators come from its config entry
  (``accelerators_of``): ``resources.num_gpus`` under ``backend: ray`` (its actors' GPUs, a
  fraction when it shares one), else ``parallel.data`` (its FSDP ranks, one device each; 1 by
  default). Per model and total (the sum over models).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from graftrl.console import warn
from graftrl.core.compatibility import DELTA as DEFAULT_DELTA
from graftrl.errors import UserError
from graftrl.reporting.complementarity import Complementarity, check_against_store, complementarity_by_step
from graftrl.reporting.exchange import Exchange, exchange_by_direction
from graftrl.reporting.run_logs import read_log, success_threshold_of
from graftrl.reporting.served import ServedCost, served_costs
from graftrl.reporting.weights import WeightRule, logs_weights, recomputed_note
from graftrl.storage.checkpoint import newest_usable, required_files
from graftrl.storage.rundir import RunDir

_TIME_PHASES = ("time_rollout", "time_reward", "time_peer_logprob", "time_update")


class AnalysisError(UserError):
    """A run folder that cannot be analysed, with the file named and what to do."""


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------


@dataclass
class Clipping:
    own: dict[str, float]
    """Model -> mean over steps of clip_frac_own."""
    peer: dict[str, float]
    """Receiver -> mean over steps with peer tokens of clip_frac_peer."""
    peer_steps: dict[str, int]
    """Receiver -> steps on which it trained on peer tokens."""
    zero_peer_steps: dict[str, int]
    """Receiver -> of those, steps with clip_frac_peer == 0."""

    def zero_peer_share(self, model: str | None = None) -> float | None:
        """Share of steps with zero peer clipping, for one receiver or pooled over all."""
        models = [model] if model is not None else list(self.peer_steps)
        total = sum(self.peer_steps.get(m, 0) for m in models)
        return sum(self.zero_peer_steps.get(m, 0) for m in models) / total if total else None


@dataclass
class Compute:
    accelerators: dict[str, float]
    seconds: dict[str, float]
    """Model -> summed per-step wall-clock (time_step)."""
    steps: dict[str, int]
    best_last_step: dict[str, int] = field(default_factory=dict)
    """Model -> last training step (0-based) counted for the best checkpoint."""
    seconds_to_best: dict[str, float] = field(default_factory=dict)
    best_note: str | None = None

    def hours(self, model: str) -> float:
        return self.accelerators[model] * self.seconds[model] / 3600

    @property
    def total_hours(self) -> float:
        return sum(self.hours(m) for m in self.seconds)

    def hours_to_best(self, model: str) -> float | None:
        if model not in self.seconds_to_best:
            return None
        return self.accelerators[model] * self.seconds_to_best[model] / 3600

    @property
    def total_hours_to_best(self) -> float | None:
        values = [self.hours_to_best(m) for m in self.seconds]
        return sum(v for v in values if v is not None) if values and None not in values else None


@dataclass
class RunAnalysis:
    run_dir: Path
    method: str
    models: list[str]
    steps: list[int]
    delta: float
    weight_rule: WeightRule
    """How the run weighed transferred responses (what ``w`` is recomputed with for an old log)."""
    weights_logged: bool
    """compatibility.jsonl records the applied weights (else they were recomputed)."""
    complementarity: list[Complementarity]
    exchange: list[Exchange]
    clipping: Clipping
    compute: Compute
    validation: list[dict[str, Any]]
    store_report: str | None
    store_ok: bool | None
    notes: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl, one row per (step, model) (a step logged twice by a resume: the later row)."""
    sources: list[str] = field(default_factory=list)
    """The files the analysis read (metrics.jsonl first)."""
    served: list[ServedCost] = field(default_factory=list)
    """Each served peer's share of the exchange and its cost (``reporting.served``)."""


# ------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------


def _read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The valid rows of a run log: a torn last line (a crash mid-append) is skipped with a note,
    a damaged line (not UTF-8, not JSON, a value of the wrong kind) with a warning and a note."""

    return read_log(path, on_torn=notes.append, on_bad=lambda message: _damaged(notes, message))


def _damaged(notes: list[str], message: str) -> None:
    """A damaged input the analysis goes on without: one warning line, and a note in the report."""
    warn(message)
    notes.append(message)


def _read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    """The run's config.yaml as a mapping; unreadable (not UTF-8, not YAML, not a mapping): a
    warning, and the defaults."""
    if not path.exists():
        return {}
    try:
        loaded = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        _damaged(notes, f"{path}: unreadable ({type(error).__name__}); the defaults are used")
        return {}
    if not isinstance(loaded, dict):
        _damaged(notes, f"{path}: not a mapping of sections; the defaults are used")
        return {}
    return loaded


def _latest_rows(rows: Sequence[dict[str, Any]], key: str, path: Path) -> list[dict[str, Any]]:
    """One row per (step, key): a resumed run may log a step twice; the later row wins."""
    latest: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        if "step" not in row or key not in row:
            raise AnalysisError(f"{path}: a row lacks field 'step' or {key!r}: {str(row)[:120]}")
        latest[(int(row["step"]), str(row[key]))] = row
    return [latest[k] for k in sorted(latest)]


def accelerators_of(config: Mapping[str, Any], models: Sequence[str]) -> dict[str, float]:
    """Model -> accelerators its trainer held, from the run config's real fields: under ``backend:
    ray`` its ``resources.num_gpus`` (the total over its rank actors; a fraction shares a GPU),
    else (or with no GPUs reserved) its ``parallel.data`` ranks; 1 when the config says nothing."""
    counts: dict[str, float] = {model: 1.0 for model in models}
    ray = config.get("backend") == "ray"
    for spec in config.get("policies") or []:
        if not isinstance(spec, dict) or spec.get("name") not in counts:
            continue
        resources = spec.get("resources") if isinstance(spec.get("resources"), dict) else {}
        parallel = spec.get("parallel") if isinstance(spec.get("parallel"), dict) else {}
        gpus, ranks = resources.get("num_gpus"), parallel.get("data")
        if ray and isinstance(gpus, int | float) and not isinstance(gpus, bool) and gpus > 0:
            counts[spec["name"]] = float(gpus)
        elif isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1:
            counts[spec["name"]] = float(ranks)
    return counts


def _batch_prompts(config: Mapping[str, Any]) -> int:
    """The run's ``train.batch_prompts`` (the schema's default when config.yaml lacks it)."""
    from graftrl.config.schema import TrainConfig

    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    value = train.get("batch_prompts")
    return (
        value if isinstance(value, int) and value > 0 else TrainConfig.model_fields["batch_prompts"].default
    )


def _best_last_steps(best: Any, models: Sequence[str]) -> dict[str, int] | None:
    """best.json -> model -> last training step (0-based, inclusive) of the best checkpoint.

    Accepted forms: {"completed_steps": k} (steps 0..k-1), {"step": s} (steps 0..s, the 0-based
    step after which the checkpoint was validated, as in metrics.jsonl), {"checkpoint":
    ".../step_000010"} (10 completed steps); per model as {name: {...}} (what
    ``graftrl.training.validation`` writes) or under "models", or once at the top level for all models.
    A model without an entry gets no hours-to-best.
    """

    def one(entry: Any) -> int | None:
        if not isinstance(entry, dict):
            return None
        if isinstance(entry.get("completed_steps"), int):
            return entry["completed_steps"] - 1
        if isinstance(entry.get("step"), int):
            return entry["step"]
        match = re.search(r"step_(\d+)", str(entry.get("checkpoint", "")))
        return int(match.group(1)) - 1 if match else None

    if not isinstance(best, dict):
        return None
    per_model = best.get("models") if isinstance(best.get("models"), dict) else best
    found = {m: one(per_model.get(m)) for m in models}
    if any(v is not None for v in found.values()):
        return {m: v for m, v in found.items() if v is not None}
    common = one(best)
    return {m: common for m in models} if common is not None else None


# ------------------------------------------------------------------------------------------
# Computation
# ------------------------------------------------------------------------------------------


def _clipping(rows: Sequence[dict[str, Any]], models: Sequence[str]) -> Clipping:
    own: dict[str, float] = {}
    peer: dict[str, float] = {}
    peer_steps: dict[str, int] = {}
    zero: dict[str, int] = {}
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        own_values = [float(r["clip_frac_own"]) for r in mine if r.get("clip_frac_own") is not None]
        if own_values:
            own[model] = statistics.fmean(own_values)
        peer_values = [float(r["clip_frac_peer"]) for r in mine if r.get("clip_frac_peer") is not None]
        if peer_values:
            peer[model] = statistics.fmean(peer_values)
        peer_steps[model] = len(peer_values)
        zero[model] = sum(v == 0 for v in peer_values)
    return Clipping(own, peer, peer_steps, zero)


def step_seconds(row: Mapping[str, Any]) -> float:
    """Wall-clock of one logged step: ``time_step``, else the sum of its phases."""
    if row.get("time_step") is not None:
        return float(row["time_step"])
    return sum(float(row.get(k) or 0.0) for k in _TIME_PHASES)


def _compute(
    rows: Sequence[dict[str, Any]],
    models: Sequence[str],
    accelerators: Mapping[str, float],
    best_path: Path,
    notes: list[str],
) -> Compute:
    seconds = {m: sum(step_seconds(r) for r in rows if r["model"] == m) for m in models}
    steps = {m: sum(1 for r in rows if r["model"] == m) for m in models}
    compute = Compute(dict(accelerators), seconds, steps)
    if best_path.exists():
        try:
            best = json.loads(best_path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            _damaged(notes, f"{best_path}: unreadable ({type(error).__name__}); no hours-to-best")
            return compute
        last = _best_last_steps(best, models)
        if last is None:
            compute.best_note = f"{best_path.name}: no 'completed_steps', 'step' or 'checkpoint' field found; no hours-to-best"
            return compute
        compute.best_last_step = last
        compute.seconds_to_best = {
            m: sum(step_seconds(r) for r in rows if r["model"] == m and int(r["step"]) <= last[m])
            for m in last
        }
    return compute


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------


def analyze_run(
    run_dir: str | Path, *, store_dir: str | Path | None = None, delta: float | None = None
) -> RunAnalysis:
    """The numbers of ``graftrl analyze`` for a run folder (``analysis_report.write_analysis``
    writes them as analysis.md and figures)."""
    run_dir = Path(run_dir)
    files = RunDir(run_dir)
    metrics_path = files.metrics
    if not metrics_path.exists():
        raise AnalysisError(
            f"{run_dir}: no metrics.jsonl; pass a run folder written by `graftrl train` (its --out)"
        )
    notes: list[str] = []
    raw = _read_jsonl(metrics_path, notes)
    rows = _latest_rows(raw, "model", metrics_path)
    if not rows:
        raise AnalysisError(f"{metrics_path}: no rows; the run has not completed a step yet")
    config = _read_config(files.config, notes)
    models = list(dict.fromkeys(r["model"] for r in raw))  # the run's order
    steps = sorted({int(r["step"]) for r in rows})
    method = str(config.get("method") or rows[0].get("method") or "?")
    graft = config.get("graft") if isinstance(config.get("graft"), dict) else {}
    try:
        delta = float(graft.get("delta", DEFAULT_DELTA)) if delta is None else delta
        rule = WeightRule.of(method, {**graft, "delta": delta})
    except (TypeError, ValueError) as error:
        _damaged(notes, f"{files.config}: field 'graft' is not usable ({error}); the defaults are used")
        delta = DEFAULT_DELTA
        rule = WeightRule.of(method, {"delta": delta})

    logged = {(int(r["step"]), r["model"]) for r in rows}
    compat: list[dict[str, Any]] = []
    compat_path = files.compatibility
    if compat_path.exists():
        compat = [
            c
            for c in _latest_rows(_read_jsonl(compat_path, notes), "receiver", compat_path)
            if (int(c["step"]), c["receiver"]) in logged
        ]
    if note := recomputed_note(compat, rule):
        notes.append(note)
    validation: list[dict[str, Any]] = []
    validation_path = files.validation
    if validation_path.exists():
        validation = _read_jsonl(validation_path, notes)
        if all("step" in r and "model" in r for r in validation):
            validation = _latest_rows(validation, "model", validation_path)  # a resume repeats steps

    comps = complementarity_by_step(rows, models)  # then checked against the store's rewards
    _check_checkpoints(files, models, notes)

    store_root = Path(store_dir) if store_dir is not None else files.store
    store_report = store_ok = None
    from graftrl.storage.store import MANIFEST as STORE_MANIFEST

    if (store_root / STORE_MANIFEST).exists():
        from graftrl.storage.store import StoreError, TrajectoryStore

        try:
            store = TrajectoryStore(store_root)
            threshold = success_threshold_of(config)  # the run's successes, as it logged them
            store_report, store_ok = check_against_store(comps, store, steps, notes, threshold)
        except StoreError as error:
            store_report, store_ok = str(error), False
    elif store_dir is not None:
        notes.append(f"{store_root}: no trajectory store (manifest.json missing)")

    analysis = RunAnalysis(
        run_dir=run_dir,
        method=method,
        models=models,
        steps=steps,
        delta=delta,
        weight_rule=rule,
        weights_logged=all(logs_weights(c) for c in compat),
        complementarity=comps,
        exchange=exchange_by_direction(rows, compat, rule, _batch_prompts(config)),
        clipping=_clipping(rows, models),
        compute=_compute(rows, models, accelerators_of(config, models), files.best_index, notes),
        validation=validation,
        store_report=store_report,
        store_ok=store_ok,
        notes=notes,
        rows=rows,
        served=served_costs(rows),
    )
    analysis.sources = [files.metrics.name] + [
        name
        for name, present in (
            (files.compatibility.name, files.compatibility.exists()),
            (files.validation.name, bool(validation)),
            (files.config.name, files.config.exists()),
            (files.best_index.relative_to(files.root).as_posix(), files.best_index.exists()),
            ("trajectory store", store_report is not None),
        )
        if present
    ]
    return analysis


def _check_checkpoints(files: RunDir, models: Sequence[str], notes: list[str]) -> None:
    """Verify the run's checkpoints against their manifests as ``--resume`` does (newest first, up
    to the newest intact one): each damaged one is named in a warning and a note; nothing moves."""
    usable, damaged = newest_usable(files.checkpoints, required_files(models))
    for check in damaged:
        fallback = f"the newest intact one is {usable.folder.name}" if usable else "no checkpoint is intact"
        _damaged(
            notes,
            f"checkpoint {check.folder.name}: {check.problem}; {fallback} (`graftrl train --resume` sets it aside)",
        )


def validation_metrics(validation: Sequence[Mapping[str, Any]]) -> list[str]:
    """The numeric fields of validation.jsonl rows (step and timings excluded), in first-seen order."""
    keys = dict.fromkeys(
        k
        for r in validation
        for k, v in r.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "step" and not k.startswith("time")
    )
    return list(keys)
