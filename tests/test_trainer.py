"""The trainer (Algorithm 1) on two tiny heterogeneous checkpoints loaded by path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    ALL_MIXED,
    CROSSED,
    FIXTURES,
    ScriptedRewards,
    comparable_metrics,
    make_config,
    weights_of,
)

from graftrl.config import config_from_dict
from graftrl.core import compatibility_weight
from graftrl.models.policy import Policy
from graftrl.models.rollout import content_mean_logprob
from graftrl.storage.metrics import MetricsLogger
from graftrl.storage.rundir import read_metrics
from graftrl.training import worker as worker_module
from graftrl.training.rows import build_rows
from graftrl.training.trainer import Trainer


def test_graft_step_grafts_the_selected_groups(tiny_checkpoints, tmp_path):
    config = config_from_dict(make_config(tiny_checkpoints, steps=1))
    trainer = Trainer(config, tmp_path / "run", verifier=ScriptedRewards(CROSSED))
    trainer.train()
    rows = {row["model"]: row for row in read_metrics(tmp_path / "run")}
    # gpt2 receives llama's group on prompt 1, llama receives gpt2's on prompt 0.
    assert rows["gpt2"]["candidates/llama"] == 1 and rows["gpt2"]["selected/llama"] == 1
    assert rows["llama"]["candidates/gpt2"] == 1 and rows["llama"]["selected/gpt2"] == 1
    assert rows["llama"]["peer_responses"] == 4 and rows["gpt2"]["peer_responses"] == 4
    assert rows["llama"]["complementarity/gpt2"] == 1.0
    compat = [
        json.loads(line) for line in (tmp_path / "run" / "compatibility.jsonl").read_text().splitlines()
    ]
    assert {c["receiver"] for c in compat} == {"llama", "gpt2"}
    for c in compat:
        weights = compatibility_weight(torch.tensor(c["s"]), 0.8)
        row = rows[c["receiver"]]
        assert row["peer_admitted"] == int((weights > 0).sum())
        assert row["w_mean"] == pytest.approx(float(weights.mean()), abs=1e-4)


def test_training_rows_retokenize_and_rescore_on_the_receiver(tiny_checkpoints, tmp_path, monkeypatch):
    """algorithm.md §2.2: grafted rows are the receiver's tokenization, its old log-probs, the source advantage."""
    config = config_from_dict(make_config(tiny_checkpoints))
    trainer = Trainer(config, tmp_path / "run", verifier=ScriptedRewards(CROSSED))
    captured = {}

    def spy(step, rollout, plan, records, *, policy, **rest):
        batch = build_rows(step, rollout, plan, records, policy=policy, **rest)
        captured[policy.name] = (batch.rows, rollout, records, plan)
        return batch

    monkeypatch.setattr(worker_module, "build_rows", spy)
    trainer.logger = MetricsLogger(tmp_path / "run")
    trainer.step(0)
    # gpt2 receives llama's group on prompt 1; gpt2 is updated after llama, so when it scored the
    # grafted rows its weights were still the ones on disk.
    fresh = Policy.from_pretrained("gpt2", str(tiny_checkpoints["gpt2"]), template="Q: {problem}\nA: ")
    rows, rollout, records, plan = captured["gpt2"]
    n = 4
    peer_rows = [row for row in rows if row.peer]
    assert len(peer_rows) == n
    assert [plan.groups[row.group].prompt for row in peer_rows] == [1] * n
    for i, row in enumerate(peer_rows):
        record = records["llama"][1 * n + i]
        expected_ids = fresh.encode_response(record.response, record.finished)
        assert row.response_ids == expected_ids
        assert row.prompt_ids == rollout.prompt_ids[1]
        assert row.advantage == pytest.approx(record.advantage)
        expected_old = fresh.score([rollout.prompt_ids[1]], [expected_ids])[0]
        assert torch.allclose(row.old_logprobs, expected_old, atol=1e-6)
        s = torch.exp(torch.tensor(content_mean_logprob(expected_old, record.finished) - record.mean_logprob))
        assert row.weight == pytest.approx(float(compatibility_weight(s, 0.8)), abs=1e-5)
    own_rows = [row for row in rows if not row.peer]
    assert len(own_rows) == 3 * n
    for row in own_rows:
        prompt = plan.groups[row.group].prompt
        assert prompt != 1
        assert row.response_ids in rollout.response_ids[prompt * n : (prompt + 1) * n]
        assert row.weight == 1.0


def test_graft_without_transfer_is_grpo(tiny_checkpoints, tmp_path):
    """With every group mixed there are no candidates, and GRAFT must train exactly like GRPO."""
    results = {}
    for method in ("grpo", "graft"):
        config = config_from_dict(make_config(tiny_checkpoints, method=method))
        trainer = Trainer(config, tmp_path / method, verifier=ScriptedRewards(ALL_MIXED))
        trainer.train()
        results[method] = weights_of(trainer)
    for key, value in results["grpo"].items():
        assert torch.equal(value, results["graft"][key]), key
    start = {
        f"{n}.{k}": v
        for n in ("llama", "gpt2")
        for k, v in Policy.from_pretrained(n, str(tiny_checkpoints[n])).model.state_dict().items()
    }
    assert any(not torch.equal(start[k], v) for k, v in results["graft"].items()), (
        "the update changed nothing"
    )


def test_resume_is_exact(tiny_checkpoints, tmp_path):
    full = Trainer(
        config_from_dict(make_config(tiny_checkpoints, steps=3)),
        tmp_path / "full",
        verifier=ScriptedRewards(CROSSED),
    )
    full.train()

    cut = make_config(tiny_checkpoints, steps=3)
    cut["checkpoint"] = {"every": 1, "keep_last": 5}
    first = Trainer(
        config_from_dict({**cut, "train": {**cut["train"], "steps": 2}}),
        tmp_path / "cut",
        verifier=ScriptedRewards(CROSSED),
    )
    first.train()
    resumed = Trainer(config_from_dict(cut), tmp_path / "cut", verifier=ScriptedRewards(CROSSED))
    resumed.train(resume=True)
    assert resumed.start_step == 2
    full_weights, resumed_weights = weights_of(full), weights_of(resumed)
    for key, value in full_weights.items():
        assert torch.equal(value, resumed_weights[key]), key

    assert comparable_metrics(tmp_path / "full") == comparable_metrics(tmp_path / "cut")


NO_SIGNAL = [[[0, 0, 0, 0]] * 4] * 2
"""Every response of both policies fails: no advantage, no backward, on that step."""


def optimizer_states(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        f"{policy.name}.{index}.{key}": value
        for policy in trainer.policies
        for index, state in policy.optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }


@pytest.mark.parametrize(
    ("pattern", "first_steps", "why"),
    [
        ([*ALL_MIXED, *NO_SIGNAL, *ALL_MIXED], 1, "a step without a gradient right after the resume"),
        ([*ALL_MIXED, *ALL_MIXED, *NO_SIGNAL], 2, "a finished run extended by a step without a gradient"),
    ],
)
def test_resume_is_exact_across_steps_without_a_gradient(
    tiny_checkpoints, tmp_path, pattern, first_steps, why
):
    """AdamW steps a zero gradient (weight decay, moments) but skips a parameter without one: the
    resumed process must hold gradients exactly where the interrupted one did (issue 26)."""
    config = make_config(tiny_checkpoints, method="grpo", steps=3)
    config["checkpoint"] = {"every": 1, "keep_last": 5}
    full = Trainer(config_from_dict(config), tmp_path / "full", verifier=ScriptedRewards(pattern))
    full.train()
    cut = {**config, "train": {**config["train"], "steps": first_steps}}
    Trainer(config_from_dict(cut), tmp_path / "cut", verifier=ScriptedRewards(pattern)).train()
    verifier = ScriptedRewards(pattern)
    verifier.calls = 2 * first_steps  # the scripted rewards continue where the first process stopped
    resumed = Trainer(config_from_dict(config), tmp_path / "cut", verifier=verifier)
    resumed.train(resume=True)
    assert resumed.start_step == first_steps
    for expected, got in (
        (weights_of(full), weights_of(resumed)),
        (optimizer_states(full), optimizer_states(resumed)),
    ):
        assert expected.keys() == got.keys()
        assert [k for k in expected if not torch.equal(expected[k], got[k])] == [], why
    assert comparable_metrics(tmp_path / "full") == comparable_metrics(tmp_path / "cut"), why


def test_a_checkpoint_from_before_update_state_resumes_exactly(tiny_checkpoints, tmp_path):
    """Checkpoints written before update_state.json existed: AdamW's state says which parameters
    had a gradient."""
    from graftrl.storage.checkpoint import write_manifest
    from graftrl.training.policy_state import UPDATE_STATE

    pattern = [*ALL_MIXED, *NO_SIGNAL, *ALL_MIXED]
    config = make_config(tiny_checkpoints, method="grpo", steps=3)
    config["checkpoint"] = {"every": 1, "keep_last": 5}
    full = Trainer(config_from_dict(config), tmp_path / "full", verifier=ScriptedRewards(pattern))
    full.train()
    cut = {**config, "train": {**config["train"], "steps": 1}}
    Trainer(config_from_dict(cut), tmp_path / "cut", verifier=ScriptedRewards(pattern)).train()
    checkpoint = tmp_path / "cut" / "checkpoints" / "step_000001"
    for name in ("llama", "gpt2"):
        (checkpoint / name / UPDATE_STATE).unlink()
    write_manifest(checkpoint, 1)
    verifier = ScriptedRewards(pattern)
    verifier.calls = 2
    resumed = Trainer(config_from_dict(config), tmp_path / "cut", verifier=verifier)
    resumed.train(resume=True)
    expected, got = weights_of(full), weights_of(resumed)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


def test_checkpoint_loads_back_by_path(tiny_checkpoints, tmp_path):
    trainer = Trainer(
        config_from_dict(make_config(tiny_checkpoints, steps=1)),
        tmp_path / "run",
        verifier=ScriptedRewards(CROSSED),
    )
    trainer.train()
    checkpoint = trainer.checkpoints.latest()
    assert checkpoint is not None and checkpoint.name == "step_000001"
    reloaded = Policy.from_pretrained("llama", str(checkpoint / "llama"))
    for key, value in trainer.policies[0].model.state_dict().items():
        assert torch.equal(value, reloaded.model.state_dict()[key]), key


def test_kl_trains_own_rows_with_zero_advantage_and_rows_carry_the_lbar_contract(tiny_checkpoints, tmp_path):
    """With train.kl_coef > 0 an all-correct group still enters the loss (its KL has a gradient);
    a method that reads row origins gets each row's sampling policy's lbar and EOS flag, and the
    minibatch's rows; one that does not gets none."""
    uniform = [[[1, 1, 1, 1]] * 4, [[0, 0, 0, 0]] * 4]
    config = config_from_dict(make_config(tiny_checkpoints, method="grpo", steps=1, kl_coef=1e-3))
    trainer = Trainer(config, tmp_path / "run", verifier=ScriptedRewards(uniform))
    batches, plain = [], []
    method = trainer.method

    class Spy:  # wrap the method rather than patch it
        reads_row_origins = True

        def __getattr__(self, item):
            return getattr(method, item)

        def loss(self, batch):
            batches.append(batch)
            return method.loss(batch)

    class PlainSpy(Spy):
        reads_row_origins = False

        def loss(self, batch):
            plain.append(batch)
            return method.loss(batch)

    trainer.workers[0].method, trainer.workers[1].method = Spy(), PlainSpy()
    trainer.train()
    assert {b.origins.receiver for b in batches} == {"llama"} and plain
    assert all(bool((b.advantages == 0).all()) for b in batches + plain)
    assert sum(len(b.advantages) for b in batches + plain) == 2 * 4 * 4  # every own row, both models
    for b in batches:
        assert b.origins.minibatch_rows == 2 * 4  # 2 prompts x n = 4 per minibatch
        assert b.origins.source_mean_logp.shape == b.advantages.shape == b.origins.finished.shape
    assert all(b.origins is None for b in plain)


def test_truncated_importance_sampling_on_the_hf_engine(tiny_checkpoints, tmp_path):
    """HF samples from the trainer's own weights: the TIS weights are 1 up to float noise."""
    config = make_config(tiny_checkpoints, steps=1)
    config["rollout"]["tis_cap"] = 2.0
    trainer = Trainer(config_from_dict(config), tmp_path / "run", verifier=ScriptedRewards(CROSSED))
    trainer.train()
    for row in read_metrics(tmp_path / "run"):
        assert row["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["tis_truncated_frac"] == 0.0
        assert row["time_old_logprob"] > 0
        assert row["memory_peak_mb"] > 0


def test_tis_is_refused_for_methods_with_their_own_ratio(tiny_checkpoints):
    config = make_config(tiny_checkpoints, method="hacpo")
    config["rollout"]["tis_cap"] = 2.0
    with pytest.raises(ValueError, match=r"rollout\.tis_cap"):
        config_from_dict(config)


def test_per_family_reward_on_the_shared_batch(tiny_checkpoints, tmp_path):
    import dataclasses

    from graftrl.storage.data import load_problems

    problems = [
        dataclasses.replace(p, family="even" if i % 2 == 0 else "odd")
        for i, p in enumerate(load_problems(FIXTURES / "math_small.jsonl"))
    ]
    config = config_from_dict(make_config(tiny_checkpoints, steps=1))
    trainer = Trainer(config, tmp_path / "run", problems=problems, verifier=ScriptedRewards(CROSSED))
    batch = trainer.sampler.batch(0)
    trainer.train()
    rows = {row["model"]: row for row in read_metrics(tmp_path / "run")}
    for model, pattern in zip(("llama", "gpt2"), CROSSED, strict=True):
        for family in ("even", "odd"):
            groups = [pattern[i] for i, p in enumerate(batch) if p.family == family]
            if not groups:
                assert f"family_reward/{family}" not in rows[model]
                continue
            expected = sum(map(sum, groups)) / (4 * len(groups))
            assert rows[model][f"family_reward/{family}"] == pytest.approx(expected)
            all_fail = sum(sum(g) == 0 for g in groups) / len(groups)
            assert rows[model][f"family_all_fail/{family}"] == pytest.approx(all_fail)


def test_problems_handed_over_in_code_are_what_a_resume_checks(tiny_checkpoints, tmp_path):
    """A trainer given its problems in code (benchmarks, a user's own loop) does not read
    ``data.train``, which need not exist; a resume compares the problems' content instead."""
    import dataclasses

    from graftrl.config import ConfigError
    from graftrl.storage.data import load_problems

    problems = load_problems(FIXTURES / "math_small.jsonl")
    raw = make_config(tiny_checkpoints, steps=2)
    raw["data"]["train"] = str(tmp_path / "absent.jsonl")
    raw["checkpoint"] = {"every": 1}
    config = config_from_dict(raw)
    Trainer(config, tmp_path / "run", problems=problems, verifier=ScriptedRewards(CROSSED)).train()
    assert (tmp_path / "run" / "checkpoints").is_dir()
    changed = [dataclasses.replace(problems[0], answer="0"), *problems[1:]]
    with pytest.raises(ConfigError, match=r"data\.train"):
        Trainer(config, tmp_path / "run", problems=changed, verifier=ScriptedRewards(CROSSED)).train(
            resume=True
        )
