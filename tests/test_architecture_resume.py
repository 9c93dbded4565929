"""Checkpoints round-trip on every architecture transformers loads (issue 46).

transformers 5 renames and regroups weights between a checkpoint on disk and the model in memory
(GPT-NeoX's ``embed_out`` is ``lm_head``; a mixture of experts stores one tensor per expert and
stacks them in memory). A resume reads the checkpoint back through transformers' own loading, so
2 steps + ``--resume`` to 4 equal 4 straight steps, bit for bit, on each architecture of
``tests/architectures.py``: the default tier resumes ``DEFAULT_TIER``, the slow tier all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from architectures import ARCHITECTURES, DEFAULT_TIER, MIXED, build_architecture, one_policy_config
from conftest import FIXTURES, ScriptedRewards, comparable_metrics, weights_of

from graftrl.config import config_from_dict
from graftrl.training.trainer import Trainer


def optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    policy = trainer.policies[0]
    return {
        f"{index}.{key}": value
        for index, state in policy.optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }


def assert_resume_is_exact(model: Path, runs: Path) -> None:
    """4 straight steps == 2 steps, then a resumed process to 4: weights, AdamW state, metrics."""
    full = Trainer(
        config_from_dict(one_policy_config(model, 4)), runs / "full", verifier=ScriptedRewards(MIXED)
    )
    full.train()
    cut = runs / "cut"
    first = Trainer(config_from_dict(one_policy_config(model, 2)), cut, verifier=ScriptedRewards(MIXED))
    first.train()
    halfway = weights_of(first)
    first.close()
    resumed = Trainer(config_from_dict(one_policy_config(model, 4)), cut, verifier=ScriptedRewards(MIXED))
    resumed.train(resume=True)
    assert resumed.start_step == 2
    for expected, got in (
        (weights_of(full), weights_of(resumed)),
        (optimizer_state(full), optimizer_state(resumed)),
    ):
        assert expected.keys() == got.keys()
        assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    # the steps after the resume trained (so their equality says something)
    assert any(not torch.equal(v, halfway[k]) for k, v in weights_of(full).items())
    assert comparable_metrics(runs / "full") == comparable_metrics(cut)
    for trainer in (full, resumed):
        trainer.close()


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(name, marks=() if name in DEFAULT_TIER else pytest.mark.slow) for name in ARCHITECTURES],
)
def test_resume_is_exact_on_every_architecture(model_type, tmp_path):
    model = build_architecture(model_type, tmp_path / model_type)
    assert_resume_is_exact(model, tmp_path / "runs")


def test_a_compare_cell_continues_exactly_on_gpt_neox(tmp_path):
    """compare continues an interrupted cell from its last checkpoint by the same loading: the
    continued cell's rows are the uninterrupted cell's."""
    import io
    import shutil

    from conftest import TextRewards, task_of
    from rich.console import Console

    from graftrl.embedded.base import DemoSettings
    from graftrl.experiments.cells import run_cell
    from graftrl.experiments.matrix import Variant
    from graftrl.reporting.provenance import results_provenance
    from graftrl.storage.data import load_problems

    model = build_architecture("gpt_neox", tmp_path / "gpt_neox")
    base = one_policy_config(model, 2)
    del base["method"], base["seed"]
    settings = DemoSettings(steps=2, batch_prompts=2, minibatch_prompts=1, n=2, n_eval=2, eval_samples=2)
    problems = load_problems(FIXTURES / "math_small.jsonl")[:2]
    task = task_of(base, problems, settings, results_provenance({"policy": model}))
    variant, output = Variant("grpo", "grpo"), io.StringIO()

    def cell(out: Path) -> tuple[dict, bool]:
        return run_cell(task, variant, 0, None, out, lambda reward: TextRewards(), Console(file=output))

    control, _ = cell(tmp_path / "control")
    shutil.copytree(tmp_path / "control", tmp_path / "cut")
    run = tmp_path / "cut" / "runs" / "grpo-seed0"
    (run / "done.json").unlink()  # killed after step 1's checkpoint: no marker, no step 2
    shutil.rmtree(run / "checkpoints" / "step_000002")
    continued, ran = cell(tmp_path / "cut")
    assert ran and "grpo seed 0: continuing from its last checkpoint" in output.getvalue()

    def measured_apart(done: dict) -> list[dict]:
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in done["rows"]]

    assert measured_apart(continued) == measured_apart(control)


def test_checkpoints_keep_the_tokenizer_as_it_was_loaded(tmp_path):
    """A tokenizer without a pad token is padded with its eos in memory; a checkpoint does not
    write that pad token into its tokenizer files (each load lends it again, so the resume and a
    checkpoint loaded by path pad as the run did)."""
    from transformers import AutoTokenizer

    from graftrl.models.policy import Policy

    model = build_architecture("gpt_neox", tmp_path / "no-pad", pad_token=False)
    assert_resume_is_exact(model, tmp_path / "runs")
    checkpoint = tmp_path / "runs" / "cut" / "checkpoints" / "step_000004" / "policy"
    AutoTokenizer.from_pretrained(model).save_pretrained(tmp_path / "resaved")  # transformers' own re-save
    for name in ("tokenizer_config.json", "tokenizer.json"):
        assert (checkpoint / name).read_text() == (tmp_path / "resaved" / name).read_text(), name
    assert AutoTokenizer.from_pretrained(checkpoint).pad_token is None
    loaded = Policy.from_pretrained("policy", str(checkpoint), device="cpu").tokenizer
    assert loaded.pad_token_id == loaded.eos_token_id


def test_a_checkpoint_whose_weights_do_not_fit_is_refused_in_one_line(tmp_path):
    """A weight missing from an intact (re-sealed) checkpoint: refused naming the checkpoint and
    the model's weight, not loaded with transformers' random init in its place."""
    from safetensors.torch import load_file, save_file

    from graftrl.errors import ModelError
    from graftrl.storage.checkpoint import write_manifest

    model = build_architecture("gpt_neox", tmp_path / "gpt_neox")
    run = tmp_path / "run"
    Trainer(config_from_dict(one_policy_config(model, 1)), run, verifier=ScriptedRewards(MIXED)).train()
    checkpoint = run / "checkpoints" / "step_000001"
    weights = load_file(checkpoint / "policy" / "model.safetensors")
    del weights["embed_out.weight"]
    save_file(weights, checkpoint / "policy" / "model.safetensors", metadata={"format": "pt"})
    write_manifest(checkpoint, 1)
    resumed = Trainer(config_from_dict(one_policy_config(model, 2)), run, verifier=ScriptedRewards(MIXED))
    with pytest.raises(
        ModelError, match=r"step_000001/policy: its weights do not fit .*\(missing lm_head\.weight\)"
    ):
        resumed.train(resume=True)


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(name, marks=() if name in DEFAULT_TIER else pytest.mark.slow) for name in ARCHITECTURES],
)
def test_the_vllm_engine_gets_the_weights_save_pretrained_writes(model_type, tmp_path):
    """vLLM loads checkpoint names: a weight sync sends each tensor under the name and in the
    grouping ``save_pretrained`` writes (not the names in memory, which vLLM refuses for a mixture
    of experts: no ``mlp.experts.gate_up_proj`` in its Mixtral). Needs no vLLM."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from graftrl.models.vllm_weights import checkpoint_names, unique_tensors

    model = AutoModelForCausalLM.from_pretrained(build_architecture(model_type, tmp_path / "model"))
    with torch.no_grad():  # distinct values, so a tensor under another's name cannot pass
        for index, parameter in enumerate(model.parameters()):
            parameter.add_(index)
    model.save_pretrained(tmp_path / "saved")
    on_disk = load_file(tmp_path / "saved" / "model.safetensors")
    sent = dict(checkpoint_names(model, unique_tensors(model)))
    assert sorted(sent) == sorted(on_disk)
    assert [name for name, value in on_disk.items() if not torch.equal(sent[name], value)] == []
