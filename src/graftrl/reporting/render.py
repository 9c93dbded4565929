"""Rendering of comparisons: the tables of compare's report.md and the demo's rich tables.

Computation lives in ``stats`` (mean ± std, paired intervals of result rows; each an
``intervals.Difference``, written in its one text), ``diagnostics`` (the exchange
across runs) and the compare modules; figures in ``plots``; one run's analysis.md in
``analysis_report``. Nothing here reads a run folder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from graftrl.evaluation.intervals import SEEDS_ONLY, caption
from graftrl.evaluation.stats import MeanStd, deltas, mean_std, paired_deltas


def paired_markdown(rows: Sequence[Mapping[str, Any]], reference: str, variants: Sequence[str]) -> str:
    """Rows = variants, per model the paired Δ vs ``reference`` in points with its 95% interval over
    seeds, uncorrected (the caller's caption says so: ``intervals.caption``)."""
    diffs = paired_deltas(rows, reference)
    models = sorted({m for v in variants for m in diffs.get(v, {})})
    header = ["variant", *[f"paired Δ {model} (points, 95% CI)" for model in models]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant in variants:
        if variant in diffs:
            cells = [diffs[variant][m].format() if m in diffs[variant] else "" for m in models]
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


DEMO_DIGITS = 1
"""Decimals of the demo's console tables: pass@1 in percent, Δ in points."""


def results_table(
    rows: Sequence[Mapping[str, Any]], title: str = "graftrl demo", reference: str = "grpo"
) -> Table:
    """pass@1 mean ± std over seeds per (model, method), in percent, and the paired Δ vs
    ``reference`` in points (demo rows): the t interval over seeds, uncorrected, as its caption says."""
    by_key: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        by_key.setdefault((row["model"], row["method"]), []).append(row["pass_at_1"])
    paired = paired_deltas(rows, reference, key="method")
    shown = sum(len(models) for models in paired.values())
    label = "GRPO" if reference == "grpo" else reference
    # the interval over seeds even with one seed (none yet): it is the one this table gives
    words = caption(f"paired Δ vs {label}", [SEEDS_ONLY], "none", f"the table's {shown} comparisons")
    table = Table(
        "model",
        "method",
        "held-out pass@1 % (mean ± std over seeds)",
        "seeds",
        f"paired Δ vs {label} (points)",
        title=title,
        caption=words.replace("`", ""),  # the console shows no markdown
    )
    for (model, method), values in sorted(by_key.items()):
        diff = paired.get(method, {}).get(model)
        table.add_row(
            model,
            method,
            mean_std(values).format(scale=100, digits=DEMO_DIGITS),
            str(len(values)),
            diff.format(digits=DEMO_DIGITS) if diff else "",
        )
    return table


def diagnostics_table(diagnostics: Mapping[str, Any]) -> Table:
    """The demo's regime statistics (``diagnostics.summarize_exchange``), one row per (method, receiver)."""
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
    the last ``window`` steps (``diagnostics.family_progress``), in percent."""
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
    wrong, the share of each that passed the gate (s > delta), the share admitted (w > 0) and
    their median s (``diagnostics.gate_by_outcome``)."""

    def pct(share: float | None) -> str:
        return "—" if share is None else f"{100 * share:.1f}"

    rows = []
    for variant, receivers in gates.items():
        for receiver, outcomes in receivers.items():
            cells = []
            for outcome in ("correct", "wrong"):
                o = outcomes[outcome]
                median = "—" if o.median_s is None else f"{o.median_s:.3f}"
                cells += [f"{o.responses:,}", pct(o.passed_share), pct(o.admitted_share), median]
            rows.append(f"| {variant} | {receiver} | " + " | ".join(cells) + " |")
    header = (
        "| variant | receiver | correct responses | correct: s > δ (%) | correct: admitted (%) | correct: median s "
        "| wrong responses | wrong: s > δ (%) | wrong: admitted (%) | wrong: median s |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def advantage_markdown(masses: Mapping[str, Mapping[str, Any]]) -> str:
    """compare's report: per (variant, receiver), the moved groups and the sum of w * A per moved
    group over the peer's correct responses, its wrong ones, and both (``diagnostics.advantage_mass``)."""
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
