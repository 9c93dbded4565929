"""Every figure graftrl draws (PNG via matplotlib): training curves, complementarity, compatibility
scores, pass@1 bars, per-family curves, the sweep, and the panels of ``graftrl analyze``."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from graftrl.core.compatibility import DELTA
from graftrl.reporting.analyze import RunAnalysis, step_seconds, validation_metrics
from graftrl.reporting.run_logs import read_log
from graftrl.storage.rundir import RunDir

FOOTER_INCHES = 0.16
"""Height kept free at a figure's foot for its footer line."""


def _save(fig: Any, path: Path, footer: str | None = None) -> None:
    """Lay out, add ``footer`` (the command and commit that made the figure) in small grey type at
    the bottom left, write a 120-dpi PNG and free the figure."""
    if footer:
        fig.text(0.005, 0.005, footer, fontsize=6, color="grey", ha="left", va="bottom")
        fig.tight_layout(rect=(0.0, FOOTER_INCHES / fig.get_figheight(), 1.0, 1.0))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def _series(rows: Sequence[Mapping[str, Any]], model: str, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if r["model"] == model and r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_training_curves(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: Path,
    key: str = "reward_mean",
    footer: str | None = None,
) -> None:
    """One panel per model; one line per run label (e.g. 'grpo seed 0')."""
    models = sorted({r["model"] for rows in runs.values() for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for label, rows in runs.items():
            steps, values = _series(rows, model, key)
            ax.plot(steps, values, label=label, alpha=0.85)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    _save(fig, path, footer)


def plot_complementarity(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: Path,
    smooth: int = 5,
    footer: str | None = None,
) -> None:
    """Paper Figure 1: fraction of each model's all-fail prompts that the peer solves.

    ``runs`` maps labels like "graft seed 0" to metrics rows; seeds of one method are averaged
    per step (steps where a model had no all-fail prompt are undefined and skipped), then
    smoothed with a trailing mean over ``smooth`` steps.
    """
    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for label, rows in runs.items():
        method = label.split(" seed ")[0]
        for row in rows:
            for key, value in row.items():
                if key.startswith("complementarity/") and value is not None:
                    name = f"{method}: {key.split('/', 1)[1]} solves {row['model']}'s all-fail"
                    series[name][row["step"]].append(value)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, by_step in sorted(series.items()):
        steps = sorted(by_step)
        means = [sum(by_step[t]) / len(by_step[t]) for t in steps]
        ax.plot(steps, _trailing_mean(means, smooth), label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(f"complementarity ({smooth}-step mean)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path, footer)


def read_compatibility(run_dir: Path) -> dict[str, list[float]]:
    """Receiver name -> every compatibility score s logged in the run."""
    scores: dict[str, list[float]] = defaultdict(list)
    path = RunDir(run_dir).compatibility
    if path.exists():
        for row in read_log(path):
            scores[row["receiver"]].extend(row["s"])
    return scores


def plot_compatibility_histogram(
    scores: Mapping[str, Sequence[float]], path: Path, delta: float = DELTA, footer: str | None = None
) -> None:
    """Histogram of s per receiver, with the gate delta marked."""
    plot_histograms(
        {f"received by {receiver}": values for receiver, values in scores.items()},
        path,
        xlabel="compatibility score s (clipped at 3)",
        value_range=(0.0, 3.0),
        marker=delta,
        marker_label=f"delta = {delta}",
        ylabel="transferred responses",
        footer=footer,
    )


def plot_pass_at_1(rows: Sequence[Mapping[str, Any]], path: Path, footer: str | None = None) -> None:
    """Held-out pass@1 per model and method (mean over seeds, with each seed as a dot)."""
    models = sorted({r["model"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(models) * len(methods) / 2, 3.6))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        for i, model in enumerate(models):
            values = [r["pass_at_1"] for r in rows if r["model"] == model and r["method"] == method]
            x = i + j * width
            ax.bar(x, sum(values) / len(values), width, color=f"C{j}", label=method if i == 0 else None)
            ax.scatter([x] * len(values), values, color="black", s=8, zorder=3)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(models))], models)
    ax.set_ylabel("held-out pass@1")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path, footer)


def plot_step_panels(
    panels: Mapping[str, Mapping[str, tuple[Sequence[int], Sequence[float]]]],
    path: Path,
    ylabel: str | None = None,
    columns: int | None = None,
    footer: str | None = None,
) -> None:
    """One panel per title, ``columns`` to a row (default all in one row); in each, one line per
    label from (steps, values) pairs."""
    titles = list(panels)
    ncols = max(1, min(columns or len(titles), len(titles)))
    nrows = max(1, -(-len(titles) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(titles) :]:
        ax.set_visible(False)
    for ax, title in zip(axes.flat, titles, strict=False):
        for label, (steps, values) in panels[title].items():
            ax.plot(list(steps), list(values), marker="o" if len(steps) <= 20 else None, ms=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if panels[title]:
            ax.legend(fontsize=7)
    _save(fig, path, footer)


def plot_family_curves(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: Path,
    prefix: str = "family_reward/",
    smooth: int = 5,
    footer: str | None = None,
) -> bool:
    """Training reward per problem family: a row of panels per model, one per family, one line
    per method.

    ``runs`` maps labels like "graft seed 0" to metrics rows; seeds of a method are averaged per
    step, then smoothed with a trailing mean over ``smooth`` steps (one step's family has only a
    few prompts). Returns False (and writes nothing) when no row carries a per-family figure.
    """
    points: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for label, rows in runs.items():
        method = label.split(" seed ")[0]
        for row in rows:
            for key, value in row.items():
                if key.startswith(prefix) and value is not None:
                    points[f"{row['model']}: {key[len(prefix) :]}"][method][row["step"]].append(value)
    if not points:
        return False
    panels = {
        title: {
            method: (
                sorted(by_step),
                _trailing_mean([sum(by_step[t]) / len(by_step[t]) for t in sorted(by_step)], smooth),
            )
            for method, by_step in methods.items()
        }
        for title, methods in sorted(points.items())
    }
    families_per_model = max(Counter(title.split(": ")[0] for title in panels).values())
    plot_step_panels(
        panels,
        path,
        ylabel=f"training reward (seed mean, {smooth}-step mean)",
        columns=families_per_model,
        footer=footer,
    )
    return True


def plot_histograms(
    values: Mapping[str, Sequence[float]],
    path: Path,
    xlabel: str,
    value_range: tuple[float, float] = (0.0, 1.0),
    bins: int = 40,
    marker: float | None = None,
    marker_label: str | None = None,
    ylabel: str = "responses",
    footer: str | None = None,
) -> None:
    """Overlaid histograms, one per label (values outside ``value_range`` are clipped into it)."""
    low, high = value_range
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, data in sorted(values.items()):
        if data:
            clipped = [min(max(v, low), high) for v in data]
            ax.hist(clipped, bins=bins, range=value_range, alpha=0.55, label=label)
    if marker is not None:
        ax.axvline(marker, color="black", linestyle="--", label=marker_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    _save(fig, path, footer)


def plot_run_analysis(analysis: RunAnalysis, out: Path) -> dict[str, Path]:
    """The figures of ``graftrl analyze`` in ``out``: name -> PNG path of each made."""
    rows = analysis.rows
    label = analysis.run_dir.name or "run"
    made: dict[str, Path] = {}

    def path(name: str) -> Path:
        made[name] = out / f"{name}.png"
        return made[name]

    plot_training_curves({label: rows}, path("reward"), key="reward_mean")
    plot_training_curves({label: rows}, path("response_length"), key="response_length")
    if plot_family_curves({label: rows}, out / "family_reward.png"):  # data with families only
        made["family_reward"] = out / "family_reward.png"
    if analysis.complementarity:
        plot_complementarity({label: rows}, path("complementarity"))
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
        plot_step_panels(panels, path("exchange"))
        scores = {ex.receiver: ex.s for ex in analysis.exchange}
        if any(scores.values()):
            plot_compatibility_histogram(scores, path("compatibility_s"), analysis.delta)
        weights = {f"{ex.source} -> {ex.receiver}": ex.w for ex in analysis.exchange if ex.w}
        if weights:
            rule = analysis.weight_rule
            plot_histograms(
                weights,
                path("compatibility_w"),
                xlabel="weight w applied (compatibility.jsonl)"
                if analysis.weights_logged
                else f"weight w = 1[s > {analysis.delta}] min(s, 1)"
                if rule.weighs
                else "weight w = 1 (no gate)",
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
        plot_step_panels(
            {k: v for k, v in clip_panels.items() if v}, path("clipping"), "clipped-token fraction"
        )
    hours: dict[str, tuple[list[int], list[float]]] = {}
    for model in analysis.models:
        total, steps, values = 0.0, [], []
        for r in rows:
            if r["model"] == model:
                total += analysis.compute.accelerators[model] * step_seconds(r) / 3600
                steps.append(int(r["step"]))
                values.append(total)
        hours[model] = (steps, values)
    plot_step_panels({"cumulative accelerator-hours": hours}, path("compute"), "accelerator-hours")
    metrics = validation_metrics(analysis.validation)
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
        plot_step_panels(panels, path("validation"))
    return made


def plot_sweep(points: Sequence[Mapping[str, Any]], path: Path, footer: str | None = None) -> None:
    """``graftrl sweep``: top, GRAFT − GRPO held-out pass@1 per model with its 95% paired interval;
    bottom, the regime at each point (all-fail share solid, complementarity dashed), against the
    skill overlap of the pair."""
    models = sorted({m for p in points for m in p["models"]})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
    for i, model in enumerate(models):
        color = f"C{i}"
        shift = (i - (len(models) - 1) / 2) * 0.012  # side by side, so the intervals stay readable
        xs, means, lows, highs = [], [], [], []
        for p in points:
            diff = p["models"].get(model, {}).get("graft_minus_grpo")
            if diff is None:
                continue
            xs.append(p["overlap"] + shift)
            means.append(100 * diff["mean"])
            low, high = diff["low"], diff["high"]
            lows.append(100 * (diff["mean"] - low) if low is not None else 0.0)
            highs.append(100 * (high - diff["mean"]) if high is not None else 0.0)
        if xs:
            top.errorbar(xs, means, yerr=[lows, highs], fmt="o-", color=color, capsize=4, label=model)
        for key, style, name in (
            ("all_fail_share", "-", "all-fail share"),
            ("complementarity", "--", "complementarity"),
        ):
            pts = [
                (p["overlap"], p["models"][model][key])
                for p in points
                if p["models"].get(model, {}).get(key) is not None
            ]
            if pts:
                bottom.plot(*zip(*pts, strict=True), style, marker="o", color=color, label=f"{model}: {name}")
    top.axhline(0.0, color="grey", linewidth=0.8)
    top.set_ylabel("GRAFT − GRPO pass@1 (points)")
    top.set_title("held-out pass@1 difference, paired by seed (95% t interval)", fontsize=9)
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_ylim(-0.03, 1.03)
    bottom.set_xlabel("skill overlap of the pair (0: complementary deficits, 1: same skills)")
    bottom.set_ylabel("share of prompts (GRPO runs)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7)
    _save(fig, path, footer)


def plot_mastery(points: Sequence[Mapping[str, Any]], path: Path, footer: str | None = None) -> None:
    """``graftrl sweep --knob mastery``: GRAFT − GRPO (left) and success-only − GRAFT (right),
    held-out pass@1 with the 95% paired interval, per receiver, against the contrast measured on
    GRAFT's moved groups (``contrast_lesson``: the share of the receiver's surprise on the correct
    responses that lies where the wrong ones differ); each point labelled by its knob value."""
    models = sorted({m for p in points for m in p["models"]})
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.2), sharex=True)
    panels = (("vs_grpo", "graft", "GRAFT − GRPO"), ("vs_graft", "success-only", "success-only − GRAFT"))
    for ax, (table, variant, title) in zip(axes, panels, strict=True):
        for i, model in enumerate(models):
            xs, ys, errs, labels = [], [], [[], []], []
            for p in points:
                m = p["models"].get(model, {})
                diff = (m.get(table) or {}).get(variant)
                lesson = (m.get("contrast") or {}).get("lesson")
                if diff is None or lesson is None:
                    continue
                xs.append(100 * lesson)
                ys.append(100 * diff["mean"])
                errs[0].append(100 * (diff["mean"] - diff["low"]) if diff["low"] is not None else 0.0)
                errs[1].append(100 * (diff["high"] - diff["mean"]) if diff["high"] is not None else 0.0)
                labels.append(p["point"])
            if xs:
                ax.errorbar(xs, ys, yerr=errs, fmt="o", color=f"C{i}", capsize=4, label=model)
                for x, y, label in zip(xs, ys, labels, strict=True):
                    ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(f"{title}, held-out pass@1 (points, 95% paired interval)", fontsize=9)
        ax.set_xlabel(
            "contrast on the lesson (contrast_lesson, %):\nthe receiver's surprise where correct ≠ wrong"
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("paired difference (points)")
    _save(fig, path, footer)
