"""What `graftrl analyze` writes: analysis.md, one render function per section, and the figures.

The numbers come from ``analyze.analyze_run`` (a ``RunAnalysis``); the figures from
``plots.plot_run_analysis``. Each ``*_section`` returns its Markdown lines, opening with the
blank line and heading that separate it from the previous section.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.reporting.analyze import RunAnalysis, validation_metrics
from graftrl.reporting.exchange import EXCHANGE_KEYS
from graftrl.reporting.plots import plot_run_analysis

REPORT_NAME = "analysis.md"
EXCHANGE_METRICS = ", ".join(f"`{keys.selected}<source>`" for keys in EXCHANGE_KEYS)


@dataclass(frozen=True)
class AnalysisFiles:
    """What ``write_analysis`` wrote."""

    report: Path
    """analysis.md"""
    plots: dict[str, Path]
    """Figure name -> PNG path, of each figure made."""


def write_analysis(analysis: RunAnalysis, out_dir: str | Path) -> AnalysisFiles:
    """The figures and analysis.md of ``analysis`` in ``out_dir`` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_run_analysis(analysis, out_dir)
    report = out_dir / REPORT_NAME
    report.write_text(render_markdown(analysis, plots))
    return AnalysisFiles(report, plots)


def render_markdown(analysis: RunAnalysis, plots: Mapping[str, Path]) -> str:
    """analysis.md: the numbers of ``analysis`` as tables, with the figures in ``plots``."""
    sections: list[Callable[[RunAnalysis, Mapping[str, Path]], list[str]]] = [
        header_section,
        complementarity_section,
        exchange_section,
        admission_section,
        clipping_section,
        reward_section,
        failures_section,
        validation_section,
        compute_section,
        served_section,
        store_section,
    ]
    lines = [line for section in sections for line in section(analysis, plots)]
    return "\n".join(lines).rstrip() + "\n"


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


def _image(plots: Mapping[str, Path], name: str, alt: str) -> str:
    plot = plots.get(name)
    return f"![{alt}]({plot.name})" if plot is not None else ""


def header_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    out = [
        f"# Run analysis: {a.run_dir.name}",
        "",
        f"- run folder: `{a.run_dir}`",
        f"- method: {a.method}; models: {', '.join(a.models)}",
        f"- steps logged: {len(a.steps)} ({a.steps[0]}..{a.steps[-1]})",
        f"- compatibility floor delta = {a.delta}",
        f"- read: {', '.join(a.sources)}",
    ]
    return out + [f"- note: {note}" for note in a.notes]


def complementarity_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    out = ["", "## Complementarity (paper Figure 1)", ""]
    if not a.complementarity:
        return [*out, "Not logged (a single-model run)."]
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
    return [*out, "", _image(plots, "complementarity", "complementarity")]


def exchange_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    out = ["", "## Exchange volume", ""]
    if not a.exchange:
        return [*out, f"No exchange in this run (none of the {EXCHANGE_METRICS} metrics)."]
    out.append(
        "Totals over the run, per direction (source -> receiver). Candidates and selected prompts as the "
        "method plans them: GRAFT and LUFFY's candidates (all-fail prompts where the source is mixed) "
        "and selected prompts; SGT's eligible prompts and those whose one correct source response "
        "trains with the NLL term; pooling's and HACPO's every prompt of the batch."
    )
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
    out += ["", _table(headers, body), "", _image(plots, "exchange", "exchange volume"), ""]
    out.append("<details><summary>per step</summary>\n")
    body = [
        [f"{ex.source} -> {ex.receiver}", s, c, sel, t, adm]
        for ex in a.exchange
        for s, c, sel, t, adm in zip(
            ex.steps, ex.candidates, ex.selected, ex.transferred, ex.admitted, strict=True
        )
    ]
    return [
        *out,
        _table(["direction", "step", "candidates", "selected", "transferred", "admitted"], body),
        "",
        "</details>",
    ]


def admission_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    out = ["", "## Admission and compatibility (s, w)", ""]
    scored = [ex for ex in a.exchange if ex.s]
    if not scored:
        return [*out, "No compatibility scores (no transferred responses, or no compatibility.jsonl)."]
    out.append(weights_sentence(a))
    body = [
        [
            f"{ex.source} -> {ex.receiver}",
            len(ex.s),
            min(ex.s),
            statistics.median(ex.s),
            statistics.fmean(ex.s),
            max(ex.s),
            ex.admission_rate if ex.w is None else sum(x > 0 for x in ex.w) / len(ex.w),
            None if ex.w is None else statistics.fmean(ex.w),
        ]
        for ex in scored
    ]
    headers = ["direction", "responses", "s min", "s median", "s mean", "s max", "admitted share", "w mean"]
    return [
        *out,
        "",
        _table(headers, body),
        "",
        _image(plots, "compatibility_s", "s histogram"),
        _image(plots, "compatibility_w", "w histogram"),
    ]


def weights_sentence(a: RunAnalysis) -> str:
    """Where the section's w come from: the log, or the run's rule for a log without them."""
    if a.weights_logged:
        return "s and the applied weight w from compatibility.jsonl; admitted: w > 0 (entered the loss)."
    if a.weight_rule.weighs and a.weight_rule.recomputable:  # the gate, as analyze always wrote it
        return f"s from compatibility.jsonl; w = 1[s > {a.delta}] * min(s, 1) (eq. 8); admitted: s > delta."
    return f"s from compatibility.jsonl; w not logged: {a.weight_rule.describe()}; admitted: w > 0."


def clipping_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    clip = a.clipping
    out = [
        "",
        "## Clipping (paper Table 9)",
        "",
        "Clipped-token fraction (%), mean over steps: a > 0 with rho > 1 + eps_high, or a < 0 with "
        "rho < 1 - eps_low. Zero peer clipping: share of steps, among those where the model trained "
        "on peer tokens, with no clipped peer token.",
    ]
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
    return [*out, "", _table(headers, body), "", _image(plots, "clipping", "clipping")]


def reward_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    out = ["", "## Reward and response length", "", "Per model over the logged steps (training rollouts)."]
    body = []
    for model in a.models:
        mine = [r for r in a.rows if r["model"] == model]

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
    out += ["", _table(headers, body), "", _image(plots, "reward", "reward")]
    out.append(_image(plots, "response_length", "response length"))
    if "family_reward" in plots:  # problems with a `family` field
        out += ["", "Training reward per problem family (`family_reward/<family>`, 5-step mean):", ""]
        out.append(_image(plots, "family_reward", "reward per family"))
    return out


FAILURES = "failures/"
"""Prefix of the logged failure-class counts (``failures/<class>``, storage.log_keys)."""


def failures_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    """The policies' own responses by the verifier's failure class (``failures/<class>``, summed over
    the logged steps; docs/verifiers.md). Runs logged before the classes existed have none."""
    classes = sorted({key.split("/", 1)[1] for r in a.rows for key in r if key.startswith(FAILURES)})
    if not classes:
        return []
    body = []
    for model in a.models:
        mine = [r for r in a.rows if r["model"] == model]
        counts = [sum(int(r.get(f"{FAILURES}{name}") or 0) for r in mine) for name in classes]
        body.append([model, *counts, sum(counts)])
    out = ["", "## Failures by class", ""]
    out.append(
        "The policies' own training responses that did not succeed, by the verifier's reason (counts):"
    )
    return [*out, "", _table(["model", *classes, "all failures"], body)]


def validation_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    if not a.validation:
        return []
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
    return [
        "",
        "## Validation",
        "",
        _table(["metric", "model", "best", "at step", "last", "at step"], body),
        "",
        _image(plots, "validation", "validation"),
    ]


def compute_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    comp = a.compute
    out = [
        "",
        "## Compute (paper Appendix D)",
        "",
        "Accelerator-hours = accelerators x summed per-step wall-clock (`time_step`: rollout + reward + "
        "peer log-prob + update), so validation and checkpointing are excluded. A policy's accelerators "
        "are its config's `resources.num_gpus` under `backend: ray` (a fraction shares a GPU), else its "
        "`parallel.data` ranks (1 by default).",
    ]
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
    out += ["", _table(headers, body), "", _image(plots, "compute", "cumulative accelerator-hours")]
    validation_seconds = sum(float(r.get("time_validation") or 0.0) for r in a.validation)
    if validation_seconds:
        out.append(f"\nValidation wall-clock, excluded above: {validation_seconds:.4g} s.")
    if comp.best_note:
        out.append(f"\n{comp.best_note}")
    elif not comp.best_last_step:
        out.append("\nNo best/best.json: hours to the best checkpoint not computed.")
    return out


def served_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    """Served peers' share of the exchange and their cost (docs/served-peer.md)."""
    if not a.served:
        return []
    out = [
        "",
        "## Served peers",
        "",
        "Requests go only to prompts some policy failed entirely. Missing: prompts asked that got no "
        "answer (a count, then in percent of those asked). Served share: the peer's transferred "
        "responses over all transferred responses, in percent; tokens as the endpoint counted them (`usage`); "
        f"the run's accelerator-hours: {a.compute.total_hours:.4g}.",
    ]
    body = [
        [
            c.peer,
            c.steps,
            c.totals["prompts"],
            c.totals["missing"],
            _percent(c.missing_share),
            c.totals["requests"],
            c.totals["retries"],
            c.totals["prompt_tokens"],
            c.totals["completion_tokens"],
            c.totals["latency_s"],
            c.selected,
            c.transferred,
            _percent(c.share),
        ]
        for c in a.served
    ]
    headers = [
        "peer",
        "steps",
        "prompts asked",
        "missing",
        "missing (% of asked)",
        "requests",
        "retries",
        "tokens requested",
        "tokens received",
        "request time (s)",
        "groups taken",
        "responses transferred",
        "served share (%)",
    ]
    return [*out, "", _table(headers, body)]


def store_section(a: RunAnalysis, plots: Mapping[str, Path]) -> list[str]:
    if a.store_report is None:
        return []
    return ["", "## Trajectory store", "", "```", a.store_report, "```"]
