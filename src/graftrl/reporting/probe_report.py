"""probe.md and the probe's plots, from the figures of probe.json (``probe_stats``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graftrl.core.advantages import SUCCESS_THRESHOLD
from graftrl.files import atomic_write
from graftrl.reporting.plots import plot_histograms
from graftrl.reporting.probe_rule import TrackRecord, registered_rule
from graftrl.reporting.probe_stats import QUANTILES, StepData, histogram_values
from graftrl.storage.rundir import ProbeDir

S_RANGE = (0.0, 2.0)
"""The s axis of the histograms (s above 2 is drawn at 2): the gate's floor and cap (w = min(s, 1))
lie inside it."""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _slug(direction: str) -> str:
    return "s_" + direction.replace(" -> ", "_to_").replace("/", "_")


def write_plots(
    folder: ProbeDir, steps: Sequence[StepData], delta: float, threshold: float = SUCCESS_THRESHOLD
) -> list[Path]:
    """One histogram of s per direction, correct and wrong candidate responses overlaid (correct:
    a reward at or above ``threshold``)."""
    made = []
    for direction, values in sorted(histogram_values(steps, threshold).items()):
        path = folder.plot(_slug(direction))
        plot_histograms(
            {f"{outcome} ({len(v)})": v for outcome, v in values.items()},
            path,
            xlabel=f"s of {direction} candidates (clipped at {S_RANGE[1]:g})",
            value_range=S_RANGE,
            marker=delta,
            marker_label=f"graft.delta = {delta}",
            ylabel="peer responses",
        )
        made.append(path)
    return made


def _quantiles(entry: Mapping[str, Any] | None) -> str:
    if not entry or not entry.get("quantiles"):
        return "-"
    return " / ".join(f"{v:.2f}" for v in entry["quantiles"].values())


def _rescue_lines(rescue: Mapping[str, Any] | None) -> list[str]:
    """The hint's rescue round (a method that ``rescues``): what it would recover."""
    if not rescue:
        return []
    return [
        "",
        "### The rescue round",
        "",
        "Rescue rate: the share of the receiver's all-fail prompts that a peer solved which the "
        "receiver solves at least once when it samples them again with the peer's hint (the "
        "rescue round's prompts cost n more responses each).",
        "",
        *_table(
            ["receiver", "rescued prompts", "solved with the hint", "rescue rate"],
            [
                [name, str(r["attempted"]), str(r["solved"]), _pct(r["rescue_rate"])]
                for name, r in rescue.items()
            ],
        ),
    ]


def render(figures: Mapping[str, Any], plots: Sequence[Path]) -> str:
    """probe.md: per model, per ordered pair, s by outcome, the method's exchange, cost."""
    probe, cost = figures["probe"], figures["cost"]
    batch = probe["batch_prompts"]
    lines = [
        f"# Probe of `{probe['config']}`",
        "",
        f"{probe['prompts']} training prompts in {figures['steps']} step(s) of {batch}, n = {probe['n']} "
        f"responses per prompt and model, seed {probe['seed']}, method `{probe['method']}`, "
        f"graft.delta = {probe['delta']}, {probe['engine']} engine, {probe['backend']} backend. "
        "No update: every figure is the first training steps' regime.",
        "",
        "## Per model",
        "",
        *_table(
            ["model", "accuracy", "all-fail", "mixed", "all-pass"],
            [
                [name, _pct(m["accuracy"]), _pct(m["all_fail"]), _pct(m["mixed"]), _pct(m["all_pass"])]
                for name, m in figures["models"].items()
            ],
        ),
        "",
        "## Per ordered pair",
        "",
        "Complementarity: the share of the receiver's all-fail prompts that the source solves at "
        "least once (paper Figure 1). Candidates: the source's mixed groups on the receiver's "
        f"all-fail prompts (eq. 4), per {batch} prompts; selected: the groups `{probe['method']}`'s "
        f"plan moves, per {batch} prompts. s > delta: the share of every candidate response the "
        "gate of eq. 8 admits.",
        "",
        *_table(
            [
                "source -> receiver",
                "complementarity",
                "candidates / batch",
                "selected / batch",
                "scored",
                "s > delta",
                "correct s > delta",
                "wrong s > delta",
            ],
            [
                [
                    f"{p['source']} -> {p['receiver']}",
                    f"{_pct(p['complementarity'])} ({p['solved_by_source']}/{p['receiver_all_fail']})",
                    _num(p["candidates_per_batch"], 1),
                    _num(p["selected_per_batch"], 1),
                    str(p["scored"]["responses"]),
                    _pct(p["scored"].get("passed_share")),
                    _pct((p["scored"].get("correct") or {}).get("passed_share")),
                    _pct((p["scored"].get("wrong") or {}).get("passed_share")),
                ]
                for p in figures["pairs"]
            ],
        ),
        *_rescue_lines(figures.get("rescue")),
        "",
        "### Compatibility s of every candidate response, by outcome",
        "",
        f"Quantiles {' / '.join(f'p{round(100 * q)}' for q in QUANTILES)} of s on the receiver "
        "(eq. 7), over the responses of every candidate group: what the receiver could receive.",
        "",
        *_table(
            ["source -> receiver", "correct: responses", "correct: s", "wrong: responses", "wrong: s"],
            [
                [
                    f"{p['source']} -> {p['receiver']}",
                    str((p["scored"].get("correct") or {}).get("responses", 0)),
                    _quantiles(p["scored"].get("correct")),
                    str((p["scored"].get("wrong") or {}).get("responses", 0)),
                    _quantiles(p["scored"].get("wrong")),
                ]
                for p in figures["pairs"]
            ],
        ),
        "",
        *[f"![{plot.stem}]({plot.name})" for plot in plots],
        "",
        f"## What `{probe['method']}` would move",
        "",
        "The groups of the method's plan, built as the update would build them (its weights, its "
        "transfer rule). Net mass: sum of w x A over a moved group's correct and wrong responses, "
        "per group (GRPO advantages sum to 0, so only the gate makes it positive). Lesson: the "
        "share of the receiver's surprise on the correct responses that lies on tokens the "
        "wrong ones do not share (docs/algorithm.md §5, contrast); overlap: the share of a wrong "
        "response inside its closest correct one.",
        "",
        *_table(
            [
                "source -> receiver",
                "groups",
                "responses",
                "admitted",
                "net mass / group",
                "lesson",
                "overlap",
            ],
            [
                [
                    f"{p['source']} -> {p['receiver']}",
                    str(p["moved"]["groups"]),
                    str(p["moved"]["responses"]),
                    f"{p['moved']['admitted']}/{p['moved']['scored']}" if p["moved"]["scored"] else "-",
                    _num((p["moved"]["mass"] or {}).get("net"), 3),
                    _num((p["moved"]["contrast"] or {}).get("lesson")),
                    _num((p["moved"]["contrast"] or {}).get("overlap")),
                ]
                for p in figures["pairs"]
            ],
        ),
        "",
        *verdict_lines(figures.get("verdict")),
        "## Cost",
        "",
        *_cost_lines(cost, batch),
    ]
    notes = probe.get("notes") or []
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    lines += [
        "",
        "Every figure here is recounted from samples.jsonl, candidates.jsonl, compatibility.jsonl, "
        "moved_groups.jsonl and steps.jsonl (`graftrl.reporting.probe_stats.recount`). What these "
        "figures predicted, and what they did not, on the embedded testbed: docs/your-pair.md.",
    ]
    return "\n".join(lines) + "\n"


def verdict_lines(verdict: Mapping[str, Any] | None) -> list[str]:
    """probe.md's verdict: the rule's, per direction, with its measured track record; or why none."""
    if verdict is None:  # a probe.json written before the rule was scored, or with no lab (a wheel)
        return []
    record = verdict["track_record"]
    lines = ["## Verdict", ""]
    rule = f"The rule of docs/results.md §7 (fixed at {verdict['registered']}): {verdict['rule']}."
    if record is None:
        return [*lines, f"No verdict: the rule has no measured track record yet. {rule}", ""]
    measured = TrackRecord(**record).describe()
    if not record["passed"]:
        return [
            *lines,
            f"No verdict. {rule} Tested on new conditions of the embedded testbed, it failed its registered "
            f"bar: {measured}. The figures above are necessary conditions only (nothing to move means no "
            "gain), not a prediction that exchange will help.",
            "",
        ]
    if not verdict["directions"]:
        registered = registered_rule()
        reads = (
            f"a `{registered.method}` probe (`--set method={registered.method}`)"
            if registered
            else "a probe of its own method"
        )
        return [*lines, f"No verdict: the rule reads {reads}.", ""]
    return [
        *lines,
        *_table(
            ["source -> receiver", "net mass / group", "correct / wrong s > delta", "verdict"],
            [
                [
                    f"{d['source']} -> {d['receiver']}",
                    _num((d["inputs"] or {}).get("mass")),
                    f"{_pct((d['inputs'] or {}).get('admitted_correct'))} / "
                    f"{_pct((d['inputs'] or {}).get('admitted_wrong'))}",
                    d["verdict"],
                ]
                for d in verdict["directions"]
            ],
        ),
        "",
        f"{rule} Its track record is the embedded testbed's, not your pair's: {measured}.",
        "",
    ]


def _cost_lines(cost: Mapping[str, Any], batch: int) -> list[str]:
    step, seconds = cost["training_step"], cost["seconds"]
    tokens = ", ".join(f"{name} {count:,}" for name, count in cost["tokens_sampled"].items())
    return [
        f"Tokens sampled: {tokens}. Wall-clock: sampling, verifying and planning "
        f"{seconds['rollout']:.1f} s, building the method's rows {seconds['moved']:.1f} s, scoring "
        f"the other candidate groups {seconds['candidates']:.1f} s ({seconds['total']:.1f} s in all).",
        "",
        f"A training step of {batch} prompts, extrapolated: rollout {step['rollout']:.2f} s + peer "
        f"scoring {step['peer_scoring']:.2f} s + update {_num(step['update_estimate'])} s (estimated) "
        f"= {_num(step['total'])} s; this probe spent {step['probe_per_batch']:.2f} s per {batch} prompts. "
        f"Rule: {step['rule']}.",
    ]


def served_lines(figures: Mapping[str, Any]) -> list[str]:
    """probe.md's served-peer section: what the endpoint was asked and answered, and its cost."""
    served = figures.get("served")
    if not served:
        return []
    return [
        "",
        "## Served peers",
        "",
        "Asked only on prompts some policy failed entirely; tokens as the endpoint counted them.",
        "",
        *_table(
            ["peer", "prompts asked", "missing", "requests", "retries", "tokens requested", "tokens received",
             "request time (s)", "groups taken", "responses transferred"],
            [
                [name, f"{c['prompts']:g}", f"{c['missing']:g}", f"{c['requests']:g}", f"{c['retries']:g}",
                 f"{c['prompt_tokens']:g}", f"{c['completion_tokens']:g}", f"{c['latency_s']:.3g}",
                 f"{c['groups_taken']:g}", f"{c['transferred']:g}"]
                for name, c in served.items()
            ],
        ),
    ]  # fmt: skip


def write_report(folder: ProbeDir, figures: Mapping[str, Any], steps: Sequence[StepData]) -> list[Path]:
    """probe.md and the plots into ``folder``; returns the plots."""
    settings = figures["probe"]
    plots = write_plots(
        folder, steps, settings["delta"], settings.get("success_threshold", SUCCESS_THRESHOLD)
    )
    text = "\n".join([render(figures, plots).rstrip("\n"), *served_lines(figures)]) + "\n"
    atomic_write(folder.report, text.encode())
    return plots
