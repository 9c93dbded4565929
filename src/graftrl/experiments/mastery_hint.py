"""The mastery line's hint rows (``graftrl sweep --knob mastery --preset hint``; issue 50): the peer
in the receiver's prompt (CoRe's rescue round, ``method: hint``) against the peer in its gradient
(GRAFT, success-only transfer, SGT) and against GRPO, at each receiver-point.

Per receiver it reports the paired differences of held-out pass@1 (hint minus each reference,
paired by seed and problem; corrected together across the line by Holm's step-down; on the deficit
family over seeds, uncorrected and exploratory) and what the rescue rounds
logged on the training prompts: how many all-fail prompts a step sent to the round, the share
solved at least once with the hint, the hinted responses' accuracy, how often the hint had to be
cut to the receiver's context, and the first step each wrong hinted response got wrong
(``embedded.task.classify_worked``, from ``rescues.jsonl``'s texts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success
from graftrl.embedded.task import WORKED_OUTCOMES, classify_worked
from graftrl.evaluation.intervals import SEEDS_ONLY, caption
from graftrl.evaluation.stats import family_rows
from graftrl.experiments.paired_decisions import Comparison, Decisions, decide, paired_table
from graftrl.reporting.contrast import moved_error_classes
from graftrl.reporting.problem_results import folder_problem_results
from graftrl.reporting.run_logs import read_log, read_run_metrics, run_success_threshold, run_train_file
from graftrl.storage.data import load_problems
from graftrl.storage.rundir import ExperimentDir, RunDir

BASELINE, REFERENCE = "grpo", "graft"
"""The line's baseline and its reference transfer rule (cells' variant names)."""
HINT = "hint"
REFERENCES = (BASELINE, REFERENCE, "success-only", "sgt")
"""What the hint rows are compared with: GRPO, then the peer in the gradient."""
COLUMN = "heldout"
DIGITS = 1
"""Decimals of the line's tables (points of pass@1)."""
ERRORS = tuple(name for name in WORKED_OUTCOMES if name != "correct")


def _hint_runs(folder: Path, seeds: int) -> list[Path]:
    runs = ExperimentDir(folder)
    return [runs.run(HINT, s).root for s in range(seeds) if runs.run(HINT, s).holds_run()]


def _problems(run: Path) -> dict[str, str]:
    """Prompt id -> problem text of the training data a run read."""
    return {p.id: p.problem for p in load_problems(run_train_file(run))}


def rescue_summary(runs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """receiver -> its rescue rounds over ``runs``: prompts sent per step, the share solved at
    least once with the hint, the hinted responses' accuracy, the share of hints cut to the
    context, and the error classes of the wrong hinted responses (where texts were logged)."""
    sums: dict[str, Counter[str]] = {}
    texts: list[dict[str, Any]] = []  # as compatibility.jsonl's rows, for moved_error_classes
    problems = _problems(runs[0]) if runs else {}
    for run in runs:
        for row in read_run_metrics(run):
            if "rescue_attempted" not in row:
                continue
            s = sums.setdefault(row["model"], Counter())
            s["steps"] += 1
            for key in ("attempted", "solved", "truncated", "skipped"):
                s[key] += float(row.get(f"rescue_{key}") or 0.0)
        if not RunDir(run).rescues.exists():
            continue
        threshold = run_success_threshold(run)
        for row in read_log(RunDir(run).rescues):
            s = sums.setdefault(row["receiver"], Counter())
            s["responses"] += 1
            s["correct"] += float(is_success(row["reward"], threshold))
            if row.get("response") is not None:
                texts.append({key: row[key] if key == "receiver" else [row[key]]
                              for key in ("receiver", "prompt_id", "response", "reward")})  # fmt: skip
    threshold = run_success_threshold(runs[0]) if runs else SUCCESS_THRESHOLD
    errors = moved_error_classes(texts, problems, classify_worked, WORKED_OUTCOMES, threshold)
    out = {}
    for receiver, s in sums.items():
        sent = s["attempted"] + s["skipped"]
        wrong = errors.get(receiver, {"wrong_responses": 0})
        out[receiver] = {
            "prompts_per_step": s["attempted"] / s["steps"] if s["steps"] else None,
            "rescue_rate": s["solved"] / s["attempted"] if s["attempted"] else None,
            "hinted_accuracy": s["correct"] / s["responses"] if s["responses"] else None,
            "hint_cut_share": s["truncated"] / sent if sent else None,
            "skipped_share": s["skipped"] / sent if sent else None,
            "wrong_responses": wrong["wrong_responses"],
            "wrong_errors": {name: wrong.get(name, 0.0) for name in ERRORS},
        }
    return out


def hint_comparisons(point: str, folder: Path, rows: Sequence[Mapping[str, Any]]) -> list[Comparison]:
    """hint - each reference on each receiver's held-out pass@1, paired by seed (and by problem where
    both cells kept per-problem results), labelled with the point."""
    problems = folder_problem_results(folder, sorted({(r["variant"], int(r["seed"])) for r in rows}))
    return [
        c
        for reference in REFERENCES
        for c in paired_table(rows, problems, [COLUMN], reference, [HINT], [COLUMN], table=point)
    ]


def hint_summary(
    point: str,
    folder: Path,
    rows: Sequence[Mapping[str, Any]],
    seeds: int,
    deficits: Mapping[str, str | None],
) -> dict[str, Any] | None:
    """The point's hint rows (None when no hint cell ran there): the comparisons (uncorrected: the
    line corrects them together, ``correct_line``), those on each receiver's deficit family
    (``deficits``: receiver -> family) against GRPO and GRAFT, and the rescue rounds' diagnostics."""
    runs = _hint_runs(folder, seeds)
    if not runs:
        return None
    wanted = {f"{model} · {family}": model for model, family in deficits.items() if family}
    on_deficit = [row for row in family_rows(rows) if row["model"] in wanted]
    deficit = [
        replace(c, model=wanted[c.model])
        for reference in REFERENCES[:2]
        for c in paired_table(on_deficit, {}, [COLUMN], reference, [HINT], [COLUMN], table=point)
    ]
    return {
        "comparisons": hint_comparisons(point, folder, rows),
        "deficit": deficit,
        "deficits": dict(deficits),
        "rescue": rescue_summary(runs),
    }


def correct_line(summaries: Sequence[Mapping[str, Any]], decisions: Decisions | None = None) -> int:
    """Holm's step-down (or ``decisions``' correction) over every hint comparison of the line, in
    place; returns the family's size."""
    family = [c for s in summaries if s.get("hint") for c in s["hint"]["comparisons"]]
    decide(family, decisions or Decisions())
    return sum(c.adjusted is not None for c in family)


def as_json(hint: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A point's hint rows for results.json."""
    if hint is None:
        return None

    def row(c: Comparison) -> dict[str, Any]:
        return {
            "receiver": c.model,
            "versus": c.versus,
            **c.diff.as_dict(),
            "adjusted_p": c.adjusted,
            "survives": c.survives,
        }

    return {
        "vs": [row(c) for c in hint["comparisons"]],
        "deficit_vs": [row(c) for c in hint["deficit"]],
        "deficits": hint["deficits"],
        "rescue": hint["rescue"],
    }


def pct(value: float | None, digits: int = 1) -> str:
    """A share in percent for the line's tables; — where there is none."""
    return "—" if value is None else f"{100 * value:.{digits}f}"


def hint_markdown(summaries: Sequence[Mapping[str, Any]], family: int) -> list[str]:
    """The report's hint section (nothing when no point ran hint)."""
    points = [s for s in summaries if s.get("hint")]
    if not points:
        return []
    lines = [
        "",
        "## The peer in the prompt (hint) against the peer in the gradient",
        "",
        "Hint: the receiver samples its all-fail prompts again with a hint cut from one of the "
        "peer's verified successes (`method: hint`, CoRe's rescue round; docs/algorithm.md §3.1).",
        "",
        caption(
            "Hint − each method on held-out pass@1, paired by seed and, where both cells kept per-problem "
            "results, by problem",
            {c.diff.kind for s in points for c in s["hint"]["comparisons"] if c.diff.n > 1},
            "holm",
            f"the line's {family} comparisons of the first four columns",
        )
        + " "
        + caption(
            "The deficit columns (exploratory): hint − GRPO and − GRAFT on the receiver's deficit family",
            [SEEDS_ONLY],
            "none",
        ),
        "",
        "| point | receiver | hint − GRPO | hint − GRAFT | hint − success-only | hint − SGT "
        "| deficit: hint − GRPO | deficit: hint − GRAFT |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in points:
        hint = s["hint"]
        for model in sorted({c.model for c in hint["comparisons"]}):
            cells = [
                next(
                    (c.cell(DIGITS) for c in hint["comparisons"] if c.model == model and c.versus == ref), "—"
                )
                for ref in REFERENCES
            ]
            deficit = [
                next(
                    (
                        c.diff.format(digits=DIGITS)
                        for c in hint["deficit"]
                        if c.model == model and c.versus == ref
                    ),
                    "—",
                )
                for ref in REFERENCES[:2]
            ]
            lines.append(f"| {s['point']} | {model} | " + " | ".join([*cells, *deficit]) + " |")
    lines += [
        "",
        "Rescue rounds (training prompts, hint runs): prompts sent per step (the receiver's all-fail "
        "prompts with a peer success), the share solved at least once with the hint, the hinted "
        "responses' accuracy, the share of hints cut to fit the context, and the first step each "
        "wrong hinted response got wrong.",
        "",
        "| point | receiver | sent / step | rescued | hinted accuracy | hint cut | "
        "wrong: regrouping / fact / copy / format (n) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in points:
        for model, r in sorted(s["hint"]["rescue"].items()):
            errors = " / ".join(pct(r["wrong_errors"][k], 0) for k in ERRORS) + f" ({r['wrong_responses']})"
            per_step = "—" if r["prompts_per_step"] is None else f"{r['prompts_per_step']:.2f}"
            lines.append(
                f"| {s['point']} | {model} | {per_step} | {pct(r['rescue_rate'])} | "
                f"{pct(r['hinted_accuracy'])} | {pct(r['hint_cut_share'], 0)} | {errors} |"
            )
    return lines
