"""One interval language (issue 57, item 3): one paired-difference type (``intervals.Difference``),
one text for it wherever a report shows one, and a caption above every table of them that names
its interval (95% CI over seeds, or over seeds x problems) and whether its marks are corrected."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import graftrl.experiments.compare.command as compare
from graftrl.cli import app
from graftrl.evaluation.intervals import SEEDS_ONLY, Difference, caption, dict_text, difference_text
from graftrl.evaluation.stats import paired_deltas
from graftrl.experiments import mastery, sweep
from graftrl.experiments.compare.plan import plan
from graftrl.experiments.mastery_rule import rule_markdown
from graftrl.experiments.paired_decisions import (
    Comparison,
    Costs,
    Decisions,
    decide,
    models_markdown,
    paired_table,
    plan_markdown,
)
from graftrl.reporting.render import paired_markdown, results_table

ONE_TEXT = re.compile(r"[+-]\d+\.\d+ (\[[+-]\d+\.\d+, [+-]\d+\.\d+\]( \*\*?)?|\(1 seed\))")
"""The one text of a paired difference: ``+2.40 [-0.10, +5.00] **``, or ``+2.40 (1 seed)``."""
INTERVAL = re.compile(r"95% CI over seeds( × problems)?")
CORRECTION = re.compile(r"\b(Holm-corrected|Benjamini-Hochberg-corrected|uncorrected)\b")

# GRAFT ahead of GRPO by 10-14 points on each of 3 seeds on model a (resolved), by -2..+3 on b
ROWS = [
    {"variant": variant, "model": model, "seed": seed, "pass_at_1": score}
    for model, grpo, graft in (
        ("a", (0.50, 0.40, 0.60), (0.60, 0.52, 0.74)),
        ("b", (0.3, 0.5, 0.4), (0.28, 0.53, 0.41)),
    )
    for variant, scores in (("grpo", grpo), ("graft", graft))
    for seed, score in enumerate(scores)
]


def _difference() -> Difference:
    return paired_deltas(ROWS, "grpo")["graft"]["a"]


def _receiver(diff: dict, deficit: str = "sub_borrow") -> dict:
    """A mastery line's receiver summary with ``diff`` as GRAFT − GRPO, overall and on the deficit."""
    none = {"success-only": None, "sgt": None}
    return {
        "deficit": deficit,
        "peer": "b",
        "peer_deficit_accuracy": 0.5,
        "pass_at_1": {"grpo": {"mean": 0.5, "std": 0.1, "n": 3}},
        "deficit_pass_at_1": {"grpo": {"mean": 0.2, "std": 0.1, "n": 3}},
        "vs_grpo": {"graft": diff, **none},
        "vs_graft": dict(none),
        "deficit_vs_grpo": {"graft": diff, **none},
        "deficit_vs_graft": dict(none),
        "all_fail_share": 0.3,
        "complementarity": 0.9,
        "groups_moved_per_step": 4.0,
        "admitted_share": 0.6,
        "contrast": None,
        "moved_errors": None,
        "clipped_peer": {},
    }


def _sweep_point(diff: Difference) -> dict:
    """A point of the overlap sweep with ``diff`` as model a's GRAFT − GRPO (nothing else measured)."""
    measured = ("warm_start_pass_at_1", "grpo_pass_at_1", "graft_pass_at_1", "all_fail_share")
    measured += ("complementarity", "groups_moved_per_step", "admitted_share")
    return {"overlap": 0.0, "models": {"a": {"graft_minus_grpo": diff.as_dict(), **dict.fromkeys(measured)}}}


def _task() -> SimpleNamespace:
    settings = SimpleNamespace(n=8, steps=60, batch_prompts=32, n_eval=256, eval_samples=8)
    return SimpleNamespace(name="embedded-worked", settings=settings)


def _line_report(diff: Difference) -> str:
    """The mastery line's report with ``diff`` in each of its tables: the rules', the deficit's, the
    hint's and the probe rule's."""
    hint = [Comparison("0.05", "grpo", "hint", "a", "heldout", diff)]
    decide(hint, Decisions())
    point = {
        "point": "0.05",
        "models": {"a": _receiver(diff.as_dict())},
        "hint": {
            "comparisons": hint,
            "deficit": [Comparison("0.05", "grpo", "hint", "a", "heldout", diff)],
            "rescue": {},
        },
        "rule": [
            {
                "source": "b",
                "receiver": "a",
                "inputs": None,
                "verdict": "gain",
                "graft_vs_grpo": diff.as_dict(),
                "happened": True,
                "right": True,
            }
        ],
    }
    points = [point]
    return mastery.report_markdown(
        points, 3, _task(), {}, hint_family=1, rule_lines=rule_markdown(points, None, 3)
    )


def paired_tables(markdown: str) -> list[tuple[str, list[str]]]:
    """Every markdown table with a paired difference in a cell: (the line above it, its rows)."""
    lines, found, i = markdown.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        rows = lines[start:i]
        cells = [cell.strip() for row in rows[2:] for cell in row.strip("|").split("|")]
        if any(ONE_TEXT.fullmatch(cell) for cell in cells):
            above = next((line for line in reversed(lines[:start]) if line.strip()), "")
            found.append((above, rows))
    return found


def assert_tables_say_interval_and_correction(markdown: str, at_least: int = 1) -> list[str]:
    """Every table of paired differences names its interval and correction in the line above it;
    returns those lines."""
    tables = paired_tables(markdown)
    assert len(tables) >= at_least, markdown
    for above, rows in tables:
        assert INTERVAL.search(above) and CORRECTION.search(above), (above, rows[0])
    return [above for above, _ in tables]


def test_one_difference_has_one_text_in_every_report():
    d = _difference()
    points, one = d.format(), d.format(digits=1)  # compare's tables: 2 decimals; the lines' and demo's: 1
    assert d.kind == SEEDS_ONLY and d.resolved and ONE_TEXT.fullmatch(points) and ONE_TEXT.fullmatch(one)
    assert points == f"{100 * d.mean:+.2f} [{100 * d.low:+.2f}, {100 * d.high:+.2f}] *"
    assert points == difference_text(d.mean, d.low, d.high, mark="*")
    assert dict_text(json.loads(json.dumps(d.as_dict()))) == points  # as results.json holds it

    # compare: Tables 1 and 2, the Decisions table and --plan (a decided comparison: ** or *)
    family = paired_table(ROWS, {}, ["heldout"], "grpo", ["graft"], ["heldout"], table="Table 1")
    decide(family, Decisions())
    c = next(c for c in family if c.model == "a")
    assert (c.diff.mean, c.diff.low, c.diff.high) == (d.mean, d.low, d.high)
    decided = d.format(mark=c.mark)
    assert c.cell() == decided and decided.startswith(points.removesuffix(" *"))
    assert f"| graft | {decided} |" in models_markdown(family, "Table 1", ["graft"])
    assert f"| heldout | {decided} |" in plan_markdown(family, Decisions(), Costs())
    # compare's per-family section (and any table of result rows)
    assert f"| graft | {points} |" in paired_markdown(ROWS, "grpo", ["graft"])
    # the sweep's line, read back from its results.json form
    assert f"| {points} | 3 |" in sweep.report_markdown([_sweep_point(d)], 3, _task(), {})
    # the mastery line: its two tables, the hint's and the probe rule's
    line = _line_report(d)
    assert line.count(f"| {one} |") >= 3 and f"| {c.diff.format(digits=1, mark=c.mark)} |" in line
    # the demo's console table
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(results_table([{**r, "method": r["variant"]} for r in ROWS]))
    assert f"│ {one} " in console.export_text()
    # one seed: no interval, the same words everywhere
    single = paired_deltas([r for r in ROWS if r["seed"] == 0], "grpo")["graft"]["a"]
    assert single.format() == f"{100 * single.mean:+.2f} (1 seed)" and ONE_TEXT.fullmatch(single.format())


@pytest.fixture
def tiny(tiny_task, tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "embedded_task", lambda out_dir, cache_dir, quick, console: tiny_task)
    out = tmp_path / "cmp"
    return out, ["compare", "--preset", "demo", "--quick", "--out", str(out), "--cache", str(tmp_path / "c")]


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_every_table_of_paired_differences_names_its_interval_and_correction(tiny):
    out, args = tiny
    _invoke(*args, "--seeds", "2")  # per-problem results: the interval over seeds x problems, Holm
    report = (out / "report.md").read_text()
    captions = assert_tables_say_interval_and_correction(report, at_least=2)  # Table 1, Decisions
    assert all("95% CI over seeds × problems" in c and "Holm-corrected" in c for c in captions[:2])
    for c in captions[2:]:  # compare's per-family section: over seeds, and plainly exploratory
        assert c.startswith("Exploratory") and "95% CI over seeds]" in c and "uncorrected" in c
    plan_text = plan([out], Decisions())
    (above,) = assert_tables_say_interval_and_correction(plan_text)
    assert "95% CI over seeds × problems" in above and "Holm-corrected over the plan's" in above

    _invoke(*args, "--seeds", "2", "--report-only", "--seed-intervals", "--correction", "bh")
    captions = assert_tables_say_interval_and_correction((out / "report.md").read_text(), at_least=2)
    assert all("95% CI over seeds]" in c and "Benjamini-Hochberg-corrected" in c for c in captions[:2])
    _invoke(*args, "--seeds", "2", "--report-only", "--correction", "none")
    captions = assert_tables_say_interval_and_correction((out / "report.md").read_text(), at_least=2)
    assert all("uncorrected" in c for c in captions)


def test_the_lines_and_the_demo_name_their_interval_and_correction():
    d = _difference()
    line = _line_report(d)
    rules, deficit, hint, rule = assert_tables_say_interval_and_correction(line, at_least=4)
    for above in (rules, deficit):  # the seeds' own interval, uncorrected, said for what it is
        assert "95% CI over seeds]" in above and "uncorrected for the table's" in above
        assert sweep.PAIRED_NOTE in above and "not on new problems" in above
    assert "Holm-corrected over the line's 1 comparisons of the first four columns" in hint
    assert "The deficit columns (exploratory)" in hint and "uncorrected" in hint
    assert "uncorrected for the table's 1 receiver-points" in rule

    (above,) = assert_tables_say_interval_and_correction(
        sweep.report_markdown([_sweep_point(d)], 3, _task(), {})
    )
    assert "95% CI over seeds]" in above and "uncorrected for the table's 1 comparisons" in above

    # compare's per-family section: the interval over seeds, uncorrected, and said to be exploratory
    from graftrl.experiments.compare.report import family_section

    rows = [
        {**r, "wall_s": 1.0, "per_family": {"add": r["pass_at_1"], "sub": 1 - r["pass_at_1"]}} for r in ROWS
    ]
    decided = [Comparison("Table 1", "grpo", "graft", "a", "heldout", d)]
    report = SimpleNamespace(
        rows=rows, baseline="grpo", reference=None, names=["grpo", "graft"], family=decided
    )
    (above,) = assert_tables_say_interval_and_correction("\n".join(family_section(report)))
    assert above.startswith("Exploratory, not in the family that Table 1 corrects")
    assert "95% CI over seeds]" in above and "uncorrected for the table's 4 comparisons" in above

    table = results_table([{**r, "method": r["variant"]} for r in ROWS])
    assert table.caption == caption(
        "paired Δ vs GRPO", [SEEDS_ONLY], "none", "the table's 2 comparisons"
    ).replace("`", "")
    assert INTERVAL.search(str(table.caption)) and CORRECTION.search(str(table.caption))
