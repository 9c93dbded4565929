"""`graftrl analyze` on a real two-step GRAFT run (tiny models, scripted rewards) with a store."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import CROSSED, FIXTURES, ScriptedRewards, make_config
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict
from graftrl.core import grpo_advantages
from graftrl.reporting.analysis_report import write_analysis
from graftrl.reporting.analyze import analyze_run
from graftrl.reporting.diagnostics import (
    AdvantageMass,
    GateOutcome,
    advantage_mass,
    family_progress,
    gate_by_outcome,
)
from graftrl.reporting.render import advantage_markdown, gate_markdown, progress_markdown
from graftrl.reporting.weights import WeightRule
from graftrl.storage.rundir import read_metrics
from graftrl.storage.store import TrajectoryStore, TrajectoryWriter, tokenizer_id
from graftrl.training.trainer import Trainer
from graftrl.training.trajectories import rollout_records, stored_rows

SECTIONS = [
    "## Complementarity (paper Figure 1)",
    "## Exchange volume",
    "## Admission and compatibility (s, w)",
    "## Clipping (paper Table 9)",
    "## Reward and response length",
    "## Validation",
    "## Compute (paper Appendix D)",
    "## Trajectory store",
]


@pytest.fixture(scope="module")
def run_dir(tiny_checkpoints, tmp_path_factory) -> Path:
    """A real GRAFT run (2 steps, n = 4) whose rollouts are also written to run/store."""
    run = tmp_path_factory.mktemp("analyze") / "run"
    config = config_from_dict(
        {
            "method": "graft",
            "seed": 3,
            "policies": [
                {"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="},
                {"name": "gpt2", "path": str(tiny_checkpoints["gpt2"]), "template": "Q: {problem}\nA: "},
            ],
            "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
            "rollout": {"n": 4, "max_new_tokens": 8},
            "train": {"steps": 2, "batch_prompts": 4, "minibatch_prompts": 2, "micro_batch_size": 5},
            "optim": {"lr": 1e-2},
            "graft": {"delta": 0.5},
            "logging": {"progress": False},
        }
    )
    rewards = ScriptedRewards(CROSSED)
    writer = TrajectoryWriter(run / "store")
    rollouts = []

    def store_step(step: int, metrics) -> None:
        problems = trainer.sampler.batch(step)
        rows = []
        for (policy, rollout), pattern in zip(rollouts, rewards.given[-len(rollouts) :], strict=True):
            import torch

            r = torch.tensor(pattern, dtype=torch.float32)
            records = rollout_records(step, policy.name, problems, rollout, r, grpo_advantages(r))
            rows += stored_rows(
                records, rollout, [p.problem for p in problems], tokenizer_id(policy.tokenizer)
            )
        writer.write_step(step, rows)
        rollouts.clear()

    trainer = Trainer(config, run, verifier=rewards, step_callback=store_step)
    for worker in trainer.workers:

        def recording_generate(policy, prompts, params, seed=None, generate=worker.engine.generate):
            rollout = generate(policy, prompts, params, seed)
            rollouts.append((policy, rollout))
            return rollout

        worker.engine.generate = recording_generate
    trainer.train()
    # best/best.json and validation.jsonl as graftrl.training.validation writes them
    (run / "best").mkdir()
    best = {
        "llama": {"step": 0, "completed_steps": 1, "aggregate": 0.25},
        "gpt2": {"step": 1, "completed_steps": 2, "aggregate": 0.5},
    }
    (run / "best" / "best.json").write_text(json.dumps(best))
    validation = [
        {"step": s, "model": m, "aggregate": a, "pass_at_1/tiny": a, "best": True, "time_validation": 3.0}
        for s, m, a in [
            (0, "llama", 0.0),
            (0, "llama", 0.25),
            (0, "gpt2", 0.1),
            (1, "llama", 0.2),
            (1, "gpt2", 0.5),
        ]
    ]  # the first row is repeated by a resume: the last one counts
    (run / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in validation))
    return run


def test_analysis_report_plots_and_numbers(run_dir, tmp_path):
    result = analyze_run(run_dir)
    written = write_analysis(result, tmp_path / "out")
    text = (tmp_path / "out" / "analysis.md").read_text()
    assert written.report == tmp_path / "out" / "analysis.md"
    positions = [text.index(section) for section in SECTIONS]
    assert positions == sorted(positions)
    for name in (
        "reward",
        "response_length",
        "complementarity",
        "exchange",
        "compatibility_s",
        "compatibility_w",
        "clipping",
        "compute",
        "validation",
    ):
        path = tmp_path / "out" / f"{name}.png"
        assert path.exists() and path.read_bytes()[:4] == b"\x89PNG", name
        assert f"]({name}.png)" in text
    assert result.delta == 0.5 and result.models == ["llama", "gpt2"] and result.steps == [0, 1]

    rows = read_metrics(run_dir)
    # zero-peer-clipping share by hand: among (step, model) rows with peer tokens, clip_frac_peer == 0
    peer_rows = [r for r in rows if r.get("clip_frac_peer") is not None]
    assert peer_rows  # steps where some grafted response was admitted (s > delta)
    expected_share = sum(r["clip_frac_peer"] == 0 for r in peer_rows) / len(peer_rows)
    assert result.clipping.zero_peer_share() == pytest.approx(expected_share)
    for model in ("llama", "gpt2"):
        mine = [r for r in peer_rows if r["model"] == model]
        assert result.clipping.zero_peer_share(model) == pytest.approx(
            sum(r["clip_frac_peer"] == 0 for r in mine) / len(mine)
        )
        own = statistics.fmean(r["clip_frac_own"] for r in rows if r["model"] == model)
        assert result.clipping.own[model] == pytest.approx(own)
    # accelerator-hours by hand: 1 accelerator per policy x summed time_step
    hours = {m: sum(r["time_step"] for r in rows if r["model"] == m) / 3600 for m in ("llama", "gpt2")}
    for model, value in hours.items():
        assert result.compute.hours(model) == pytest.approx(value)
    to_best = {
        "llama": sum(r["time_step"] for r in rows if r["model"] == "llama" and r["step"] == 0) / 3600,
        "gpt2": hours["gpt2"],  # best after the last step
    }
    for model, value in to_best.items():
        assert result.compute.hours_to_best(model) == pytest.approx(value)
    assert result.compute.total_hours == pytest.approx(sum(hours.values()))
    assert result.compute.total_hours_to_best == pytest.approx(sum(to_best.values()))
    assert f"| total | 2 | – | {sum(r['time_step'] for r in rows):.4g} | {sum(hours.values()):.4g} |" in text
    assert "Validation wall-clock, excluded above: 12 s." in text
    assert len(result.validation) == 4 and "| aggregate | llama | 0.25 | 0 |" in text

    # complementarity: metrics say 1.0 each step; the store's rewards agree
    for comp in result.complementarity:
        assert comp.by_step == {0: 1.0, 1: 1.0}
        assert comp.store_by_step == comp.by_step and not comp.mismatches
    assert text.count("agrees on 2 step(s)") == 2
    assert result.store_ok is True

    # exchange: one prompt, four responses each way each step; admitted = s > delta in compatibility.jsonl
    compat = [json.loads(line) for line in (run_dir / "compatibility.jsonl").read_text().splitlines()]
    for ex in result.exchange:
        assert ex.selected == [1.0, 1.0] and ex.transferred == [4, 4]
        scores = [s for c in compat if c["receiver"] == ex.receiver for s in c["s"]]
        assert ex.admitted == [sum(s > 0.5 for s in c["s"]) for c in compat if c["receiver"] == ex.receiver]
        assert ex.w == [min(s, 1.0) if s > 0.5 else 0.0 for s in scores]


def test_store_disagreement_is_reported(run_dir, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    rows = read_metrics(run_dir)
    for row in rows:
        if row["model"] == "llama" and row["step"] == 1:
            row["complementarity/gpt2"] = 0.5
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = analyze_run(copy, store_dir=run_dir / "store")
    llama = next(c for c in result.complementarity if c.receiver == "llama")
    assert llama.mismatches == [(1, 0.5, 1.0)]
    report = write_analysis(result, copy / "analysis").report
    assert "DISAGREES at steps 1 (metrics 0.5, store 1)" in report.read_text()
    assert TrajectoryStore(run_dir / "store").verify().ok


def test_cli_analyze(run_dir, tmp_path):
    result = CliRunner().invoke(app, ["analyze", str(run_dir), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cli" / "analysis.md").exists()
    missing = CliRunner().invoke(app, ["analyze", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no metrics.jsonl" in " ".join(missing.output.split())


def test_metrics_only_run_with_a_torn_last_line(tmp_path):
    """A single-model run with nothing but metrics.jsonl, cut mid-append by a crash."""
    rows = [
        {
            "step": s,
            "model": "solo",
            "reward_mean": 0.1 * s,
            "all_fail_frac": 0.5,
            "all_pass_frac": 0.0,
            "response_length": 10.0,
            "clip_frac_own": 0.01,
            "clip_frac_peer": None,
            "time_rollout": 1.0,
            "time_reward": 0.5,
            "time_update": 2.0,
        }
        for s in range(3)
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "mod'
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "config.yaml").write_text("policies:\n  - {name: solo, path: x, parallel: {data: 4}}\n")
    result = analyze_run(tmp_path)
    assert result.compute.hours("solo") == pytest.approx(
        4 * 3 * 3.5 / 3600
    )  # phases summed without time_step
    assert result.clipping.zero_peer_share() is None and not result.exchange
    report = write_analysis(result, tmp_path / "analysis").report.read_text()
    assert "incomplete last line skipped" in report and "No exchange in this run" in report
    # A damaged line elsewhere is skipped with a warning naming file:line (and a note in the report).
    (tmp_path / "metrics.jsonl").write_text("not json\n" + text)
    damaged = analyze_run(tmp_path)
    assert damaged.steps == result.steps
    assert any(f"{tmp_path / 'metrics.jsonl'}:1: not valid JSON" in note for note in damaged.notes)


def test_analysis_uses_core_eqs_with_the_former_numbers():
    """w (eq. 8) and complementarity come from ``core``; they give what analyze computed before."""
    import random

    import torch

    from graftrl.core import complementarity
    from graftrl.reporting.weights import WeightRule

    rng = random.Random(0)
    scores = [0.0, 0.8, 0.8000001, 1.0, 2.5] + [rng.uniform(0, 3) for _ in range(500)]
    for delta in (0.0, 0.7, 0.8, 0.9):
        weights = WeightRule("graft", delta=delta).weights(scores)
        assert weights == [min(s, 1.0) if s > delta else 0.0 for s in scores]
    for _ in range(200):
        k_receiver = [rng.choice([0, 0, 1, 2, 4]) for _ in range(rng.randint(1, 12))]
        k_peer = [rng.choice([0, 1, 3]) for _ in k_receiver]
        fails = [g for g, k in enumerate(k_receiver) if k == 0]
        value = float(complementarity(torch.tensor(k_receiver, dtype=torch.float), torch.tensor(k_peer)))
        if fails:
            assert value == pytest.approx(sum(k_peer[g] >= 1 for g in fails) / len(fails), abs=1e-7)
        else:  # undefined: the former code skipped the step
            assert value != value


def test_gate_by_outcome_splits_transferred_responses_into_correct_and_wrong():
    records = [
        {
            "step": 0,
            "receiver": "gpt2",
            "source": ["llama"] * 4,
            "s": [0.9, 0.7, 0.85, 0.95],
            "reward": [1, 1, 0, 0],
        },
        {"step": 1, "receiver": "gpt2", "source": ["llama"] * 2, "s": [0.8, 0.6], "reward": [1.0, 0.0]},
        {"step": 1, "receiver": "llama", "source": ["gpt2"], "s": [1.2], "reward": [1.0]},
    ]
    gates = gate_by_outcome(records, delta=0.8)
    # gpt2's correct scores 0.9, 0.7, 0.8: only 0.9 passes (s > delta is strict); wrong 0.85, 0.95, 0.6
    # (no logged weights: the gate is what admitted them)
    assert gates["gpt2"]["correct"] == GateOutcome(responses=3, passed=1, median_s=0.8, admitted=1)
    assert gates["gpt2"]["wrong"] == GateOutcome(responses=3, passed=2, median_s=0.85, admitted=2)
    assert gates["gpt2"]["correct"].passed_share == pytest.approx(1 / 3)
    assert gates["llama"]["wrong"] == GateOutcome(responses=0, passed=0, median_s=None, admitted=0)
    assert gates["llama"]["wrong"].passed_share is None
    table = gate_markdown({"graft": gates}).splitlines()
    assert table[2] == "| graft | gpt2 | 3 | 33.3 | 33.3 | 0.800 | 3 | 66.7 | 66.7 | 0.850 |"
    assert table[3] == "| graft | llama | 1 | 100.0 | 100.0 | 1.200 | 0 | — | — | — |"
    # logged weights win: random admission let in 0.7 and kept 0.9 out, whatever s > delta says
    admitted = [{**records[0], "w": [0.0, 0.7, 0.0, 0.95]}]
    logged = gate_by_outcome(admitted, delta=0.8)["gpt2"]
    assert (logged["correct"].passed, logged["correct"].admitted) == (1, 1)  # 0.7 in, 0.9 out
    assert (logged["wrong"].passed, logged["wrong"].admitted) == (2, 1)
    # an old log of random admission: its admissions are unknown, not the gate's
    unknown = gate_by_outcome(records, 0.8, WeightRule("graft", admission="random"))
    assert unknown["gpt2"]["correct"].admitted is None and "| — |" in gate_markdown({"r": unknown})


def test_advantage_mass_sums_weighted_source_advantages_per_moved_group():
    # two moved groups of n = 4 into gpt2 (3 of 4 correct, then 1 of 4), one into llama (all wrong:
    # zero variance, so advantages 0); unbiased std as eq. 1's default
    records = [
        {
            "step": 0,
            "receiver": "gpt2",
            "source": ["llama"] * 8,
            "s": [0.9, 0.85, 0.5, 0.95, 1.2, 0.9, 0.7, 0.81],
            "reward": [1, 1, 1, 0, 1, 0, 0, 0],
        },
        {"step": 3, "receiver": "llama", "source": ["gpt2"] * 4, "s": [0.9] * 4, "reward": [0] * 4},
    ]
    a_hi, a_lo = 0.25 / 0.5, -0.75 / 0.5  # 3-of-4 group: mean 0.75, unbiased std 0.5
    correct = 0.9 * a_hi + 0.85 * a_hi + 0.0 + 1.0 * -a_lo  # s 0.5 is gated out; s 1.2 capped at 1
    wrong = 0.95 * a_lo + (0.9 * -a_hi + 0.0 + 0.81 * -a_hi)  # 1-of-4 mirrors 3-of-4; s 0.7 gated out
    masses = advantage_mass(records, n=4, rule=WeightRule("graft", delta=0.8), eps=0.0)
    assert masses["gpt2"].groups == 2
    assert masses["gpt2"].correct == pytest.approx(correct / 2)
    assert masses["gpt2"].wrong == pytest.approx(wrong / 2)
    assert masses["llama"] == AdvantageMass(groups=1, correct=0.0, wrong=0.0)
    # without the gate every group's advantages sum to 0: no net push on what the responses share
    ungated = advantage_mass(records, n=4, rule=WeightRule("graft", gate=False))
    assert ungated["gpt2"].correct > 0 and ungated["gpt2"].net == pytest.approx(0.0, abs=1e-6)
    # a row that is not whole groups (success-only transfer) cannot be rebuilt
    assert advantage_mass([{**records[1], "s": [0.9] * 3, "reward": [1] * 3}], n=4) is None
    # unless it records what was trained: then any row counts as logged, per (prompt, source) group
    logged = {**records[1], "source": ["gpt2"] * 3, "s": [0.9] * 3, "reward": [1, 1, 0], "w": [0.9, 0.0, 1.0]}
    logged |= {"advantage": [0.5, 0.5, -1.0], "prompt_id": ["p", "p", "q"]}
    mass = advantage_mass([logged], n=4)["llama"]
    assert (mass.groups, mass.correct, mass.wrong) == (2, pytest.approx(0.45 / 2), pytest.approx(-1.0 / 2))
    table = advantage_markdown({"graft": masses}).splitlines()
    assert table[2] == (
        f"| graft | gpt2 | 2 | {correct / 2:+.2f} | {wrong / 2:+.2f} | {(correct + wrong) / 2:+.2f} |"
    )


def test_family_progress_averages_the_first_and_last_steps_over_seeds():
    def run(rewards):  # one model, reward on family "carry" at steps 0..len-1
        return [{"step": t, "model": "gpt2", "family_reward/carry": r} for t, r in enumerate(rewards)]

    curves = {"graft seed 0": run([0.0, 0.1, 0.5, 0.9]), "graft seed 1": run([0.2, 0.3, 0.7, None])}
    progress = family_progress(curves, window=2)
    # first two steps: 0.0, 0.1, 0.2, 0.3; last two (steps 2-3; seed 1 has no value at 3): 0.5, 0.9, 0.7
    assert progress["graft"]["gpt2 · carry"] == (pytest.approx(0.15), pytest.approx(0.7))
    assert progress_markdown(progress, 2).splitlines()[2] == "| graft | 15.0 → 70.0 |"


@pytest.mark.parametrize(
    ("graft", "rule"),
    [({"gate": False}, "w = 1 (no gate)"), ({"admission": "random"}, "cannot be recomputed")],
)
def test_analysis_reads_the_applied_weights_of_any_rule(tiny_checkpoints, tmp_path, graft, rule):
    """compatibility.jsonl carries w and admitted; analyze counts what entered the loss, and a log
    written before it did is recomputed with the run's rule (or left blank), with a note."""
    config = make_config(tiny_checkpoints, "graft", steps=2)
    config["graft"] = graft
    run = tmp_path / "run"
    Trainer(config_from_dict(config), run, verifier=ScriptedRewards(CROSSED)).train()
    metrics = {(r["step"], r["model"]): r for r in read_metrics(run)}
    logged = [json.loads(line) for line in (run / "compatibility.jsonl").read_text().splitlines()]
    for record in logged:
        assert record["admitted"] == [w > 0 for w in record["w"]]
        assert sum(record["admitted"]) == metrics[(record["step"], record["receiver"])]["peer_admitted"]
        if graft.get("gate") is False:
            assert record["w"] == [1.0] * len(record["s"])
    result = analyze_run(run)
    assert result.weights_logged and not any("no applied weights" in note for note in result.notes)
    for ex in result.exchange:
        steps = [metrics[(step, ex.receiver)] for step in ex.steps]
        assert ex.admitted == [row.get("peer_admitted", 0) for row in steps]
        assert ex.w == [w for r in logged if r["receiver"] == ex.receiver for w in r["w"]]
    text = write_analysis(result, tmp_path / "new").report.read_text()
    assert "the applied weight w from compatibility.jsonl; admitted: w > 0" in text

    # the same log as written before graftrl recorded w: recomputed (or unknown), with a note
    old = [{k: v for k, v in r.items() if k not in ("w", "admitted")} for r in logged]
    (run / "compatibility.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    legacy = analyze_run(run)
    assert not legacy.weights_logged and any(rule in note for note in legacy.notes)
    for ex, now in zip(legacy.exchange, result.exchange, strict=True):
        assert ex.admitted == now.admitted  # no gate: all; random: the receiver's logged count
        assert ex.w == (now.w if graft.get("gate") is False else None)
    assert "no applied weights w" in write_analysis(legacy, tmp_path / "old").report.read_text()


def markdown_table(report: str, heading: str) -> list[dict[str, str]]:
    """The first table under ``heading`` in a Markdown report, read back: one dict per row."""
    lines = report.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    header, _, *body = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end])
    return [dict(zip(header, row, strict=True)) for row in body]


def test_the_served_peers_table_says_which_columns_are_percentages(tmp_path):
    """Issue 57: a run that missed 59 of the 79 prompts it asked a served peer read `missing 74.684`,
    a percentage under a header that reads as a count. Read back: the count under "missing", the
    percentage under a header that says so, and the served share in percent."""
    asked, missed = [27, 26, 26], [20, 20, 19]
    rows = [
        {
            "step": s,
            "model": "solo",
            "reward_mean": 0.1,
            "all_fail_frac": 0.5,
            "all_pass_frac": 0.0,
            "response_length": 10.0,
            "time_step": 1.0,
            "selected/gpt2": 2.0,
            "transferred/gpt2": 8.0,
            **{f"served_{key}/gpt2": 0.0 for key in ("retries", "prompt_tokens", "completion_tokens")},
            "served_prompts/gpt2": float(asked[s]),
            "served_missing/gpt2": float(missed[s]),
            "served_requests/gpt2": float(asked[s]),
            "served_latency_s/gpt2": 1.5,
        }
        for s in range(3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("policies:\n  - {name: solo, path: x}\n")
    report = write_analysis(analyze_run(tmp_path), tmp_path / "analysis").report.read_text()
    (served,) = markdown_table(report, "## Served peers")
    assert served["prompts asked"] == "79" and served["missing"] == "59"
    assert served["missing (% of asked)"] == "74.684" and served["served share (%)"] == "100.000"
