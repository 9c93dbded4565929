"""The probe's verdict rule (docs/results.md §7): its score, the verdict probe.md prints, and the
line report's test of it, on hand-built figures and cells; the committed track record
(docs/probe/rule.json) recomputed from the committed cells; and the lab files' one-line errors."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
from scipy.stats import t as student_t

from graftrl.experiments import mastery
from graftrl.experiments.mastery_rule import line_record, rule_markdown, rule_summary
from graftrl.reporting.lab_data import LINE_FILE, RULE_FILE, LabDataError, read_lab_data
from graftrl.reporting.probe_report import verdict_lines
from graftrl.reporting.probe_rule import TrackRecord, load_rule, registered_rule, verdicts

RULE = registered_rule()
assert RULE is not None  # the tests run from the checkout, which holds docs/probe/rule.json
GAIN, NO_GAIN, M0 = RULE.gain, RULE.no_gain, RULE.m0


def score(outcomes):
    return RULE.score(outcomes)


ROOT = Path(__file__).resolve().parents[1]
LINE = ROOT / "experiments" / "worked" / "mastery-new"


def _pair(source: str, receiver: str, mass: float, correct: float, wrong: float, groups: int = 12) -> dict:
    return {
        "source": source,
        "receiver": receiver,
        "moved": {"groups": groups, "mass": {"net": mass}},
        "scored": {"correct": {"passed_share": correct}, "wrong": {"passed_share": wrong}},
    }


def _figures(method: str = "graft") -> dict:
    return {
        "probe": {"method": method},
        "pairs": [
            _pair("a", "b", M0 + 0.05, 0.8, 0.5),  # gain: mass above m0, gate favours correct
            _pair("b", "a", M0 + 0.05, 0.5, 0.6),  # the gate admits more wrong: no gain
        ],
    }


def test_the_score_counts_hits_and_gives_the_clopper_pearson_interval():
    outcomes = [(True, True), (True, False), *[(False, False)] * 5, (False, True)]
    record = score(outcomes)
    assert (record.trials, record.hits, record.called, record.called_right, record.never_hits) == (
        8,
        6,
        2,
        1,
        6,
    )
    # Clopper-Pearson 95% for 6 of 8: the beta quantiles [0.3491, 0.9681]
    assert record.low == pytest.approx(0.3491, abs=1e-4)
    assert record.high == pytest.approx(0.9681, abs=1e-4)
    assert score([(False, False)] * 8).high == 1.0


def test_the_rule_passes_with_at_most_one_miss_and_more_hits_than_never():
    both_gains = [(True, True), (True, True), *[(False, False)] * 5, (False, True)]
    assert score(both_gains).passed  # 7 of 8; "never" gets 5
    one_false_alarm = [(True, True), (True, False), *[(False, False)] * 6]
    assert score(one_false_alarm).hits == 7
    assert not score(one_false_alarm).passed  # "never" also gets 7: the rule adds nothing
    assert not score([(False, False)] * 8).passed  # never calling a gain cannot beat "never"
    assert not score([(True, True), *[(False, False)] * 5, (True, False), (False, True)]).passed  # 2 misses


def test_the_verdict_is_printed_only_with_a_record_that_passed():
    figures = _figures()
    passed = score([(True, True), (True, True), *[(False, False)] * 6])
    verdict = verdicts(figures, dataclasses.replace(RULE, record=passed))
    assert [d["verdict"] for d in verdict["directions"]] == [GAIN, NO_GAIN]
    text = "\n".join(verdict_lines(verdict))
    assert "a -> b" in text and GAIN in text and "embedded testbed's, not your pair's" in text
    assert "8 of 8 right" in text

    failed = score([(True, False), (True, False), *[(False, False)] * 6])
    verdict = verdicts(figures, dataclasses.replace(RULE, record=failed))
    assert verdict["directions"] == [] and verdict["track_record"]["passed"] is False
    text = "\n".join(verdict_lines(verdict))
    assert text.count("No verdict") == 1 and GAIN not in text
    assert "necessary conditions only" in text and "6 of 8 right" in text

    with_passed = dataclasses.replace(RULE, record=passed)
    assert verdicts(_figures("grpo"), with_passed)["directions"] == []  # the rule reads a graft probe
    assert "No verdict" in "\n".join(verdict_lines(verdicts(_figures("grpo"), with_passed)))


def test_the_registered_record_is_the_committed_lines():
    """docs/probe/rule.json's track record is what the committed cells of
    experiments/worked/mastery-new give, recomputed from their per-problem results and probes (no
    model loads), and what the line's results.json holds."""
    line = json.loads((LINE / "results.json").read_text())
    summaries = []
    for point in line["points"]:
        folder = LINE / f"mastery-{point}"
        rows = json.loads((folder / "results.json").read_text())["rows"]
        summaries.append({"point": point, "rule": rule_summary(point, folder, rows)})
    record, package = line_record(summaries), load_rule().record
    assert record is not None and package is not None and record.trials == 8
    written = line["probe_rule"]
    assert {k: v for k, v in record.as_dict().items() if k not in ("low", "high")} == {
        k: v for k, v in written.items() if k not in ("low", "high")
    }
    assert (record.low, record.high) == pytest.approx((written["low"], written["high"]), abs=1e-9)
    counts = ("trials", "hits", "called", "called_right", "never_hits")
    assert [getattr(record, k) for k in counts] == [getattr(package, k) for k in counts]
    assert (record.low, record.high) == pytest.approx((package.low, package.high), abs=1e-4)
    assert record.passed == package.passed


def _write_cells(folder: Path, diffs: dict[str, list[float]]) -> list[dict]:
    """GRPO and GRAFT rows of 3 seeds per receiver (no per-problem file: the seed interval)."""
    rows = []
    for model, deltas in diffs.items():
        for seed, delta in enumerate(deltas):
            base = 0.40 + 0.01 * seed
            rows.append({"variant": "grpo", "model": model, "seed": seed, "pass_at_1": base})
            rows.append({"variant": "graft", "model": model, "seed": seed, "pass_at_1": base + delta})
    folder.mkdir(parents=True)
    return rows


def test_the_line_scores_each_receiver_point_from_its_probe_and_its_cells(tmp_path):
    diffs = {"b": [0.05, 0.06, 0.07], "a": [0.02, -0.03, 0.04]}
    rows = _write_cells(tmp_path / "mastery-0.3", diffs)
    (tmp_path / "probe-0.3").mkdir()
    (tmp_path / "probe-0.3" / "probe.json").write_text(json.dumps(_figures()))
    found = rule_summary("0.3", tmp_path / "mastery-0.3", rows)
    by_receiver = {row["receiver"]: row for row in found}
    for model, deltas in diffs.items():
        half = student_t.ppf(0.975, 2) * statistics.stdev(deltas) / 3**0.5
        got = by_receiver[model]["graft_vs_grpo"]
        assert got["kind"] != "" and got["low"] == pytest.approx(statistics.mean(deltas) - half)
    assert by_receiver["b"]["verdict"] == GAIN and by_receiver["b"]["happened"] is True
    assert by_receiver["a"]["verdict"] == NO_GAIN and by_receiver["a"]["happened"] is False
    assert all(row["right"] for row in found)
    record = line_record([{"point": "0.3", "rule": found}, {"point": "0.4", "rule": None}])
    assert record == TrackRecord(2, 2, 1, 1, 1, record.low, record.high, passed=True)
    text = "\n".join(rule_markdown([{"point": "0.3", "rule": found}], record, seeds=3))
    assert "| 0.3 | a -> b |" in text and "provisional: 3 of the 5 seeds" in text
    assert rule_summary("0.4", tmp_path / "mastery-0.4", rows) is None  # no probe beside it


def _lab(tmp_path: Path, relative: str, text: str) -> Path:
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return tmp_path


def test_the_lab_files_fail_in_one_line_naming_the_file_and_the_key(tmp_path):
    with pytest.raises(LabDataError, match=f"{RULE_FILE}: lab data file missing") as missing:
        load_rule(tmp_path)
    assert "\n" not in str(missing.value)
    with pytest.raises(LabDataError, match=f"{RULE_FILE}: not valid JSON .* line 1"):
        load_rule(_lab(tmp_path, RULE_FILE, '{"m0": 0.65,'))
    committed = json.loads((ROOT / RULE_FILE).read_text())
    for index, (change, says) in enumerate(
        (
            ({"m0": "high"}, "`m0` must be the threshold"),
            ({"max_misses": True}, "`max_misses` must be"),
            ({"rule": "above {m1}"}, "may name only {m0} and {method}"),
            ({"track_record": {**committed["track_record"], "hits": 9}}, "counts must lie in"),
            ({"gain": None}, "`gain` must be"),
        )
    ):
        root = _lab(tmp_path / f"rule-{index}", RULE_FILE, json.dumps({**committed, **change}))
        with pytest.raises(LabDataError, match=says) as error:
            load_rule(root)
        assert str(error.value).startswith(RULE_FILE) and "\n" not in str(error.value)
    root = _lab(
        tmp_path / "no-key", RULE_FILE, json.dumps({k: v for k, v in committed.items() if k != "seeds"})
    )
    with pytest.raises(LabDataError, match="no `seeds`"):
        load_rule(root)
    root = _lab(tmp_path / "unmeasured", RULE_FILE, json.dumps({**committed, "track_record": None}))
    assert load_rule(root).record is None  # registered, not yet tested
    line = json.loads((ROOT / LINE_FILE).read_text())
    for index, (change, says) in enumerate(
        (
            ({"points": [0.08]}, "each a string"),
            ({"points": ["2"]}, r"in \(0, 1\]"),
            ({"regime_targets": {"contrast": [0, 1]}}, "unknown measure `contrast`"),
            ({"regime_targets": {"complementarity": [0.3]}}, r"must be \[low, high\]"),
        )
    ):
        root = _lab(tmp_path / f"line-{index}", LINE_FILE, json.dumps({**line, **change}))
        with pytest.raises(LabDataError, match=says):
            mastery.load_line(root)


def test_the_lab_files_hold_what_the_code_held_and_a_wheel_reads_none(monkeypatch):
    """The committed values moved out of the code unchanged; where graftrl runs from no checkout
    (an installed wheel carries no lab) nothing is read and the lab's sections are left out."""
    assert (RULE.registered, RULE.method, RULE.m0, RULE.seeds, RULE.max_misses) == (
        "1c2398a",
        "graft",
        0.65,
        5,
        1,
    )
    assert RULE.record is not None and not RULE.record.passed
    line = mastery.load_line()
    assert (
        line is not None and line.points == ("default", "0.45", "0.08", "0.03") and line.decision_seeds == 5
    )
    assert line.regime_targets == {
        "all_fail_share": (0.2, 0.6),
        "complementarity": (0.3, 1.0),
        "admitted_share": (0.4, 1.0),
        "regrouping_share": (0.5, 1.0),
    }
    monkeypatch.setattr("graftrl.reporting.lab_data.checkout_root", lambda: None)
    assert read_lab_data(RULE_FILE) is None and load_rule() is None and mastery.load_line() is None
    monkeypatch.setattr("graftrl.reporting.probe_rule.registered_rule", lambda: None)
    monkeypatch.setattr(mastery, "committed_line", lambda: None)
    assert verdicts(_figures()) is None and verdict_lines(None) == []
    assert mastery.demo_default([], seeds=5, seeds_planned=5) is None
    with pytest.raises(mastery.MasteryError, match="--points: give the points"):
        mastery.default_points()
