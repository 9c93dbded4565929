"""The probe rule's test on a mastery line (issue 48, item 5; docs/results.md §7).

Where a point's probe sits beside its cells (``probe-<point>/probe.json``, run with the registered
command before the cells trained), each receiver-point gets the rule's verdict from the probe
(``reporting.probe_rule``) and the outcome it predicts: GRAFT − GRPO on the receiver's held-out
pass@1 with compare's default interval (paired over seeds and problems, uncorrected for the other
receiver-points: each is its own test of the rule). "Beats" when the interval's lower end is above
0. The line's report then scores the rule over every receiver-point it has both for. The rule is the
registered one (``docs/probe/rule.json``) unless a caller passes another; with none (graftrl runs
from no checkout) the line has no rule section.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from graftrl.evaluation.intervals import Difference, caption, dict_text
from graftrl.experiments.mastery_hint import BASELINE, COLUMN, DIGITS, REFERENCE, pct
from graftrl.experiments.paired_decisions import paired_table
from graftrl.reporting.probe_rule import Rule, TrackRecord, registered_rule, rule_inputs
from graftrl.reporting.problem_results import folder_problem_results
from graftrl.storage.rundir import ProbeDir


def probe_dir(folder: Path, point: str) -> Path:
    """A point's probe, beside its cells: ``<out>/probe-<point>`` next to ``<out>/mastery-<point>``."""
    return folder.parent / f"probe-{point}"


def graft_vs_grpo(folder: Path, rows: Sequence[Mapping[str, Any]]) -> dict[str, Difference]:
    """Receiver -> GRAFT − GRPO on its held-out pass@1 in a compare folder: compare's default
    interval, paired over seeds and problems, uncorrected for other receiver-points (the outcome
    both registered rules predict)."""
    cells = sorted({(r["variant"], int(r["seed"])) for r in rows})
    return {
        c.model: c.diff
        for c in paired_table(
            rows, folder_problem_results(folder, cells), [COLUMN], BASELINE, [REFERENCE], [COLUMN]
        )
    }


def rule_summary(
    point: str, folder: Path, rows: Sequence[Mapping[str, Any]], rule: Rule | None = None
) -> list[dict[str, Any]] | None:
    """Per receiver at one point: the probe's rule inputs and verdict, GRAFT − GRPO and whether the
    verdict was right (None when the point has no probe or there is no rule; ``right`` None until
    both variants share two seeds)."""
    rule = rule if rule is not None else registered_rule()
    probe = ProbeDir(probe_dir(folder, point))
    if rule is None or not probe.json.exists():
        return None
    figures = json.loads(probe.json.read_text())
    comparisons = graft_vs_grpo(folder, rows)
    out = []
    for pair in figures["pairs"]:
        inputs = rule_inputs(pair)
        verdict = rule.verdict(inputs)
        diff = comparisons.get(pair["receiver"])
        happened = None if diff is None or diff.low is None else diff.low > 0
        out.append(
            {
                "source": pair["source"],
                "receiver": pair["receiver"],
                "method": figures["probe"]["method"],
                "inputs": asdict(inputs) if inputs else None,
                "verdict": verdict,
                "graft_vs_grpo": diff.as_dict() if diff else None,
                "happened": happened,
                "right": None if happened is None else (verdict == rule.gain) == happened,
            }
        )
    return out


def line_record(summaries: Sequence[Mapping[str, Any]], rule: Rule | None = None) -> TrackRecord | None:
    """The rule scored over every receiver-point of the line with a probe and an outcome."""
    rule = rule if rule is not None else registered_rule()
    if rule is None:
        return None
    outcomes = [
        (row["verdict"] == rule.gain, row["happened"])
        for s in summaries
        for row in s.get("rule") or []
        if row["happened"] is not None
    ]
    return rule.score(outcomes) if outcomes else None


YES_NO = {None: "—", True: "yes", False: "no"}


MISSES = {0: "no miss", 1: "one miss"}


def rule_markdown(
    summaries: Sequence[Mapping[str, Any]], record: TrackRecord | None, seeds: int, rule: Rule | None = None
) -> list[str]:
    """The line report's section on the rule (empty when no point has a probe); the score is
    provisional while the line has fewer ``seeds`` than the test registered."""
    rule = rule if rule is not None else registered_rule()
    rows = [(s["point"], row) for s in summaries for row in s.get("rule") or []]
    if not rows or rule is None:
        return []
    lines = [
        "",
        "## The probe rule's test (issue 48 item 5, docs/results.md §7)",
        "",
        f'Rule (fixed at {rule.registered}), from each point\'s `probe-<point>/probe.json`: "{rule.gain}" when '
        f"the net advantage mass per moved group *M* > {rule.m0} and the gate admits more of the candidate "
        f'correct responses than of the wrong ones (*a_c* > *a_w*); else "{rule.no_gain}".',
        "",
        caption(
            "Outcome: GRAFT − GRPO on the receiver's held-out pass@1, paired by seed and problem "
            "(compare's default interval; a gain when its lower end is above 0)",
            {d["kind"] for _, row in rows if (d := row["graft_vs_grpo"]) and d["low"] is not None},
            "none",
            f"the table's {sum(row['graft_vs_grpo'] is not None for _, row in rows)} receiver-points, "
            "each its own test of the rule",
        ),
        "",
        "| point | peer -> receiver | *M* | *a_c* / *a_w* (%) | verdict | GRAFT − GRPO | seeds | gain | right |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for point, row in rows:
        inputs, diff = row["inputs"] or {}, row["graft_vs_grpo"]
        interval = dict_text(diff, digits=DIGITS)
        lines.append(
            f"| {point} | {row['source']} -> {row['receiver']} | "
            f"{'—' if not inputs else format(inputs['mass'], '+.2f')} | "
            f"{pct(inputs.get('admitted_correct'))} / {pct(inputs.get('admitted_wrong'))} | {row['verdict']} | "
            f"{interval} | {diff['n'] if diff else 0} | {YES_NO[row['happened']]} | {YES_NO[row['right']]} |"
        )
    if record is not None:
        pending = seeds < rule.seeds
        verdict = (
            ("would pass" if pending else "passes")
            if record.passed
            else ("would fail" if pending else "fails")
        )
        lines += [
            "",
            f"Score{f' (provisional: {seeds} of the {rule.seeds} seeds registered)' if pending else ''}: "
            f"{record.describe()}. The rule {verdict} its registered bar (at most "
            f"{MISSES.get(rule.max_misses, f'{rule.max_misses} misses')} and more right than the constant rule).",
        ]
    return lines
