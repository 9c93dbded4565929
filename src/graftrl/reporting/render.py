"""Rendering: computed results as Markdown (report.md, analysis.md) and rich tables.

Computation lives in ``stats`` (mean ± std, paired intervals), ``analyze`` (run diagnostics) and
``compare`` (the cells); figures in ``plots``. Nothing here reads a run folder.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from graftrl.evaluation.stats import MeanStd, deltas, mean_std, paired_deltas
from graftrl.reporting.analyze import RunAnalysis, validation_metrics

# --------------------------------------------------------------------------------------------
# Comparisons (compare's report.md, the demo's console tables)
# --------------------------------------------------------------------------------------------


def paired_markdown(rows: Sequence[Mapping[str, Any]], reference: str, variants: Sequence[str]) -> str:
    """Rows = variants, per model the paired Δ vs ``reference`` in points with its 95% interval."""
    diffs = paired_deltas(rows, reference)
    models = sorted({m for v in variants for m in diffs.get(v, {})})
    header = ["variant", *[f"paired Δ {model} (points, 95% CI)" for model in models]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant in variants:
        if variant in diffs:
            cells = [
                diffs[variant][m].format(scale=100, digits=2) if m in diffs[variant] else "" for m in models
            ]
            lines.append("| " + " | ".join([variant, *cells]) + " |")
    return "\n".join(lines)


def table_markdown(
    summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
    reference: str | None,
    variants: Sequence[str],
    extra: Mapping[str, Mapping[str, str]] | None = None,
    delta_label: str = "Δ",
) -> str:
    """Rows = variants, per model "pass@1 mean ± std" (percent) and Δ vs ``reference`` (points).

    ``extra``: variant -> {column: text}, appended after the model columns.
    """
    models = sorted({m for v in variants for m in summary.get(v, {})})
    extra_columns = list(dict.fromkeys(c for cols in (extra or {}).values() for c in cols))
    header = ["variant"]
    for model in models:
        header += [f"{model} pass@1 (%)", f"{delta_label} {model}"]
    header += extra_columns
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    diff = deltas(summary, reference)
    for variant in variants:
        if variant not in summary:
            continue
        cells = [f"**{variant}**" if variant == reference else variant]
        for model in models:
            s = summary[variant].get(model)
            d = diff[variant].get(model)
            cells.append(MeanStd(s["mean"], s["std"], s["seeds"]).format(scale=100, digits=2) if s else "")
            cells.append("—" if variant == reference else ("" if d is None else f"{100 * d:+.2f}"))
        cells += [(extra or {}).get(variant, {}).get(c, "") for c in extra_columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_table(
    rows: Sequence[Mapping[str, Any]], title: str = "graftrl demo", reference: str = "grpo"
) -> Table:
    """pass@1 mean ± std over seeds per (model, method) and the paired Δ vs ``reference`` (demo rows)."""
    table = Table(
        "model",
        "method",
        "held-out pass@1 (mean ± std over seeds)",
        "seeds",
        "paired Δ vs GRPO [95% CI]",
        title=title,
        caption="* = the interval excludes 0 (a difference the seeds resolve)",
    )
    by_key: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        by_key.setdefault((row["model"], row["method"]), []).append(row["pass_at_1"])
    paired = paired_deltas(rows, reference, key="method")
    for (model, method), values in sorted(by_key.items()):
        diff = paired.get(method, {}).get(model)
        table.add_row(
            model, method, mean_std(values).format(), str(len(values)), diff.format() if diff else ""
        )
    return table


def diagnostics_table(diagnostics: Mapping[str, Any]) -> Table:
    """The demo's regime statistics (``analyze.summarize_exchange``), one row per (method, receiver)."""
    table = Table(
        "method",
        "receiver",
        "all-fail share",
        "complementarity",
        "selected prompts/step",
        "transferred",
        "admitted (s > δ)",
        title="exchange diagnostics (mean over steps and seeds)",
    )
    for method, models in diagnostics.items():
        for model, d in models.items():
            comp = d["complementarity_mean"]
            rate = d["admit_rate"]
            all_fail = d.get("all_fail_mean")
            table.add_row(
                method,
                model,
                "" if all_fail is None else f"{all_fail:.3f}",
                "" if comp is None else f"{comp:.3f}",
                f"{d['selected_prompts_per_step']:.2f}",
                str(d["transferred_responses"]),
                f"{d['admitted_responses']}" + ("" if rate is None else f" ({rate:.0%})"),
            )
    return table


def diagnostics_markdown(diagnostics: Mapping[str, Any], order: Sequence[str] = ()) -> str:
    """compare's report: the regime and exchange statistics per (variant, receiver), in percent."""

    def pct(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:.1f}"

    rows = []
    for variant in [*order, *(v for v in diagnostics if v not in order)]:
        for model, d in sorted(diagnostics.get(variant, {}).items()):
            rows.append(
                f"| {variant} | {model} | {pct(d.get('all_fail_mean'))} | {pct(d['complementarity_mean'])} "
                f"| {d['selected_prompts_per_step']:.2f} | {d['transferred_responses']:,} "
                f"| {pct(d['admit_rate'])} | {pct(d.get('clip_frac_own'))} | {pct(d.get('clip_frac_peer'))} |"
            )
    header = (
        "| variant | receiver | all-fail share | complementarity | groups moved/step | peer responses "
        "| admitted | clipped own | clipped peer |\n|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def progress_markdown(progress: Mapping[str, Mapping[str, tuple[float, float]]], window: int) -> str:
    """compare's report: per variant and (model · family), the training reward over the first and
    the last ``window`` steps (``analyze.family_progress``), in percent."""
    columns = list(dict.fromkeys(family for families in progress.values() for family in families))
    header = "| variant | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns)
    rows = []
    for variant, families in progress.items():
        cells = [
            f"{100 * families[c][0]:.1f} → {100 * families[c][1]:.1f}" if c in families else "—"
            for c in columns
        ]
        rows.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join([header, *rows])


def gate_markdown(gates: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """compare's report: per (variant, receiver), the transferred responses that were correct and
    wrong, the share of each that passed the gate (s > delta) and their median s
    (``analyze.gate_by_outcome``)."""
    rows = []
    for variant, receivers in gates.items():
        for receiver, outcomes in receivers.items():
            cells = []
            for outcome in ("correct", "wrong"):
                o = outcomes[outcome]
                share = "—" if o.passed_share is None else f"{100 * o.passed_share:.1f}"
                median = "—" if o.median_s is None else f"{o.median_s:.3f}"
                cells += [f"{o.responses:,}", share, median]
            rows.append(f"| {variant} | {receiver} | " + " | ".join(cells) + " |")
    header = (
        "| variant | receiver | correct responses | correct: s > δ (%) | correct: median s "
        "| wrong responses | wrong: s > δ (%) | wrong: median s |\n|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def advantage_markdown(masses: Mapping[str, Mapping[str, Any]]) -> str:
    """compare's report: per (variant, receiver), the moved groups and the sum of w * A per moved
    group over the peer's correct responses, its wrong ones, and both (``analyze.advantage_mass``)."""
    rows = [
        f"| {variant} | {receiver} | {m.groups:,} | {m.correct:+.2f} | {m.wrong:+.2f} | {m.net:+.2f} |"
        for variant, receivers in masses.items()
        for receiver, m in receivers.items()
    ]
    header = (
        "| variant | receiver | moved groups | Σ w·A, correct | Σ w·A, wrong | Σ w·A, net |\n"
        "|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


# --------------------------------------------------------------------------------------------
# One run (analysis.md)
# --------------------------------------------------------------------------------------------


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


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.3f}"


def _image(analysis: RunAnalysis, name: str, alt: str) -> str:
    plot = analysis.plots.get(name)
    return f"![{alt}]({plot.name})" if plot is not None else ""


def render_markdown(analysis: RunAnalysis, rows: Sequence[dict[str, Any]]) -> str:
    """analysis.md: the numbers of ``analysis`` as tables, with the figures ``plots`` made."""
    a = analysis
    out = [
        f"# Run analysis: {a.run_dir.name}",
        "",
        f"- run folder: `{a.run_dir}`",
        f"- method: {a.method}; models: {', '.join(a.models)}",
        f"- steps logged: {len(a.steps)} ({a.steps[0]}..{a.steps[-1]})",
        f"- compatibility floor delta = {a.delta}",
        f"- read: {', '.join(a.sources)}",
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
            _percent(clip.own.get(model)),
            _percent(clip.peer.get(model)),
            clip.peer_steps.get(model, 0),
            _percent(clip.zero_peer_share(model)),
        ]
        for model in a.models
    ]
    body.append(["all", None, None, sum(clip.peer_steps.values()), _percent(clip.zero_peer_share())])
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
        for key in validation_metrics(a.validation):
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
