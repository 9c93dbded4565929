"""The exchange diagnostics of compare's report.md: what crossed between the models of each variant.

``exchange_tables`` reads each variant's compatibility logs once for the transfer tables (how the
gate met correct and wrong peer responses, the advantage mass of the moved groups);
``regime_lines`` and ``transfer_lines`` write those sections; ``exchange_plots`` draws the demo's
complementarity and compatibility-score figures for the baseline and reference variants.
``report`` places them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.experiments.cells import cell_config
from graftrl.experiments.compare.task import CompareTask
from graftrl.experiments.matrix import Matrix
from graftrl.reporting.diagnostics import (
    AdvantageMass,
    GateOutcome,
    advantage_mass,
    gate_by_outcome,
    logs_mass,
    summarize_exchange,
)
from graftrl.reporting.render import advantage_markdown, diagnostics_markdown, gate_markdown
from graftrl.reporting.run_logs import read_log
from graftrl.reporting.weights import WeightRule, logs_weights
from graftrl.storage.rundir import ExperimentDir, RunDir


def _compatibility_records(out_dir: Path, variant: str, seeds: int) -> list[dict[str, Any]]:
    """Every ``compatibility.jsonl`` row of ``variant``'s runs over seeds 0..seeds-1."""
    out = ExperimentDir(out_dir)
    logs = [RunDir(out.run(variant, seed).root).compatibility for seed in range(seeds)]
    return [record for log in logs if log.is_file() for record in read_log(log)]


@dataclass
class TransferTables:
    """The transfer tables of report.md, from each variant's compatibility logs (seeds run)."""

    gates: dict[str, dict[str, dict[str, GateOutcome]]]
    """Variant -> ``gate_by_outcome``, for every variant that transferred responses."""
    masses: dict[str, dict[str, AdvantageMass]]
    """Variant -> ``advantage_mass``, where its logs give it."""
    recomputed: list[str]
    """Variants whose logs predate the logged weights (w and admissions recomputed from s)."""
    logged_masses: bool
    """Some variant's masses use the logged w and A (any transfer rule)."""


def exchange_tables(
    out_dir: Path, matrix: Matrix, task: CompareTask, seeds: int, steps: int | None
) -> TransferTables:
    """One pass over each variant's compatibility logs for the transfer tables.

    Masses of logs that record each response's w and advantage come from them, whatever the rule;
    older logs are recomputed for the GRAFT variants whose peer responses are whole source groups
    weighted by a rule of s (replaced groups, every response, the gate or no gate): pooled groups,
    success-only transfer and random admission train other weights or advantages than such a log
    can rebuild."""
    tables = TransferTables({}, {}, [], False)
    for variant in matrix.variants:
        if not (records := _compatibility_records(out_dir, variant.name, seeds)):
            continue
        config = cell_config(task, variant, 0, steps)
        graft, train = config.graft, config.train
        rule = WeightRule.of(variant.method, graft.model_dump())
        threshold = config.reward.success_threshold
        tables.gates[variant.name] = gate_by_outcome(records, graft.delta, rule, threshold)
        logged = all(logs_mass(record) for record in records)
        if not all(logs_weights(record) for record in records):
            tables.recomputed.append(variant.name)
        whole_groups = graft.groups == "replace" and graft.transfer == "all" and graft.admission == "gate"
        if not logged and (variant.method != "graft" or not whole_groups):
            continue
        if mass := advantage_mass(
            records, config.rollout.n, rule, train.adv_eps, train.adv_std_unbiased, threshold
        ):
            tables.masses[variant.name] = mass
            tables.logged_masses |= logged
    return tables


def compatibility_scores(out_dir: Path, variant: str, seeds: int) -> dict[str, list[float]]:
    """Receiver -> every compatibility score s logged by ``variant``'s runs over seeds 0..seeds-1."""
    from graftrl.reporting.plots import read_compatibility

    scores: dict[str, list[float]] = defaultdict(list)
    for seed in range(seeds):
        for receiver, values in read_compatibility(ExperimentDir(out_dir).run(variant, seed).root).items():
            scores[receiver] += values
    return dict(scores)


def exchange_plots(
    out_dir: Path,
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: str | None,
    reference: str | None,
    seeds: int,
    footer: str,
) -> dict[str, str]:
    """The demo's exchange figures for the baseline and the reference variant (GRPO and GRAFT in
    the demo preset): complementarity per step and the reference's compatibility scores."""
    from graftrl.reporting.plots import plot_compatibility_histogram, plot_complementarity

    made = {}
    pair = {name for name in (baseline, reference) if name}
    runs = {label: rows for label, rows in metrics.items() if label.split(" seed ")[0] in pair}
    if any(key.startswith("complementarity/") for rows in runs.values() for row in rows for key in row):
        plot_complementarity(runs, out_dir / "complementarity.png", footer=footer)
        made["complementarity.png"] = (
            f"share of all-fail prompts the peer solves, {' and '.join(sorted(pair))}"
        )
    scores = compatibility_scores(out_dir, reference, seeds) if reference else {}
    if scores:
        plot_compatibility_histogram(scores, out_dir / "compatibility_hist.png", footer=footer)
        made["compatibility_hist.png"] = f"compatibility scores s of {reference}'s transferred responses"
    return made


def regime_lines(metrics: Mapping[str, Sequence[Mapping[str, Any]]], names: Sequence[str]) -> list[str]:
    """The regime and exchange diagnostics per variant (``diagnostics.summarize_exchange``)."""
    if not (diagnostics := summarize_exchange(metrics)):
        return []
    return [
        "## Regime and exchange diagnostics (training prompts; mean per step over the seeds run)",
        "",
        "All-fail share: the receiver's prompts on which all n of its rollouts failed. Complementarity: "
        "of those, the share on which a peer's group is mixed. Groups moved: prompt groups replaced by a "
        "peer's per step; peer responses: their total; admitted: the share with compatibility weight "
        "w > 0 (the gate). Clipped own / peer: trained tokens whose ratio was clipped, on own and on "
        "peer rows (percent).",
        "",
        diagnostics_markdown(diagnostics, names),
        "",
    ]


def transfer_lines(tables: TransferTables) -> list[str]:
    """How the gate met the transferred responses, and the advantage mass of the moved groups."""
    lines = []
    if tables.gates:
        lines += [
            "Transferred responses by outcome: the share that passes the gate (s > δ, the variant's "
            "delta; for a method without the gate, such as HACPO, the share it would pass), the share "
            "admitted (trained with w > 0: the gate, no gate or random admission, as compatibility.jsonl "
            "records it) and the median compatibility score s, for correct and for wrong peer responses. "
            "The gate should filter foreign style; when it passes fewer correct responses than wrong "
            "ones it is filtering out the lesson (docs/task_design.md).",
            "",
            gate_markdown(tables.gates),
            "",
        ]
    if tables.recomputed:
        lines += [
            f"Weights recomputed from s for {', '.join(tables.recomputed)}: their compatibility.jsonl was "
            "written before graftrl logged the applied weight w (the gate of eq. 8 with the variant's "
            "delta, w = 1 without it; random admission's draw cannot be recomputed: admitted left blank).",
            "",
        ]
    if tables.masses:
        which = (
            "for every variant whose compatibility.jsonl records w and A (any transfer rule), and, "
            "recomputed from s and the rewards, for older logs of the GRAFT variants that move whole groups"
            if tables.logged_masses
            else "for the GRAFT variants that move whole groups"
        )
        lines += [
            "Advantage mass of the moved groups: per moved group, the sum of w·A over the peer's correct "
            f"responses, over its wrong ones, and both (source advantages, eq. 1; weights, eq. 8), {which}. "
            "GRPO's advantages sum to 0 over a group, so without "
            "the gate the net is 0: tokens that all the peer's responses share, a step the receiver lacks "
            "included, get no net push; only what separates the peer's correct responses from its wrong "
            "ones does.",
            "",
            advantage_markdown(tables.masses),
            "",
        ]
    return lines
