"""`graftrl sweep --knob mastery`: which transfer rule wins where, along the peer's mastery of the
step the receiver lacks.

GRAFT moves the peer's whole group with its zero-sum advantages, so it teaches only where the
peer's correct and wrong responses differ (``core.contrast``). The knob moves *what the peer's
wrong responses get wrong* on the receiver's deficit family: at the task's pair (point
``default``) they mostly slip on another fact or copy, having carried / borrowed right; on the
drilled pairs (``embedded.mixes.mastery_mixes``) each model knows the single-digit facts and
how often it carries or borrows right falls with its own regrouping share, so its failures become
failures of the step its peer lacks. Each point is a compare of the ``mastery`` preset (GRPO
n = 8, GRAFT, success-only transfer, SGT) in ``OUT/mastery-<point>/``, resumable cell by cell,
seed-major. Per point and receiver it reports the paired differences of held-out pass@1 (overall
and on the receiver's deficit family) against GRPO and against GRAFT, beside what the runs
measured on the training prompts: the peer's accuracy on the deficit family, the error classes of
the moved wrong responses, the contrast, all-fail share, complementarity, groups moved, the
advantage mass split and the clipping of peer tokens by sign. Outputs: ``results.json``,
``report.md`` and ``mastery.png`` in OUT.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from graftrl.core.advantages import SUCCESS_THRESHOLD
from graftrl.embedded.mixes import MASTERY_WARMSTART, mastery_mixes
from graftrl.embedded.task import DEFAULT_TASK, WORKED_OUTCOMES, classify_worked
from graftrl.errors import UserError
from graftrl.evaluation.intervals import dict_text
from graftrl.evaluation.stats import WARM_START, family_rows, mean_std, paired_deltas
from graftrl.experiments.compare_task import CompareTask
from graftrl.experiments.mastery_hint import (
    BASELINE,
    REFERENCE,
    as_json,
    correct_line,
    hint_markdown,
    hint_summary,
    pct,
)
from graftrl.experiments.mastery_rule import line_record, rule_markdown, rule_summary
from graftrl.experiments.sweep import Knob, SweepRound, SweepSettings, line_caption, point_models
from graftrl.reporting.contrast import clipping_by_sign, contrast_summary, moved_error_classes
from graftrl.reporting.diagnostics import summarize_exchange
from graftrl.reporting.lab_data import LINE_FILE, read_lab_data
from graftrl.reporting.provenance import results_provenance, written_by
from graftrl.reporting.run_logs import read_log, read_run_metrics, run_success_threshold, run_train_file
from graftrl.storage.data import load_problems
from graftrl.storage.rundir import ExperimentDir, RunDir

PRESET = "mastery"
RULES = (REFERENCE, "success-only", "sgt")
"""The transfer rules compared, each against GRPO; the last two also against GRAFT."""
EARLY_STEPS = 10
"""The peer's accuracy on the receiver's deficit family is its training reward over these first steps."""
MEASURES = ("all_fail_share", "complementarity", "admitted_share", "regrouping_share")
"""What a point's regime is read on, per receiver (``regime_misses``)."""


@dataclass(frozen=True)
class Line:
    """The committed mastery line's lab data (``docs/mastery/line.json``): the points
    ``--points`` defaults to, and issue 21's rule for the demo's default. ``regime_targets``: the
    regime a point must show in both directions before its held-out numbers may make it the
    demo's default (issue 21 item 5; docs/task_design.md): all-fail share, complementarity and the
    gate's admission as the task's design targets, and the contrast target "most moved wrong peer
    responses fail at the step the receiver lacks" read as a majority of them (``moved_errors``);
    inclusive bounds, measured on the runs' training prompts, never on held-out problems.
    ``decision_seeds``: the rule is applied only over at least this many seeds per point, whatever
    ``--seeds`` asked for: a report over fewer says ``pending``."""

    points: tuple[str, ...]
    decision_seeds: int
    regime_targets: dict[str, tuple[float, float]]


def load_line(root: Path | None = None) -> Line | None:
    """The line from ``docs/mastery/line.json`` of the checkout (or of ``root``); None where
    graftrl runs from no checkout; a one-line ``LabDataError`` where the file is missing or malformed."""
    data = read_lab_data(LINE_FILE, root)
    if data is None:
        return None
    points = data.get("points", list, 'the default points, a list such as ["default", "0.08"]')
    for point in points:
        if not isinstance(point, str):
            raise data.fail(f'`points`: each a string such as "0.08", got {point!r}')
        try:
            mastery_mixes(DEFAULT_TASK, point)
        except ValueError as error:
            raise data.fail(f"`points`: {error}") from None
    seeds = data.integer("decision_seeds", "the seeds the demo-default rule needs, an integer")
    targets = data.section("regime_targets", "measure -> [low, high]")
    bounds = {}
    for key in targets.data:
        if key not in MEASURES:
            raise targets.fail(f"unknown measure `{key}`; known: {', '.join(MEASURES)}")
        pair = targets.get(key, list, "[low, high]")
        if len(pair) != 2 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in pair):
            raise targets.fail(f"`{key}` must be [low, high], got {pair!r}")
        bounds[key] = (pair[0], pair[1])
    if not points or seeds < 1:
        raise data.fail(f"`points` must be non-empty and `decision_seeds` at least 1, got {points}, {seeds}")
    return Line(tuple(points), seeds, bounds)


@functools.cache
def committed_line() -> Line | None:
    """The checkout's mastery line (read once); None where graftrl runs from no checkout."""
    return load_line()


def default_points() -> list[str]:
    """``--points``'s default: the committed line's points."""
    line = committed_line()
    if line is None:
        raise MasteryError(
            f"--points: give the points, e.g. --points default,0.45,0.12,0.04 (the committed line's, "
            f"{LINE_FILE}, are read only where graftrl runs from its checkout)"
        )
    return list(line.points)


PINNED_MODELS = "models"
"""Each point's starting weights, pinned in ``mastery-<point>/models/`` (``embedded.shipped.pin_models``)
and committed with its cells: the line continues on machines whose CPU kernels would warm-start
other last bits."""


class MasteryError(UserError):
    """A mastery-sweep argument problem; the message names the flag and what to fix."""


def point_dir(out_dir: Path, point: str) -> Path:
    return out_dir / f"mastery-{point}"


def check_points(points: Sequence[str]) -> list[str]:
    """The points in order: ``default`` first, then the exposures from high to low."""
    if not points:
        raise MasteryError("--points: give at least one point, e.g. --points default,0.45,0.12,0.04")
    for point in points:
        try:
            mastery_mixes(DEFAULT_TASK, point)
        except ValueError as error:
            raise MasteryError(f"--points: {error}") from None
    if len(set(points)) != len(points):
        raise MasteryError(f"--points: each point once, got {list(points)}")
    return sorted(points, key=lambda p: (p != "default", -float(p) if p != "default" else 0.0))


def _runs(folder: Path, variant: str, seeds: int) -> list[Path]:
    runs = ExperimentDir(folder)
    return [runs.run(variant, s).root for s in range(seeds) if runs.run(variant, s).holds_run()]


def _deficit(rows: Sequence[Mapping[str, Any]], model: str) -> str | None:
    """The receiver's deficit family: its lowest held-out pass@1 at the warm-start."""
    start = next((r for r in rows if r["variant"] == WARM_START and r["model"] == model), None)
    families = (start or {}).get("per_family") or {}
    return min(families, key=families.get) if families else None


def _early_reward(runs: Sequence[Path], model: str, family: str) -> float | None:
    values = [
        row[f"family_reward/{family}"]
        for run in runs
        for row in read_run_metrics(run)
        if row["model"] == model
        and row["step"] < EARLY_STEPS
        and row.get(f"family_reward/{family}") is not None
    ]
    return statistics.fmean(values) if values else None


def point_summary(point: str, folder: Path, rows: Sequence[dict[str, Any]], seeds: int) -> dict[str, Any]:
    """One point: per receiver, pass@1 and the paired differences, and the training-side measures."""
    graft = _runs(folder, REFERENCE, seeds)
    metrics = {
        variant: [row for run in _runs(folder, variant, seeds) for row in read_run_metrics(run)]
        for variant in (BASELINE, REFERENCE, "success-only")
    }
    regime = summarize_exchange({f"{variant} runs": rows for variant, rows in metrics.items()})
    contrast = contrast_summary(metrics[REFERENCE])
    clipping = {variant: clipping_by_sign(metrics[variant]) for variant in (REFERENCE, "success-only")}
    scores = [
        row
        for run in graft
        if RunDir(run).compatibility.exists()
        for row in read_log(RunDir(run).compatibility)
    ]
    problems = {p.id: p.problem for run in graft[:1] for p in load_problems(run_train_file(run))}
    threshold = run_success_threshold(graft[0]) if graft else SUCCESS_THRESHOLD
    errors = moved_error_classes(scores, problems, classify_worked, WORKED_OUTCOMES, threshold)
    by_family = family_rows(rows)
    vs = {ref: (paired_deltas(rows, ref), paired_deltas(by_family, ref)) for ref in (BASELINE, REFERENCE)}
    models = sorted({r["model"] for r in rows if r["variant"] != WARM_START})
    out: dict[str, Any] = {}
    for model in models:
        deficit = _deficit(rows, model)
        peer = next((m for m in models if m != model), None)
        family_key = f"{model} · {deficit}"

        def scores_of(variant: str, table: Sequence[Mapping[str, Any]], key: str) -> list[float]:
            return [r["pass_at_1"] for r in table if r["variant"] == variant and r["model"] == key]

        def diff(
            ref: str, variant: str, family: bool, model: str = model, family_key: str = family_key
        ) -> dict[str, Any] | None:
            found = vs[ref][int(family)].get(variant, {}).get(family_key if family else model)
            return found.as_dict() if found is not None else None

        out[model] = {
            "deficit": deficit,
            "peer": peer,
            "peer_deficit_accuracy": _early_reward(_runs(folder, BASELINE, seeds), peer, deficit)
            if peer and deficit
            else None,
            "pass_at_1": {
                v: asdict(mean_std(s))
                for v in (WARM_START, BASELINE, *RULES)
                if (s := scores_of(v, rows, model))
            },
            "deficit_pass_at_1": {
                v: asdict(mean_std(s))
                for v in (WARM_START, BASELINE, *RULES)
                if (s := scores_of(v, by_family, family_key))
            },
            "vs_grpo": {v: diff(BASELINE, v, False) for v in RULES},
            "vs_graft": {v: diff(REFERENCE, v, False) for v in RULES[1:]},
            "deficit_vs_grpo": {v: diff(BASELINE, v, True) for v in RULES},
            "deficit_vs_graft": {v: diff(REFERENCE, v, True) for v in RULES[1:]},
            "all_fail_share": regime.get(BASELINE, {}).get(model, {}).get("all_fail_mean"),
            "complementarity": regime.get(BASELINE, {}).get(model, {}).get("complementarity_mean"),
            "groups_moved_per_step": regime.get(REFERENCE, {})
            .get(model, {})
            .get("selected_prompts_per_step"),
            "admitted_share": regime.get(REFERENCE, {}).get(model, {}).get("admit_rate"),
            "contrast": contrast.get(model),
            "moved_errors": errors.get(model),
            "clipped_peer": {v: c.get(model) for v, c in clipping.items()},
        }
    return {
        "point": point,
        "models": out,
        "hint": hint_summary(point, folder, rows, seeds, {model: m["deficit"] for model, m in out.items()}),
    }


def _regrouping_share(m: Mapping[str, Any]) -> float | None:
    """The share of the moved wrong peer responses that fail at the regrouping step."""
    return (m.get("moved_errors") or {}).get("regrouping")


def regime_misses(
    m: Mapping[str, Any], targets: Mapping[str, tuple[float, float]] | None = None
) -> list[str]:
    """The regime targets (by default the committed line's) one receiver's summary misses
    (unmeasured counts as missed)."""
    if targets is None:
        line = committed_line()
        targets = line.regime_targets if line else {}
    measured = {
        "all_fail_share": m.get("all_fail_share"),
        "complementarity": m.get("complementarity"),
        "admitted_share": m.get("admitted_share"),
        "regrouping_share": _regrouping_share(m),
    }
    return [
        key
        for key, (low, high) in targets.items()
        if measured[key] is None or not low <= measured[key] <= high
    ]


def demo_default(
    points: Sequence[Mapping[str, Any]], seeds: int, seeds_planned: int, line: Line | None = None
) -> dict[str, Any] | None:
    """Issue 21 item 5's rule: a point becomes the demo's default if, for both receivers, it meets
    the line's ``regime_targets`` and GRAFT − GRPO's paired interval lies above 0. Several such
    points: the largest smallest regrouping share (a regime statistic, never a held-out number)
    decides. Decided only over all planned seeds, and at least the line's ``decision_seeds``;
    before that ``point`` is None and ``status`` says why. ``line``: by default the committed one;
    None (no decision) where there is none (graftrl runs from no checkout)."""
    line = line if line is not None else committed_line()
    if line is None:
        return None
    rows = []
    for point in points:
        models = point["models"]
        misses = {model: regime_misses(m, line.regime_targets) for model, m in models.items()}
        above = {
            model: bool((d := m["vs_grpo"].get(REFERENCE)) and d["low"] is not None and d["low"] > 0)
            for model, m in models.items()
        }
        regrouping = [_regrouping_share(m) or 0.0 for m in models.values()]
        rows.append(
            {
                "point": point["point"],
                "regime_met": len(models) == 2 and not any(misses.values()),
                "regime_misses": misses,
                "graft_above_grpo": len(models) == 2 and all(above.values()),
                "min_regrouping_share": min(regrouping, default=0.0),
            }
        )
    qualified = [r for r in rows if r["regime_met"] and r["graft_above_grpo"]]
    if seeds < (needed := max(seeds_planned, line.decision_seeds)):
        status, chosen = f"pending: {seeds} of {needed} seeds at every point", None
    elif qualified:
        chosen = max(qualified, key=lambda r: r["min_regrouping_share"])["point"]
        status = f"point {chosen} meets the regime targets and puts GRAFT above GRPO on both models"
    else:
        chosen, status = None, "no point meets the regime targets with GRAFT above GRPO on both models"
    return {"point": chosen, "status": status, "points": rows}


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:+.{digits}f}"


def _plain(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


LINE_DIGITS = 1
"""Decimals of the line's tables (points of pass@1)."""


def _diff(d: Mapping[str, Any] | None) -> str:
    return dict_text(d, digits=LINE_DIGITS)


def _shown(points: Sequence[Mapping[str, Any]], *keys: str) -> int:
    """How many differences a line table shows: the receivers' entries under ``keys`` that exist."""
    return sum(d is not None for _, _, m in point_models(points) for key in keys for d in m[key].values())


def _ms(d: Mapping[str, Any] | None) -> str:
    return "—" if d is None else f"{100 * d['mean']:.1f} ± {100 * d['std']:.1f}"


def report_markdown(
    points: Sequence[dict[str, Any]],
    seeds: int,
    task: CompareTask,
    provenance: dict[str, Any],
    decision: Mapping[str, Any] | None = None,
    hint_family: int = 0,
    rule_lines: Sequence[str] = (),
) -> str:
    """The line's report.md; ``hint_family``: the size of the hint rows' corrected family
    (``mastery_hint.correct_line``); ``rule_lines``: the probe rule's test (``mastery_rule``)."""
    s = task.settings
    lines = [
        "# graftrl sweep --knob mastery: which transfer rule wins where",
        "",
        f"{written_by(provenance)}; each point's cells, starting weights and warm-start fingerprints "
        "are in its `mastery-<point>/results.json`.",
        "",
        f"Task {task.name}. Point `default` is the task's pair; a number e is a drilled pair (both models "
        "know the single-digit facts; each has its own regrouping family at share e of its warm-start mix). "
        f"Per point: GRPO (n = {s.n}), GRAFT, success-only transfer and SGT (and the hint rescue where "
        f"`--preset hint` ran it), seeds 0-{seeds - 1}, {s.steps} steps x "
        f"{s.batch_prompts} prompts per model; held-out pass@1 on {s.n_eval} problems x {s.eval_samples} samples, "
        "in percent.",
        "",
        "## Held-out pass@1 and the paired differences",
        "",
        line_caption(
            "Each rule − GRPO and − GRAFT on held-out pass@1, paired by seed (same warm-start, prompts and "
            "evaluation problems)",
            _shown(points, "vs_grpo", "vs_graft"),
        ),
        "",
        "| point | receiver | GRPO | GRAFT − GRPO | success-only − GRPO | SGT − GRPO | success-only − GRAFT | SGT − GRAFT |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for point, model, m in point_models(points):
        lines.append(
            f"| {point['point']} | {model} | {_ms(m['pass_at_1'].get(BASELINE))} | "
            + " | ".join(_diff(m["vs_grpo"][v]) for v in RULES)
            + " | "
            + " | ".join(_diff(m["vs_graft"][v]) for v in RULES[1:])
            + " |"
        )
    lines += [
        "",
        "## The receiver's deficit family (held-out pass@1)",
        "",
        line_caption(
            "Each rule − GRPO and − GRAFT on the receiver's deficit family, paired by seed",
            _shown(points, "deficit_vs_grpo", "deficit_vs_graft"),
        ),
        "",
        "| point | receiver · deficit | warm-start | GRPO | GRAFT − GRPO | success-only − GRPO | SGT − GRPO | success-only − GRAFT | SGT − GRAFT |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for point, model, m in point_models(points):
        d = m["deficit_pass_at_1"]
        lines.append(
            f"| {point['point']} | {model} · {m['deficit']} | {pct(d.get(WARM_START, {}).get('mean'))} | "
            f"{_ms(d.get(BASELINE))} | "
            + " | ".join(_diff(m["deficit_vs_grpo"][v]) for v in RULES)
            + " | "
            + " | ".join(_diff(m["deficit_vs_graft"][v]) for v in RULES[1:])
            + " |"
        )
    lines += [
        "",
        "## What the moved groups carried (training prompts)",
        "",
        "Peer accuracy: the peer's training reward on the receiver's deficit family over the first "
        f"{EARLY_STEPS} steps (GRPO runs). Moved wrong responses: the step each wrong peer response in "
        "GRAFT's moved groups got wrong first (`embedded.task.classify_worked`). Overlap: the share of a "
        "moved wrong response's tokens inside its LCS with the closest correct one, on the receiver's "
        "tokenization; divergence: where it first departs, as a share of its length; lesson: the share "
        "of the receiver's surprise (−log π) on the moved correct responses that lies on tokens no wrong "
        "response shares. Mass: Σ w·A per "
        "moved group on the tokens the correct and wrong responses share (where the zero-sum advantages "
        "cancel) and on those they do not. Clipped: GRAFT's clipped peer tokens with A > 0 / A < 0.",
        "",
        "| point | receiver | peer accuracy | moved wrong: regrouping / fact / copy / format (n) | lesson | overlap "
        "| divergence | mass shared | mass distinct | all-fail | complementarity | moved/step | admitted | clipped + / − |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point, model, m in point_models(points):
        c, e = m["contrast"] or {}, m["moved_errors"]
        errors = (
            " / ".join(pct(e.get(k), 0) for k in ("regrouping", "fact", "copy", "format"))
            + f" ({e['wrong_responses']})"
            if e
            else "—"
        )
        clip = m["clipped_peer"].get(REFERENCE) or {}
        lines.append(
            f"| {point['point']} | {model} | {pct(m['peer_deficit_accuracy'])} | {errors} | "
            f"{pct(c.get('lesson'))} | {pct(c.get('overlap'))} | {pct(c.get('divergence'))} | "
            f"{_num(c.get('mass_shared'))} | "
            f"{_num(c.get('mass_distinct'))} | {pct(m['all_fail_share'])} | {pct(m['complementarity'])} | "
            f"{_plain(m['groups_moved_per_step'])} | "
            f"{pct(m['admitted_share'], 0)} | {pct(clip.get('pos'), 2)} / {pct(clip.get('neg'), 2)} |"
        )
    lines += hint_markdown(points, hint_family)
    lines += rule_lines
    if decision is not None:
        lines += _decision_lines(decision)
    lines += ["", "Figure: `mastery.png`; every point's own report in `mastery-<point>/report.md`.", ""]
    return "\n".join(lines)


def _decision_lines(decision: Mapping[str, Any], line: Line | None = None) -> list[str]:
    line = line if line is not None else committed_line()
    targets = line.regime_targets if line else {}
    bounds = ", ".join(
        f"{key.replace('_', ' ')} {low:.0%}-{high:.0%}" for key, (low, high) in targets.items()
    )
    lines = [
        "",
        "## The demo's default (issue 21's rule)",
        "",
        f"Regime targets, in both directions, on the training prompts: {bounds} (regrouping share: of "
        "the moved wrong peer responses). A point that meets them and puts GRAFT above GRPO on both "
        "models (its 95% CI over seeds in the first table, uncorrected, above 0) becomes the demo's default.",
        "",
        "| point | regime met | targets missed | GRAFT − GRPO above 0 on both |",
        "|---|---|---|---|",
    ]
    for row in decision["points"]:
        missed = "; ".join(
            f"{model}: {', '.join(keys).replace('_', ' ')}"
            for model, keys in row["regime_misses"].items()
            if keys
        )
        lines.append(
            f"| {row['point']} | {'yes' if row['regime_met'] else 'no'} | {missed or '—'} | "
            f"{'yes' if row['graft_above_grpo'] else 'no'} |"
        )
    return [*lines, "", f"Decision: {decision['status']}."]


def write_mastery(done: SweepRound) -> dict[str, Any]:
    """results.json, report.md and mastery.png over the seeds run at every point."""
    from graftrl.reporting.plots import plot_mastery

    out_dir, tasks, results, seeds_done = done.out_dir, done.tasks, done.results, done.seeds_done
    task = done.settings.task
    points = [p for p in tasks if p in results]
    summaries = [point_summary(p, point_dir(out_dir, p), results[p]["rows"], seeds_done) for p in points]
    decision = demo_default(summaries, seeds_done, done.settings.seeds)
    hint_family = correct_line(summaries)
    for summary in summaries:
        point = summary["point"]
        summary["rule"] = rule_summary(point, point_dir(out_dir, point), results[point]["rows"])
    record = line_record(summaries)
    final = {
        "task": task,
        "knob": "mastery: 'default' is the task's pair; e is a drilled pair with its own regrouping family at share e",
        "points": points,
        "seeds": seeds_done,
        "seeds_planned": done.settings.seeds,
        "steps": done.settings.steps,
        "settings": results[points[0]]["settings"],
        "summaries": summaries,
        "demo_default": decision,
        "probe_rule": record.as_dict() if record else None,
        "mixes": {p: mastery_mixes(task, p) for p in points},
        "total_wall_s": round(time.perf_counter() - done.started, 1),
        "provenance": {
            **results_provenance({}),
            "models": {p: tasks[p].provenance.get("models", {}) for p in points},
        },
    }
    rule_lines = rule_markdown(summaries, record, seeds_done)
    report = report_markdown(
        summaries, seeds_done, tasks[points[0]], final["provenance"], decision, hint_family, rule_lines
    )
    for summary in summaries:
        summary["hint"] = as_json(summary["hint"])
    return done.save(final, report, plot_mastery, summaries, "mastery.png")


def mastery_points(
    out_dir: Path, points: Sequence[str], settings: SweepSettings
) -> dict[str, tuple[Path, str, dict]]:
    """The mastery knob's points, checked: each its folder, label, warm-start mixes and recipe,
    and the folder its starting weights are pinned in."""
    drilled = None if settings.quick else MASTERY_WARMSTART
    return {
        p: (
            point_dir(out_dir, p),
            f"mastery {p}",
            {
                "mixes": mastery_mixes(settings.task, p),
                "warmstart": None if p == "default" else drilled,
                "pin_dir": point_dir(out_dir, p) / PINNED_MODELS,
            },
        )
        for p in check_points(points)
    }


MASTERY = Knob(PRESET, "mastery.png", write_mastery, MasteryError)
"""`graftrl sweep --knob mastery`: which transfer rule wins where along the peer's mastery."""
