"""Mean ± std and paired differences, checked against hand values and textbook t quantiles."""

from __future__ import annotations

import json
import math

import pytest

from graftrl.evaluation.intervals import Difference, seed_interval
from graftrl.evaluation.stats import family_rows, mean_std, paired_deltas
from graftrl.experiments.demo import paired_vs_grpo
from graftrl.reporting.render import paired_markdown, results_table

# Two-sided 95% Student t quantiles from a printed table: df 2 -> 4.303, df 4 -> 2.776.
T_975 = {2: 4.302653, 4: 2.776445}


def test_mean_std_hand_values():
    s = mean_std([0.3, 0.4, 0.5])
    assert (s.mean, s.n) == (pytest.approx(0.4), 3) and s.std == pytest.approx(0.1)
    assert mean_std([0.7]).std == 0.0
    assert s.format(scale=100, digits=1) == "40.0 ± 10.0"
    with pytest.raises(ValueError):
        mean_std([])


def test_paired_difference_matches_the_t_interval_by_hand():
    # d = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, half-width t(2) * 0.1 / sqrt(3).
    treatment = {0: 0.6, 1: 0.7, 2: 0.8, 9: 0.99}  # seed 9 has no partner: ignored
    control = {0: 0.5, 1: 0.5, 2: 0.5, 7: 0.0}
    d = seed_interval(treatment, control)
    assert d is not None and d.seeds == (0, 1, 2)
    half = T_975[2] * 0.1 / math.sqrt(3)
    assert d.mean == pytest.approx(0.2) and d.se == pytest.approx(0.1 / math.sqrt(3))
    assert d.low == pytest.approx(0.2 - half, abs=1e-6) and d.high == pytest.approx(0.2 + half, abs=1e-6)
    assert not d.resolved  # the interval [-0.048, 0.448] contains 0
    assert json.loads(json.dumps(d.as_dict()))["high"] == pytest.approx(d.high)  # results.json-safe
    assert d.format(scale=100, digits=1) == "+20.0 [-4.8, +44.8]"


def test_paired_difference_resolves_a_consistent_gain_that_unpaired_std_hides():
    # Seeds differ a lot (0.2 .. 0.8) but the treatment is ahead by ~0.05 on every seed.
    control = {0: 0.2, 1: 0.4, 2: 0.5, 3: 0.7, 4: 0.8}
    treatment = {s: v + 0.05 + 0.01 * (s % 2) for s, v in control.items()}
    d = seed_interval(treatment, control)
    assert d is not None and d.resolved and d.low > 0
    diffs = [0.05, 0.06, 0.05, 0.06, 0.05]
    sd = mean_std(diffs).std
    assert d.high - d.low == pytest.approx(2 * T_975[4] * sd / math.sqrt(5), abs=1e-6)
    assert mean_std(list(control.values())).std > 10 * sd
    assert d.format().endswith(" *")


def test_paired_difference_edge_cases():
    assert seed_interval({0: 0.5}, {1: 0.5}) is None
    one = seed_interval({0: 0.6}, {0: 0.5})
    assert one is not None and one.low is None and not one.resolved
    assert one.format() == "+10.00 (1 seed)"  # points, the one text's default


def test_the_old_names_are_deprecated_aliases_of_the_one_type():
    import graftrl.evaluation.stats as stats

    with pytest.warns(DeprecationWarning, match="intervals.Difference"):
        assert stats.PairedDifference is Difference
    with pytest.warns(DeprecationWarning, match="intervals.seed_interval"):
        assert stats.paired_difference is seed_interval
    with pytest.raises(AttributeError):
        _ = stats.no_such_name


ROWS = [
    {"variant": "warm-start", "model": "a", "seed": 0, "pass_at_1": 0.1},
    {"variant": "grpo", "model": "a", "seed": 0, "pass_at_1": 0.30},
    {"variant": "grpo", "model": "a", "seed": 1, "pass_at_1": 0.40},
    {"variant": "grpo", "model": "a", "seed": 2, "pass_at_1": 0.50},
    {"variant": "graft", "model": "a", "seed": 0, "pass_at_1": 0.40},
    {"variant": "graft", "model": "a", "seed": 1, "pass_at_1": 0.60},
    {"variant": "graft", "model": "a", "seed": 2, "pass_at_1": 0.80},
]


def test_compare_and_demo_report_paired_differences():
    diffs = paired_deltas(ROWS, "grpo")
    assert set(diffs) == {"graft"}  # neither the reference nor the warm-start row
    assert diffs["graft"]["a"].mean == pytest.approx(0.2) and diffs["graft"]["a"].n == 3
    assert isinstance(diffs["graft"]["a"], Difference) and diffs["graft"]["a"].kind == "seeds"
    table = paired_markdown(ROWS, "grpo", ["grpo", "graft"]).splitlines()
    assert table[0] == "| variant | paired Δ a (points, 95% CI) |"
    assert table[2] == "| graft | +20.00 [-4.84, +44.84] |"

    demo_rows = [{**r, "method": r.pop("variant")} for r in map(dict, ROWS)]
    assert paired_vs_grpo(demo_rows)["graft"]["a"].as_dict()["high"] == pytest.approx(
        0.2 + T_975[2] * 0.1 / 3**0.5, abs=1e-6
    )
    assert len(results_table(demo_rows).rows) == 3


def test_family_rows_flatten_per_family_scores():
    rows = [
        {
            "variant": "graft",
            "model": "a",
            "seed": 0,
            "pass_at_1": 0.5,
            "per_family": {"add": 0.9, "sub": 0.1},
        },
        {"variant": "grpo", "model": "a", "seed": 0, "pass_at_1": 0.4},  # no families: contributes nothing
    ]
    flat = family_rows(rows)
    assert [(r["model"], r["pass_at_1"]) for r in flat] == [("a · add", 0.9), ("a · sub", 0.1)]
    assert all(r["variant"] == "graft" and r["seed"] == 0 for r in flat)
