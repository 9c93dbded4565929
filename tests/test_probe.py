"""`graftrl probe`: the first training steps' regime without an update, on two (or three) tiny
models of different real architectures and tokenizers (Qwen2 + byte-level BPE, Llama + Unigram, GPT-2 + BPE).

Its figures equal a recount from the samples it wrote; its step 0 is the first training step
(the numbers Trainer.step logs, the same compatibility.jsonl rows); bad input ends in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CROSSED, FIXTURES, ScriptedRewards, TextRewards, make_config
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict
from graftrl.experiments.probe import run_probe
from graftrl.methods import ExchangePlan, TrainGroup
from graftrl.reporting.probe_stats import recount
from graftrl.storage.rundir import ProbeDir, read_jsonl, read_metrics
from graftrl.training.trainer import Trainer

UPDATE_ONLY = (
    "time_",
    "memory_",
    "loss",
    "clip_frac",
    "grad_norm",
    "optimizer_steps",
    "nonfinite_skips",
    "own_s_mean",
    "peer_s_mean",
    "train_rows",
    "train_tokens",
    "method",
)
"""Metrics of a training step that only the update produces (or measures), and the method's name."""


def pair_config(paths: dict[str, Path], method: str = "graft", **train) -> dict:
    policies = [
        {"name": "qwen2", "path": str(paths["qwen"]), "template": "Q: {problem}\nA: "},
        {"name": "llama", "path": str(paths["llama"]), "template": "{problem}="},
    ]
    if "gpt2" in paths:
        policies.append({"name": "gpt2", "path": str(paths["gpt2"]), "template": "{problem} = "})
    return {
        "method": method,
        "seed": 3,
        "policies": policies,
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "train": {"steps": 1, "batch_prompts": 4, "minibatch_prompts": 2, "micro_batch_size": 5, **train},
        "logging": {"progress": False},
    }


def test_every_figure_is_recounted_from_the_written_samples(qwen2_llama_pair, tiny_checkpoints, tmp_path):
    """Three models (K > 2: six ordered pairs), 10 prompts in batches of 4 (the last one cut)."""
    paths = {**qwen2_llama_pair, "gpt2": tiny_checkpoints["gpt2"]}
    out = tmp_path / "probe"
    result = run_probe(config_from_dict(pair_config(paths)), out, 10, verifier=TextRewards(), progress=False)
    written = json.loads((out / "probe.json").read_text())
    assert written == result.figures
    assert written["steps"] == 3 and written["probe"]["prompts"] == 10
    assert {m: v["prompts"] for m, v in written["models"].items()} == {"qwen2": 10, "llama": 10, "gpt2": 10}
    assert len(written["pairs"]) == 6
    # The samples hold a real regime: candidates scored in both directions of some pair, moved groups.
    assert sum(p["scored"]["responses"] for p in written["pairs"]) > 0
    assert sum(p["moved"]["groups"] for p in written["pairs"]) > 0
    assert len(read_jsonl(out / "samples.jsonl")) == 3 * 10 * 4

    assert recount(out) == written
    assert_rows_are_the_samples(out)

    # The recount reads the samples: one flipped reward changes the figures.
    samples = read_jsonl(out / "samples.jsonl")
    samples[0]["reward"] = 1.0 - samples[0]["reward"]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    assert recount(out)["models"] != written["models"]

    report = (out / "probe.md").read_text()
    assert "qwen2 -> llama" in report and "## Cost" in report
    assert [p.name for p in result.plots] == sorted(
        f"s_{p}.png" for p in _directions(written) if _scored(written, p)
    )
    assert all(p.exists() for p in result.plots)


def assert_rows_are_the_samples(folder: Path) -> None:
    """Each scored candidate response is the source's sampled response it names (reward,
    advantage), on a prompt where the receiver failed all n; "selected" is the method's plan."""
    files = ProbeDir(folder)
    sampled = {(r["step"], r["model"], r["prompt_id"], r["index"]): r for r in read_jsonl(files.samples)}
    moved = {(g["step"], g["receiver"], g["source"], g["prompt_id"]) for g in read_jsonl(files.moved_groups)}
    rows = read_jsonl(files.candidates)
    assert rows
    # exactly the candidate groups of eq. 4 (the receiver fails all n, the source is mixed), whole
    wins: dict[tuple, float] = {}
    for (step, model, prompt, _), r in sampled.items():
        wins[(step, model, prompt)] = wins.get((step, model, prompt), 0.0) + r["reward"]
    policies = {r["model"] for r in read_jsonl(files.steps)}
    expected = {
        (step, receiver, source, prompt)
        for (step, receiver, prompt), k in wins.items()
        if receiver in policies and k == 0
        for (other_step, source, other_prompt), k_source in wins.items()
        if (other_step, other_prompt) == (step, prompt) and source != receiver and 0 < k_source < 4
    }
    groups: dict[tuple, list[int]] = {}
    for row in rows:
        groups.setdefault((row["step"], row["receiver"], row["source"], row["prompt_id"]), []).append(
            row["index"]
        )
    assert set(groups) == expected and all(sorted(v) == [0, 1, 2, 3] for v in groups.values())
    for row in rows:
        source = sampled[(row["step"], row["source"], row["prompt_id"], row["index"])]
        assert row["reward"] == source["reward"]
        assert row["advantage"] == pytest.approx(source["advantage"], abs=1e-5)
        own = [sampled[(row["step"], row["receiver"], row["prompt_id"], i)]["reward"] for i in range(4)]
        assert own == [0.0] * 4
        assert row["selected"] == ((row["step"], row["receiver"], row["source"], row["prompt_id"]) in moved)


def _directions(figures: dict) -> list[str]:
    return [f"{p['source']}_to_{p['receiver']}" for p in figures["pairs"]]


def _scored(figures: dict, direction: str) -> bool:
    return any(
        f"{p['source']}_to_{p['receiver']}" == direction and p["scored"]["responses"]
        for p in figures["pairs"]
    )


@pytest.mark.parametrize("method", ["graft", "grpo"])
def test_probe_step_zero_is_the_first_training_step(qwen2_llama_pair, tmp_path, method):
    """Same prompts, seeds and code: the probe's step 0 logs what Trainer.step(0) logs, less the
    update's figures, and the same compatibility.jsonl rows; its pooled figures add up its steps."""
    raw = pair_config(qwen2_llama_pair, method, batch_prompts=6)
    raw["graft"] = {"balance": False}  # every candidate moves: more groups scored and contrasted
    run_probe(config_from_dict(raw), tmp_path / "probe", 12, verifier=TextRewards(), progress=False)
    Trainer(config_from_dict(raw), tmp_path / "run", verifier=TextRewards()).train()

    trained = {row["model"]: row for row in read_metrics(tmp_path / "run")}
    steps = read_jsonl(tmp_path / "probe" / "steps.jsonl")
    probed = {row["model"]: row for row in steps if row["step"] == 0}
    for model, row in trained.items():
        expected = {k: v for k, v in row.items() if not k.startswith(UPDATE_ONLY)}
        peer = "llama" if model == "qwen2" else "qwen2"
        exchange = {f"candidates/{peer}", "peer_responses", "peer_admitted", "s_mean", "contrast_groups"}
        assert {"all_fail_frac", f"complementarity/{peer}"} | (
            exchange if method == "graft" else set()
        ) <= set(expected)
        assert expected.items() <= probed[model].items(), model
    figures = json.loads((tmp_path / "probe" / "probe.json").read_text())
    pairs = {(p["source"], p["receiver"]): p for p in figures["pairs"]}
    if method == "graft":
        assert (tmp_path / "probe" / "compatibility.jsonl").read_text().splitlines()[:2] == (
            tmp_path / "run" / "compatibility.jsonl"
        ).read_text().splitlines()
        for (source, receiver), pair in pairs.items():  # GRAFT's own diagnostics, summed over steps
            logged = [r for r in steps if r["model"] == receiver]
            assert pair["candidates"] == sum(r[f"candidates/{source}"] for r in logged)
            assert pair["selected"] == sum(r[f"selected/{source}"] for r in logged)
        assert any(p["moved"]["groups"] for p in pairs.values())
    else:  # no exchange: regime and complementarity still, nothing moved
        assert not any(p["moved"]["groups"] for p in pairs.values())
        assert not (tmp_path / "probe" / "compatibility.jsonl").read_text()
    for (source, receiver), pair in pairs.items():  # the trainer's complementarity, pooled over steps
        logged = [r for r in steps if r["model"] == receiver]
        failed = [round(r["all_fail_frac"] * r["prompts"]) for r in logged]
        solved = sum(
            round(r[f"complementarity/{source}"] * f) for r, f in zip(logged, failed, strict=True) if f
        )
        assert pair["receiver_all_fail"] == sum(failed) and pair["solved_by_source"] == solved
    assert recount(tmp_path / "probe") == figures


def write_config(folder: Path, raw: dict) -> Path:
    path = folder / "pair.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("edit", "args", "names"),
    [
        (None, ["--prompts", "0"], "--prompts 0: data.train"),
        (None, ["--prompts", "13"], "holds 12 prompts"),
        (lambda raw, folder: raw["train"].update(bogus=1), [], "train.bogus: unknown key"),
        (lambda raw, folder: raw["data"].update(train=str(folder / "none.jsonl")), [], "none.jsonl"),
        (None, ["--out", "{folder}/pair.yaml"], "is a file, not a folder"),
        (None, ["--out", "{folder}/pair.yaml/sub"], "cannot write there"),
        (
            lambda raw, folder: (folder / "run").mkdir() or (folder / "run" / "metrics.jsonl").write_text(""),
            ["--out", "{folder}/run"],
            "holds a training run",
        ),
        (None, ["--set", "graft.delta=2"], "graft.delta"),
    ],
)
def test_bad_input_is_one_line_before_any_model_loads(qwen2_llama_pair, tmp_path, edit, args, names):
    raw = pair_config(qwen2_llama_pair)
    raw["policies"][0]["path"] = str(tmp_path / "no-model")  # loading a model would fail differently
    if edit is not None:
        edit(raw, tmp_path)
    config = write_config(tmp_path, raw)
    argv = ["probe", str(config), "--prompts", "4", "--out", str(tmp_path / "out")]
    argv += [a.format(folder=tmp_path) for a in args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], result.output
    assert not (tmp_path / "out" / "probe.json").exists()


def test_the_command_writes_the_folder(qwen2_llama_pair, tmp_path, monkeypatch):
    """The CLI end to end with the real verifier (the random models solve nothing: all-fail)."""
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, pair_config(qwen2_llama_pair))
    result = CliRunner().invoke(app, ["probe", str(config), "--prompts", "5", "--seed", "7"])
    assert result.exit_code == 0, result.output
    folder = ProbeDir(tmp_path / "runs" / "probe" / "pair")
    figures = json.loads(folder.json.read_text())
    assert figures["probe"]["seed"] == 7 and figures["steps"] == 2
    assert "# Probe of" in result.output and "runs/probe/pair/probe.json" in result.output
    assert recount(folder.root) == figures


@pytest.mark.slow  # a local Ray start: 15-50 s on 2 shared cores
@pytest.mark.usefixtures("ray_ships_test_helpers")
def test_the_ray_backend_probes_alike(qwen2_llama_pair, tmp_path):
    """backend: ray (one actor per policy, run concurrently) writes the local backend's samples,
    scores and figures; only the timings differ."""
    import ray

    raw = pair_config(qwen2_llama_pair)
    figures = {}
    for backend in ("local", "ray"):
        config = config_from_dict({**raw, "backend": backend, "ray": {"num_cpus": 2}})
        figures[backend] = run_probe(
            config, tmp_path / backend, 8, verifier=TextRewards(), progress=False
        ).figures
    for name in ("samples", "candidates", "compatibility", "moved_groups"):
        local, distributed = (getattr(ProbeDir(tmp_path / b), name).read_text() for b in ("local", "ray"))
        assert local == distributed, name
    assert figures["ray"]["models"] == figures["local"]["models"]
    assert figures["ray"]["pairs"] == figures["local"]["pairs"]
    assert recount(tmp_path / "ray") == figures["ray"]
    assert not ray.is_initialized(), "the probe shuts down the Ray it started"


def test_the_candidates_graft_moves_are_scored_once_and_alike(qwen2_llama_pair, tmp_path, monkeypatch):
    """Under GRAFT the candidate groups its plan moves as they stand are scored once (by the
    method's pass) and taken from there: the same rows as scoring every candidate group again."""
    import graftrl.experiments.probe_steps as probe_module

    raw = pair_config(qwen2_llama_pair, batch_prompts=6)
    run_probe(config_from_dict(raw), tmp_path / "once", 12, verifier=TextRewards(), progress=False)
    monkeypatch.setattr(probe_module, "reusable_groups", lambda plan, outcomes: set())
    run_probe(config_from_dict(raw), tmp_path / "twice", 12, verifier=TextRewards(), progress=False)
    once, twice = (read_jsonl(ProbeDir(tmp_path / name).candidates) for name in ("once", "twice"))
    assert any(row["selected"] for row in once) and any(not row["selected"] for row in once)
    assert_rows_are_the_samples(tmp_path / "once")
    assert len(once) == len(twice)
    for a, b in zip(once, twice, strict=True):
        assert {k: v for k, v in a.items() if k not in ("s", "w")} == {
            k: v for k, v in b.items() if k not in ("s", "w")
        }
        assert a["s"] == pytest.approx(b["s"], abs=1e-4) and a["w"] == pytest.approx(b["w"], abs=1e-4)
    steps = read_jsonl(ProbeDir(tmp_path / "once").steps)
    again = read_jsonl(ProbeDir(tmp_path / "twice").steps)
    assert sum(r["scored_tokens"] for r in steps) < sum(r["scored_tokens"] for r in again)


def test_scores_follow_the_plan_order_the_probe_merges_by(tiny_checkpoints, tmp_path):
    """The order contract of ``rows.CompatibilityScores`` that ``merged_scores`` reads: entry k
    is the k-th scored peer response of the plan, its non-NLL peer groups in plan order (not in
    prompt order), each group's kept responses by index. The probe composes the trainer's own
    pieces of a step: ``exchange``, ``score_peers``, ``metrics_row``."""
    trainer = Trainer(
        config_from_dict(make_config(tiny_checkpoints)), tmp_path / "run", verifier=ScriptedRewards(CROSSED)
    )
    try:
        planned = trainer.exchange(0, trainer.sampler.batch(0))
        ids = [problem.id for problem in planned.problems]
        advantages = planned.outcomes["llama"].advantages
        keep = torch.tensor([True, False, True, True])
        groups = [
            TrainGroup(prompt=3, source="llama", peer=True, advantages=advantages[3]),
            TrainGroup(prompt=0, source="llama", peer=True, advantages=advantages[0], nll=True),
            TrainGroup(prompt=1, source="llama", peer=True, advantages=advantages[1], keep=keep),
            TrainGroup(prompt=2, source="gpt2", peer=False, advantages=advantages[2]),
        ]
        plans = {"gpt2": ExchangePlan(groups=groups), "llama": ExchangePlan()}
        scores = trainer.score_peers(0, planned, plans)["gpt2"].compatibility
        assert scores is not None
        assert scores.prompt_id == [ids[3]] * 4 + [ids[1]] * 3
        rewards = planned.outcomes["llama"].rewards
        assert scores.reward == [float(r) for r in rewards[3]] + [float(rewards[1][i]) for i in (0, 2, 3)]
        row = trainer.metrics_row("gpt2", planned, {})
        assert "reward_mean" in row and row == trainer.metrics_row("gpt2", planned, {})
    finally:
        trainer.close()
