"""`graftrl analyze RUN_DIR`: the paper's diagnostics for one run, as plots and analysis.md.

Inputs (all in the run folder): metrics.jsonl (required), compatibility.jsonl, validation.jsonl,
config.yaml, best/best.json and a trajectory store (``store/``), each used when present.

Definitions used (SPEC section 5, paper Figure 1, Table 9, Appendix D):

- complementarity of (receiver R, peer S) at a step: fraction of R's all-fail prompts on which S
  succeeds at least once (metrics key ``complementarity/S`` of R). Steps where R has no all-fail
  prompt (``all_fail_frac == 0``) are undefined and left out of the mean. With a store, the value
  is recomputed from the stored rewards and compared step by step.
- exchange per direction S -> R: candidates and selected prompts from R's metrics
  (``candidates/S``, ``selected/S``); transferred responses and admitted ones (s > delta) from
  compatibility.jsonl (fallback: R's ``peer_responses`` / ``peer_admitted`` when R has one source).
- w = 1[s > delta] * min(s, 1), delta from config.yaml ``graft.delta`` (default 0.8).
- clipping: mean over steps of the per-step clipped-token fractions; the zero-peer-clipping share
  counts, among (step, receiver) pairs that trained on peer tokens (``clip_frac_peer`` logged),
  those with ``clip_frac_peer == 0``.
- compute: accelerator-hours = accelerators x summed per-step wall-clock ``time_step`` / 3600.
  ``time_step`` is the sum of the step's rollout, reward, peer log-prob and update phases, so it
  excludes validation and checkpointing. One accelerator per policy unless the policy's config
  entry sets ``accelerators`` (or ``num_gpus``). Per model and total (the sum over models).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from graftrl.core.compatibility import DELTA as DEFAULT_DELTA
from graftrl.errors import UserError
from graftrl.storage.rundir import RunDir, RunLogError, read_jsonl

_TIME_PHASES = ("time_rollout", "time_reward", "time_peer_logprob", "time_update")
_STORE_TOLERANCE = 1e-6


class AnalysisError(UserError):
    """A run folder that cannot be analysed, with the file named and what to do."""


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------


@dataclass
class Complementarity:
    receiver: str
    peer: str
    by_step: dict[int, float]
    """Metrics value at every step where the receiver had an all-fail prompt."""
    store_by_step: dict[int, float] | None = None
    """Recomputed from the store's rewards (None without a store)."""
    mismatches: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, metrics value, store value) where the two disagree."""

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.by_step.values()) if self.by_step else None


@dataclass
class Exchange:
    source: str
    receiver: str
    steps: list[int]
    candidates: list[float]
    selected: list[float]
    transferred: list[int | None]
    admitted: list[int | None]
    s: list[float]
    """Every compatibility score of the direction (from compatibility.jsonl)."""
    w: list[float]

    @property
    def admission_rate(self) -> float | None:
        pairs = [(t, a) for t, a in zip(self.transferred, self.admitted, strict=True) if t is not None]
        total = sum(t for t, _ in pairs)
        if not total or any(a is None for _, a in pairs):
            return None
        return sum(a for _, a in pairs if a is not None) / total


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
    accelerators: dict[str, int]
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
    out_dir: Path
    method: str
    models: list[str]
    steps: list[int]
    delta: float
    complementarity: list[Complementarity]
    exchange: list[Exchange]
    clipping: Clipping
    compute: Compute
    validation: list[dict[str, Any]]
    store_report: str | None
    store_ok: bool | None
    notes: list[str]
    plots: dict[str, Path] = field(default_factory=dict)

    @property
    def report(self) -> Path:
        return self.out_dir / "analysis.md"


# ------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------


def _read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL log; a torn last line (a crash mid-append) is skipped with a note."""
    try:
        return read_jsonl(path, on_torn=notes.append)
    except RunLogError as error:
        raise AnalysisError(str(error)) from None


def _latest_rows(rows: Sequence[dict[str, Any]], key: str, path: Path) -> list[dict[str, Any]]:
    """One row per (step, key): a resumed run may log a step twice; the later row wins."""
    latest: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        if "step" not in row or key not in row:
            raise AnalysisError(f"{path}: a row lacks field 'step' or {key!r}: {str(row)[:120]}")
        latest[(int(row["step"]), str(row[key]))] = row
    return [latest[k] for k in sorted(latest)]


def _accelerators(config: Mapping[str, Any], models: Sequence[str]) -> dict[str, int]:
    counts = {model: 1 for model in models}
    for spec in config.get("policies") or []:
        if isinstance(spec, dict) and spec.get("name") in counts:
            for key in ("accelerators", "num_accelerators", "num_gpus", "gpus"):
                if isinstance(spec.get(key), int) and spec[key] >= 1:
                    counts[spec["name"]] = spec[key]
                    break
    return counts


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


def _complementarity_from_store(
    store: Any, steps: Sequence[int], pairs: Sequence[tuple[str, str]], notes: list[str]
) -> dict[tuple[str, str], dict[int, float]]:
    """(receiver, peer) -> step -> complementarity recomputed from stored rewards."""
    from graftrl.storage.store import StoreError

    out: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    stored = set(store.steps())
    for step in steps:
        if step not in stored:
            continue
        try:
            rows = store.read_step(step, token_logprobs=False)
        except StoreError as error:
            notes.append(f"store step {step} skipped in the complementarity check: {error}")
            continue
        successes: dict[str, dict[int, tuple[str, float]]] = defaultdict(dict)
        for row in rows:
            prompt, k = successes[row.source].get(row.group_index, (row.prompt_id, 0.0))
            successes[row.source][row.group_index] = (prompt, k + row.reward)
        for receiver, peer in pairs:
            own, other = successes.get(receiver), successes.get(peer)
            if not own or not other:
                continue
            if {g: p for g, (p, _) in own.items()} == {g: p for g, (p, _) in other.items()}:
                k_peer = {g: k for g, (_, k) in other.items()}
                k_own = [(g, k) for g, (_, k) in own.items()]
            else:  # groups not aligned by batch position: match by prompt id
                k_peer_by_prompt = {p: k for _, (p, k) in sorted(other.items())}
                k_peer = {g: k_peer_by_prompt.get(p, 0.0) for g, (p, _) in own.items()}
                k_own = [(g, k) for g, (_, k) in own.items()]
            fails = [g for g, k in k_own if k == 0]
            if fails:
                out[(receiver, peer)][step] = sum(k_peer[g] >= 1 for g in fails) / len(fails)
    return out


def weight(s: float, delta: float) -> float:
    """w = 1[s > delta] * min(s, 1) (eq. 8, as ``core.compatibility_weight``)."""
    return min(s, 1.0) if s > delta else 0.0


def _exchange(
    rows: Sequence[dict[str, Any]], compat: Sequence[dict[str, Any]], delta: float
) -> list[Exchange]:
    compat_at = {
        (int(c["step"]), c["receiver"]): c
        for c in compat
        if isinstance(c.get("s"), list)
        and isinstance(c.get("source"), list)
        and len(c["s"]) == len(c["source"])
    }
    directions: dict[tuple[str, str], Exchange] = {}
    for row in rows:
        receiver = row["model"]
        sources = [k.split("/", 1)[1] for k in row if k.startswith("selected/")]
        for source in sources:
            ex = directions.setdefault(
                (source, receiver), Exchange(source, receiver, [], [], [], [], [], [], [])
            )
            step = int(row["step"])
            ex.steps.append(step)
            ex.candidates.append(float(row.get(f"candidates/{source}") or 0.0))
            ex.selected.append(float(row.get(f"selected/{source}") or 0.0))
            entry = compat_at.get((step, receiver))
            if entry is not None:
                s = [float(x) for x, src in zip(entry["s"], entry["source"], strict=True) if src == source]
                ex.s += s
                ex.w += [weight(x, delta) for x in s]
                ex.transferred.append(len(s))
                ex.admitted.append(sum(x > delta for x in s))
            elif len(sources) == 1 and "peer_responses" in row:
                transferred = int(row.get("peer_responses") or 0)
                admitted = row.get("peer_admitted")
                ex.transferred.append(transferred)
                # the trainer logs peer_admitted only on steps with grafted responses
                ex.admitted.append(int(admitted) if admitted is not None else (None if transferred else 0))
            else:
                ex.transferred.append(None)
                ex.admitted.append(None)
    return [directions[k] for k in sorted(directions)]


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


def _step_seconds(row: Mapping[str, Any]) -> float:
    if row.get("time_step") is not None:
        return float(row["time_step"])
    return sum(float(row.get(k) or 0.0) for k in _TIME_PHASES)


def _compute(
    rows: Sequence[dict[str, Any]],
    models: Sequence[str],
    accelerators: Mapping[str, int],
    best_path: Path,
    notes: list[str],
) -> Compute:
    seconds = {m: sum(_step_seconds(r) for r in rows if r["model"] == m) for m in models}
    steps = {m: sum(1 for r in rows if r["model"] == m) for m in models}
    compute = Compute(dict(accelerators), seconds, steps)
    if best_path.exists():
        try:
            best = json.loads(best_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            notes.append(f"{best_path}: unreadable ({error}); no hours-to-best")
            return compute
        last = _best_last_steps(best, models)
        if last is None:
            compute.best_note = f"{best_path.name}: no 'completed_steps', 'step' or 'checkpoint' field found; no hours-to-best"
            return compute
        compute.best_last_step = last
        compute.seconds_to_best = {
            m: sum(_step_seconds(r) for r in rows if r["model"] == m and int(r["step"]) <= last[m])
            for m in last
        }
    return compute


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------


def analyze_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    store_dir: str | Path | None = None,
    delta: float | None = None,
) -> RunAnalysis:
    """Analyse a run folder; writes plots and ``analysis.md`` into ``out_dir`` (default
    ``run_dir/analysis``) and returns the numbers behind them."""
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
    config: dict[str, Any] = {}
    if files.config.exists():
        try:
            loaded = yaml.safe_load(files.config.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError as error:
            notes.append(f"config.yaml unreadable ({error}); defaults used")
    models = list(dict.fromkeys(r["model"] for r in raw))  # the run's order
    steps = sorted({int(r["step"]) for r in rows})
    method = str(config.get("method") or rows[0].get("method") or "?")
    if delta is None:
        graft = config.get("graft") if isinstance(config.get("graft"), dict) else {}
        delta = float(graft.get("delta", DEFAULT_DELTA))

    logged = {(int(r["step"]), r["model"]) for r in rows}
    compat: list[dict[str, Any]] = []
    compat_path = files.compatibility
    if compat_path.exists():
        compat = [
            c
            for c in _latest_rows(_read_jsonl(compat_path, notes), "receiver", compat_path)
            if (int(c["step"]), c["receiver"]) in logged
        ]
    validation: list[dict[str, Any]] = []
    validation_path = files.validation
    if validation_path.exists():
        validation = _read_jsonl(validation_path, notes)
        if all("step" in r and "model" in r for r in validation):
            validation = _latest_rows(validation, "model", validation_path)  # a resume repeats steps

    # complementarity: metrics, then the store's rewards
    fail_frac = {(int(r["step"]), r["model"]): r.get("all_fail_frac") for r in rows}
    comps: list[Complementarity] = []
    for receiver in models:
        peers = sorted(
            {
                k.split("/", 1)[1]
                for r in rows
                if r["model"] == receiver
                for k in r
                if k.startswith("complementarity/")
            }
        )
        for peer in peers:
            by_step = {
                int(r["step"]): float(r[f"complementarity/{peer}"])
                for r in rows
                if r["model"] == receiver
                and r.get(f"complementarity/{peer}") is not None
                and fail_frac.get((int(r["step"]), receiver)) != 0
            }
            comps.append(Complementarity(receiver, peer, by_step))

    store_root = Path(store_dir) if store_dir is not None else files.store
    store_report = store_ok = None
    from graftrl.storage.store import MANIFEST as STORE_MANIFEST

    if (store_root / STORE_MANIFEST).exists():
        from graftrl.storage.store import StoreError, TrajectoryStore

        try:
            store = TrajectoryStore(store_root)
            report = store.verify()
            store_report, store_ok = str(report), report.ok
            recomputed = _complementarity_from_store(
                store, steps, [(c.receiver, c.peer) for c in comps], notes
            )
            for c in comps:
                c.store_by_step = recomputed.get((c.receiver, c.peer), {})
                for step, value in sorted(c.store_by_step.items()):
                    logged_value = c.by_step.get(step)
                    if logged_value is None or abs(logged_value - value) > _STORE_TOLERANCE:
                        c.mismatches.append((step, math.nan if logged_value is None else logged_value, value))
        except StoreError as error:
            store_report, store_ok = str(error), False
    elif store_dir is not None:
        notes.append(f"{store_root}: no trajectory store (manifest.json missing)")

    analysis = RunAnalysis(
        run_dir=run_dir,
        out_dir=Path(out_dir) if out_dir is not None else files.analysis,
        method=method,
        models=models,
        steps=steps,
        delta=delta,
        complementarity=comps,
        exchange=_exchange(rows, compat, delta),
        clipping=_clipping(rows, models),
        compute=_compute(rows, models, _accelerators(config, models), files.best_index, notes),
        validation=validation,
        store_report=store_report,
        store_ok=store_ok,
        notes=notes,
    )
    analysis.out_dir.mkdir(parents=True, exist_ok=True)
    analysis.plots = _plots(analysis, rows)
    analysis.report.write_text(render_markdown(analysis, rows))
    return analysis


# ------------------------------------------------------------------------------------------
# Plots and Markdown
# ------------------------------------------------------------------------------------------


def _validation_metrics(validation: Sequence[Mapping[str, Any]]) -> list[str]:
    keys = dict.fromkeys(
        k
        for r in validation
        for k, v in r.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "step" and not k.startswith("time")
    )
    return list(keys)


def _plots(analysis: RunAnalysis, rows: Sequence[dict[str, Any]]) -> dict[str, Path]:
    from graftrl.reporting import plots

    out = analysis.out_dir
    label = analysis.run_dir.name or "run"
    made: dict[str, Path] = {}

    def path(name: str) -> Path:
        made[name] = out / f"{name}.png"
        return made[name]

    plots.plot_training_curves({label: rows}, path("reward"), key="reward_mean")
    plots.plot_training_curves({label: rows}, path("response_length"), key="response_length")
    if analysis.complementarity:
        plots.plot_complementarity({label: rows}, path("complementarity"))
    if analysis.exchange:
        panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {
            "selected prompts": {},
            "transferred responses": {},
            "admitted responses": {},
        }
        for ex in analysis.exchange:
            name = f"{ex.source} -> {ex.receiver}"
            panels["selected prompts"][name] = (ex.steps, ex.selected)
            for title, values in (
                ("transferred responses", ex.transferred),
                ("admitted responses", ex.admitted),
            ):
                points = [(s, v) for s, v in zip(ex.steps, values, strict=True) if v is not None]
                panels[title][name] = ([p[0] for p in points], [float(p[1]) for p in points])
        plots.plot_step_panels(panels, path("exchange"))
        scores = {ex.receiver: ex.s for ex in analysis.exchange}
        if any(scores.values()):
            plots.plot_compatibility_histogram(scores, path("compatibility_s"), analysis.delta)
            plots.plot_histograms(
                {f"{ex.source} -> {ex.receiver}": ex.w for ex in analysis.exchange},
                path("compatibility_w"),
                xlabel=f"weight w = 1[s > {analysis.delta}] min(s, 1)",
            )
    clip_panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {
        "own tokens": {},
        "peer (grafted) tokens, by receiver": {},
    }
    for model in analysis.models:
        for title, key in (
            ("own tokens", "clip_frac_own"),
            ("peer (grafted) tokens, by receiver", "clip_frac_peer"),
        ):
            points = [
                (int(r["step"]), float(r[key]))
                for r in rows
                if r["model"] == model and r.get(key) is not None
            ]
            if points:
                clip_panels[title][model] = ([p[0] for p in points], [p[1] for p in points])
    if any(clip_panels.values()):
        plots.plot_step_panels(
            {k: v for k, v in clip_panels.items() if v}, path("clipping"), "clipped-token fraction"
        )
    hours: dict[str, tuple[list[int], list[float]]] = {}
    for model in analysis.models:
        total, steps, values = 0.0, [], []
        for r in rows:
            if r["model"] == model:
                total += analysis.compute.accelerators[model] * _step_seconds(r) / 3600
                steps.append(int(r["step"]))
                values.append(total)
        hours[model] = (steps, values)
    plots.plot_step_panels({"cumulative accelerator-hours": hours}, path("compute"), "accelerator-hours")
    metrics = _validation_metrics(analysis.validation)
    if metrics:
        panels = {}
        for key in metrics[:4]:
            panels[key] = {}
            for model in dict.fromkeys(str(r.get("model", "run")) for r in analysis.validation):
                points = [
                    (int(r["step"]), float(r[key]))
                    for r in analysis.validation
                    if str(r.get("model", "run")) == model and r.get(key) is not None and "step" in r
                ]
                if points:
                    panels[key][model] = ([p[0] for p in points], [p[1] for p in points])
        plots.plot_step_panels(panels, path("validation"))
    return made


def _table(headers: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.3f}"


def _image(analysis: RunAnalysis, name: str, alt: str) -> str:
    plot = analysis.plots.get(name)
    return f"![{alt}]({plot.name})" if plot is not None else ""


def render_markdown(analysis: RunAnalysis, rows: Sequence[dict[str, Any]]) -> str:
    a = analysis
    files = RunDir(a.run_dir)
    sources = [files.metrics.name] + [
        name
        for name, present in (
            (files.compatibility.name, files.compatibility.exists()),
            (files.validation.name, bool(a.validation)),
            (files.config.name, files.config.exists()),
            (files.best_index.relative_to(files.root).as_posix(), files.best_index.exists()),
            ("trajectory store", a.store_report is not None),
        )
        if present
    ]
    out = [
        f"# Run analysis: {a.run_dir.name}",
        "",
        f"- run folder: `{a.run_dir}`",
        f"- method: {a.method}; models: {', '.join(a.models)}",
        f"- steps logged: {len(a.steps)} ({a.steps[0]}..{a.steps[-1]})",
        f"- compatibility floor delta = {a.delta}",
        f"- read: {', '.join(sources)}",
    ]
    out += [f"- note: {note}" for note in a.notes]

    out += ["", "## Complementarity (paper Figure 1)", ""]
    if a.complementarity:
        out.append(
            "Fraction of the receiver's all-fail prompts that the peer solves at least once, per step; "
            "steps where the receiver has no all-fail prompt are left out."
        )
        body = []
        for c in a.complementarity:
            values = list(c.by_step.values())
            if c.store_by_step is None:
                check = "no store"
            elif not c.store_by_step:
                check = "no stored steps for this pair"
            elif c.mismatches:
                check = "DISAGREES at steps " + ", ".join(
                    f"{s} (metrics {m:.4g}, store {v:.4g})" for s, m, v in c.mismatches[:5]
                )
            else:
                check = f"agrees on {len(c.store_by_step)} step(s)"
            body.append(
                [
                    c.receiver,
                    c.peer,
                    len(values),
                    c.mean,
                    min(values) if values else None,
                    max(values) if values else None,
                    check,
                ]
            )
        out += ["", _table(["receiver", "peer", "steps", "mean", "min", "max", "store check"], body)]
        out += ["", _image(a, "complementarity", "complementarity")]
    else:
        out.append("Not logged (a single-model run).")

    out += ["", "## Exchange volume", ""]
    if a.exchange:
        out.append("Totals over the run, per direction (source -> receiver).")
        body = []
        for ex in a.exchange:
            transferred = None if None in ex.transferred else sum(t for t in ex.transferred if t is not None)
            admitted = None if None in ex.admitted else sum(x for x in ex.admitted if x is not None)
            body.append(
                [
                    f"{ex.source} -> {ex.receiver}",
                    sum(ex.candidates),
                    sum(ex.selected),
                    transferred,
                    admitted,
                    ex.admission_rate,
                    sum(1 for x in ex.selected if x > 0),
                ]
            )
        headers = [
            "direction",
            "candidates",
            "selected prompts",
            "transferred",
            "admitted",
            "admission rate",
            "steps with transfer",
        ]
        out += ["", _table(headers, body), "", _image(a, "exchange", "exchange volume"), ""]
        out.append("<details><summary>per step</summary>\n")
        body = [
            [f"{ex.source} -> {ex.receiver}", s, c, sel, t, adm]
            for ex in a.exchange
            for s, c, sel, t, adm in zip(
                ex.steps, ex.candidates, ex.selected, ex.transferred, ex.admitted, strict=True
            )
        ]
        out += [
            _table(["direction", "step", "candidates", "selected", "transferred", "admitted"], body),
            "",
            "</details>",
        ]
    else:
        out.append("No exchange in this run (no `selected/<source>` metrics).")

    out += ["", "## Admission and compatibility (s, w)", ""]
    scored = [ex for ex in a.exchange if ex.s]
    if scored:
        out.append(
            f"s from compatibility.jsonl; w = 1[s > {a.delta}] * min(s, 1) (eq. 8); admitted: s > delta."
        )
        body = [
            [
                f"{ex.source} -> {ex.receiver}",
                len(ex.s),
                min(ex.s),
                statistics.median(ex.s),
                statistics.fmean(ex.s),
                max(ex.s),
                sum(x > a.delta for x in ex.s) / len(ex.s),
                statistics.fmean(ex.w),
            ]
            for ex in scored
        ]
        headers = [
            "direction",
            "responses",
            "s min",
            "s median",
            "s mean",
            "s max",
            "admitted share",
            "w mean",
        ]
        out += [
            "",
            _table(headers, body),
            "",
            _image(a, "compatibility_s", "s histogram"),
            _image(a, "compatibility_w", "w histogram"),
        ]
    else:
        out.append("No compatibility scores (no transferred responses, or no compatibility.jsonl).")

    out += ["", "## Clipping (paper Table 9)", ""]
    clip = a.clipping
    out.append(
        "Clipped-token fraction (%), mean over steps: a > 0 with rho > 1 + eps_high, or a < 0 with "
        "rho < 1 - eps_low. Zero peer clipping: share of steps, among those where the model trained "
        "on peer tokens, with no clipped peer token."
    )
    body = [
        [
            model,
            _pct(clip.own.get(model)),
            _pct(clip.peer.get(model)),
            clip.peer_steps.get(model, 0),
            _pct(clip.zero_peer_share(model)),
        ]
        for model in a.models
    ]
    body.append(["all", None, None, sum(clip.peer_steps.values()), _pct(clip.zero_peer_share())])
    headers = [
        "model",
        "own clipped (%)",
        "peer clipped (%)",
        "steps with peer tokens",
        "steps with zero peer clipping (%)",
    ]
    out += ["", _table(headers, body), "", _image(a, "clipping", "clipping")]

    out += ["", "## Reward and response length", "", "Per model over the logged steps (training rollouts)."]
    body = []
    for model in a.models:
        mine = [r for r in rows if r["model"] == model]

        def mean(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
            values = [float(r[key]) for r in mine if r.get(key) is not None]
            return statistics.fmean(values) if values else None

        body.append(
            [
                model,
                mine[0].get("reward_mean"),
                mine[-1].get("reward_mean"),
                mean("reward_mean"),
                mean("all_fail_frac"),
                mean("all_pass_frac"),
                mean("response_length"),
            ]
        )
    headers = [
        "model",
        "first reward",
        "last reward",
        "mean reward",
        "mean all-fail",
        "mean all-pass",
        "mean length (tokens)",
    ]
    out += [
        "",
        _table(headers, body),
        "",
        _image(a, "reward", "reward"),
        _image(a, "response_length", "response length"),
    ]

    if a.validation:
        out += ["", "## Validation", ""]
        body = []
        for key in _validation_metrics(a.validation):
            for model in dict.fromkeys(str(r.get("model", "run")) for r in a.validation):
                points = [
                    (float(r[key]), r.get("step"))
                    for r in a.validation
                    if str(r.get("model", "run")) == model and isinstance(r.get(key), int | float)
                ]
                if points:
                    best = max(points, key=lambda p: p[0])
                    body.append([key, model, best[0], best[1], points[-1][0], points[-1][1]])
        out += [
            _table(["metric", "model", "best", "at step", "last", "at step"], body),
            "",
            _image(a, "validation", "validation"),
        ]

    out += ["", "## Compute (paper Appendix D)", ""]
    comp = a.compute
    out.append(
        "Accelerator-hours = accelerators x summed per-step wall-clock (`time_step`: rollout + reward + "
        "peer log-prob + update), so validation and checkpointing are excluded. One accelerator per "
        "policy unless its config entry sets `accelerators`."
    )
    body = []
    for model in a.models:
        last = comp.best_last_step.get(model)
        body.append(
            [
                model,
                comp.accelerators[model],
                comp.steps[model],
                comp.seconds[model],
                comp.hours(model),
                comp.hours_to_best(model),
                None if last is None else f"0..{last}",
            ]
        )
    body.append(
        [
            "total",
            sum(comp.accelerators.values()),
            None,
            sum(comp.seconds.values()),
            comp.total_hours,
            comp.total_hours_to_best,
            None,
        ]
    )
    headers = [
        "model",
        "accelerators",
        "steps",
        "wall-clock (s)",
        "accelerator-hours",
        "hours to best",
        "steps to best",
    ]
    out += ["", _table(headers, body), "", _image(a, "compute", "cumulative accelerator-hours")]
    validation_seconds = sum(float(r.get("time_validation") or 0.0) for r in a.validation)
    if validation_seconds:
        out.append(f"\nValidation wall-clock, excluded above: {validation_seconds:.4g} s.")
    if comp.best_note:
        out.append(f"\n{comp.best_note}")
    elif not comp.best_last_step:
        out.append("\nNo best/best.json: hours to the best checkpoint not computed.")

    if a.store_report is not None:
        out += ["", "## Trajectory store", "", "```", a.store_report, "```"]
    return "\n".join(out).rstrip() + "\n"
