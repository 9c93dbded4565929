"""The CUDA tier (`pytest -m cuda`): graftrl's scale paths on a GPU, at ~0.5B scale in bf16.

- bf16 GRPO and GRAFT steps of two random-init ~0.5B models of different architectures and
  tokenizers (a Qwen2 with Qwen2.5-0.5B's shape and a locally trained 32k byte-level BPE, a Llama
  with a character tokenizer); the GRAFT run takes its settings from configs/pair1-graft-4gpu.yaml
  (gradient checkpointing, chunked log-probs, token-sized micro-batches);
- chunked log-probs and gradient checkpointing against the plain path (values and gradients
  within bf16 tolerance; on CUDA the allocator's peak falls);
- FSDP2 on one rank: ``fully_shard`` with bf16 mixed precision against autocast, sampling on the
  gathered weights, the sharded (DCP) checkpoint round trip;
- the memory estimate (``graftrl.models.memory``, ``graftrl estimate-memory``) against
  ``torch.cuda.max_memory_allocated`` of real steps;
- checkpoint save and exact resume (bit-identical weights, logs and store).

``bash scripts/gpu_check.sh`` runs this tier on a GPU machine. Without CUDA the tier skips
itself, unless ``GRAFTRL_CUDA_TIER_ON_CPU=1`` (``bash scripts/gpu_check.sh --dry-run``, in CI):
then every test runs the same code on CPU at tiny size, bf16 autocast included; only the checks
of CUDA allocator figures are left out (the figures file says so). Sizes, models, the figures
file and the environment variables: tests/cuda_tier.py.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import CROSSED, FIXTURES, ScriptedRewards, comparable_metrics, weights_of
from cuda_tier import (
    CUDA,
    DEVICE,
    DTYPE,
    FIGURES,
    GRAD_REL,
    LOGP_ATOL,
    SIZE,
    Figures,
    MixedRewards,
    build_pair,
    deterministic_kernels,
    gradient_errors,
    models_root,
    no_final_checkpoint,
    one_rank_group,
    optimizer_tensors,
    peak_and_grads,
    scale_config,
    step_figures,
    train_step,
    two_policy_config,
)

from graftrl.config import config_from_dict
from graftrl.models.policy import Policy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE is None,
        reason="no CUDA device (GRAFTRL_CUDA_TIER_ON_CPU=1 runs this tier on CPU at tiny size)",
    ),
]


@pytest.fixture(scope="module")
def figures() -> Figures:
    return FIGURES


@pytest.fixture(autouse=True)
def _free_device_memory():
    yield
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, figures) -> dict[str, Path]:
    """The ~0.5B pair (tiny on CPU): ``llama`` (char tokenizer) first, ``qwen`` (BPE) second."""
    paths = build_pair(models_root(tmp_path_factory), (SIZE.llama, SIZE.qwen), SIZE.name)
    figures.record(
        "models",
        **{name: json.loads((path / "bench_model.json").read_text()) for name, path in paths.items()},
    )
    return paths


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory, pair) -> dict[str, Path]:
    """Both architectures at SIZE.small, for the FSDP and resume checks (the main pair when tiny)."""
    if SIZE.small is None:
        return pair
    return build_pair(models_root(tmp_path_factory), (SIZE.small, SIZE.small), f"{SIZE.name}-small")


# ----- bf16 steps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["grpo", "graft"])
def test_bf16_steps_of_two_heterogeneous_models(pair, tmp_path, figures, monkeypatch, method):
    from graftrl.training.trainer import Trainer

    no_final_checkpoint(monkeypatch)
    raw = two_policy_config(pair, "grpo") if method == "grpo" else scale_config(pair)
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=ScriptedRewards(CROSSED))
    before = weights_of(trainer)
    trainer.train()
    rows = comparable_metrics(tmp_path / "run")
    figures.record(f"bf16_{method}", steps=step_figures(tmp_path / "run"), config_train=raw["train"])

    assert [(r["step"], r["model"]) for r in rows] == [(s, m) for s in range(2) for m in ("llama", "qwen")]
    for row in rows:
        assert row["optimizer_steps"] >= 1, row
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0, row
    after = weights_of(trainer)
    for policy in trainer.policies:
        assert policy.device.type == DEVICE
        # bf16 compute under autocast, float32 master weights and AdamW state
        assert policy.compute_dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    assert all(bool(torch.isfinite(v).all()) for v in after.values())
    for name in ("llama", "qwen"):
        changed = [k for k in before if k.startswith(f"{name}.") and not torch.equal(before[k], after[k])]
        assert changed, f"{name}: no weight changed"
    if method == "graft":
        llama = [r for r in rows if r["model"] == "llama"]
        # llama fails prompt 0 where qwen is mixed (CROSSED): it receives qwen's responses,
        # re-tokenized on its character vocabulary, and admits them (qwen's near-uniform
        # log-probs over 151,936 ids are far below llama's, so s > delta)
        assert sum(r["peer_responses"] for r in llama) > 0
        assert sum(r["peer_admitted"] for r in llama) > 0
        assert (tmp_path / "run" / "compatibility.jsonl").exists()


# ----- log-prob paths -----------------------------------------------------------------------------


def test_chunked_logprobs_and_checkpointing_match_the_plain_path(pair, figures):
    policy = Policy.from_pretrained("qwen", str(pair["qwen"]), dtype=DTYPE, device=DEVICE)
    policy.model.train()  # gradient checkpointing acts in training mode only
    vocab = policy.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    widths = SIZE.paths_widths
    prompts = [
        torch.randint(3, vocab, (8 + 3 * i,), generator=generator).tolist() for i in range(len(widths))
    ]
    responses = [torch.randint(3, vocab, (w,), generator=generator).tolist() for w in widths]
    batch = policy.pad(prompts, responses)
    upstream = torch.randn(batch.response_ids.shape, generator=generator).to(DEVICE) * batch.response_mask

    reference, reference_grads, plain_peak = peak_and_grads(policy, batch, upstream)
    mask = batch.response_mask
    results: dict[str, dict[str, Any]] = {"plain": {"peak_mb": plain_peak}}
    for label, chunked, checkpointing in [
        ("chunked", True, False),
        ("checkpointing", False, True),
        ("chunked + checkpointing", True, True),
    ]:
        policy.logprob_chunk_tokens = SIZE.chunk if chunked else None
        if checkpointing:
            policy.enable_gradient_checkpointing()
        else:
            disable = getattr(policy.model, "activation_checkpointing_disable", None)
            (disable or policy.model.gradient_checkpointing_disable)()
        logp, grads, peak = peak_and_grads(policy, batch, upstream)
        assert policy.chunks_logprobs == chunked
        results[label] = {
            "peak_mb": peak,
            "logp_max_abs_diff": float((logp - reference)[mask].abs().max()),
            "grad_rel_err": gradient_errors(grads, reference_grads),
        }
    # no-grad scoring (GRAFT's peer pass) goes through the chunked path too
    with torch.no_grad():
        scored = policy.score([prompts[0]], [responses[0]])[0]
    results["score"] = {"logp_max_abs_diff": float((scored - reference[0, : widths[0]].cpu()).abs().max())}
    figures.record(
        "logprob_paths",
        rows=len(widths),
        response_widths=list(widths),
        chunk=SIZE.chunk,
        vocab=vocab,
        results=results,
        peak_checked=CUDA,
    )

    for label, result in results.items():
        if label == "plain":
            continue
        assert result["logp_max_abs_diff"] <= LOGP_ATOL, (label, result)
        if "grad_rel_err" in result:
            assert result["grad_rel_err"]["whole"] <= GRAD_REL, (label, result)
            assert result["grad_rel_err"]["worst"] <= 2 * GRAD_REL, (label, result)
    if CUDA:  # the point of both features: the allocator's peak falls
        # chunking drops at least half of one float32 [rows, L - chunk, V] logits tensor (~2.5 in fact)
        saving = len(widths) * (max(widths) - SIZE.chunk) * vocab * 4 / 2**20
        assert results["chunked"]["peak_mb"] < plain_peak - saving / 2, results
        assert results["chunked + checkpointing"]["peak_mb"] < results["chunked"]["peak_mb"], results


# ----- FSDP2 on one rank --------------------------------------------------------------------------
def test_fsdp2_on_one_rank_matches_autocast_and_checkpoints_exactly(small_pair, tmp_path, figures):
    """parallel.data's machinery (graftrl.training.parallel, as PolicyWorker drives it) on one rank:
    ``fully_shard`` with bf16 mixed precision trains as bf16 autocast does, samples on the
    gathered weights, and a sharded DCP checkpoint restores weights and AdamW state bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from graftrl.models.rollout import HFRolloutEngine, SamplingParams
    from graftrl.training.parallel import full_state_dict, gathered, is_sharded, shard_model

    path, lr, steps = str(small_pair["qwen"]), 1e-4, 2

    def load(name: str, sharded: bool) -> Policy:
        policy = Policy.from_pretrained(name, path, dtype=DTYPE, device=DEVICE)
        if sharded:  # PolicyWorker under parallel.data > 1: FSDP2's mixed precision replaces autocast
            shard_model(policy.model, policy.compute_dtype)
            policy.compute_dtype = None
        policy.configure_optimizer(lr, (0.9, 0.999), 0.01)
        return policy

    generator = torch.Generator().manual_seed(1)
    with one_rank_group(tmp_path):
        plain, sharded = load("plain", False), load("sharded", True)
        assert is_sharded(sharded.model) and not is_sharded(plain.model)
        vocab = plain.model.config.vocab_size
        prompts = [torch.randint(3, vocab, (5 + 2 * i,), generator=generator).tolist() for i in range(4)]
        responses = [
            torch.randint(3, vocab, (SIZE.new_tokens + i,), generator=generator).tolist() for i in range(4)
        ]
        advantages = [1.0, -1.0, 0.5, -0.5]
        first: dict[str, dict[str, Any]] = {}
        for step in range(steps):
            for label, policy in (("plain", plain), ("sharded", sharded)):
                out = train_step(policy, prompts, responses, advantages)
                if step == 0:
                    first[label] = out
        p, s = first["plain"], first["sharded"]
        grad_rel = gradient_errors(s["grads"], p["grads"])
        full = full_state_dict(sharded.model)
        reference = {k: v.detach().cpu() for k, v in plain.model.state_dict().items()}
        assert set(full) <= set(reference), sorted(set(full) - set(reference))
        weight_diff = max(float((full[k].float() - reference[k].float()).abs().max()) for k in full)

        # Sampling on the gathered weights (each rank's rollout), then training on the shards again.
        engine = HFRolloutEngine(max_batch_size=8)
        with gathered(sharded.model):
            sampled = engine.generate(
                sharded, ["1+1", "12+34"], SamplingParams(n=2, max_new_tokens=SIZE.new_tokens), seed=5
            )
        assert len(sampled.response_ids) == 4
        for ids, logprobs in zip(sampled.response_ids, sampled.behaviour_logprobs, strict=True):
            assert len(ids) == len(logprobs) > 0 and bool(torch.isfinite(logprobs).all())
            assert bool((logprobs <= 0).all())
        train_step(sharded, prompts, responses, advantages)

        # The sharded checkpoint round trip (PolicyWorker.save / _load_sharded).
        model_state, optimizer_state = get_state_dict(sharded.model, sharded.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp_path / "dcp")
        restored = load("restored", True)
        model_state, optimizer_state = get_state_dict(restored.model, restored.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=tmp_path / "dcp")
        set_state_dict(
            restored.model,
            restored.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        saved_weights, restored_weights = full_state_dict(sharded.model), full_state_dict(restored.model)
        saved_moments, restored_moments = optimizer_tensors(sharded), optimizer_tensors(restored)
        with deterministic_kernels():
            after_saved = train_step(sharded, prompts, responses, advantages)
            after_restored = train_step(restored, prompts, responses, advantages)
        continued = full_state_dict(sharded.model), full_state_dict(restored.model)

    figures.record(
        "fsdp2_one_rank",
        logp_max_abs_diff=float((s["logp"] - p["logp"]).abs().max()),
        loss=[p["loss"], s["loss"]],
        grad_norm=[p["grad_norm"], s["grad_norm"]],
        grad_rel_err=grad_rel,
        weight_max_abs_diff_after_steps=weight_diff,
        lr=lr,
        steps=steps,
        restored_exact=all(torch.equal(saved_weights[k], restored_weights[k]) for k in saved_weights),
        continued_max_abs_diff=max(
            float((continued[0][k] - continued[1][k]).abs().max()) for k in continued[0]
        ),
    )
    # bf16 mixed precision (bf16 parameters and residual stream) against autocast (float32
    # residual stream): the same model within bf16 tolerance
    assert float((s["logp"] - p["logp"]).abs().max()) <= 2 * LOGP_ATOL
    assert abs(s["loss"] - p["loss"]) <= 0.02 * abs(p["loss"]) + 1e-3
    assert grad_rel["whole"] <= 2 * GRAD_REL and grad_rel["worst"] <= 4 * GRAD_REL, grad_rel
    # AdamW moves a weight by at most ~lr per step: two paths differ by at most twice that
    assert weight_diff <= 2 * steps * lr * 1.5
    assert saved_weights.keys() == restored_weights.keys() and saved_moments.keys() == restored_moments.keys()
    assert saved_moments, "the optimizer state should hold AdamW moments"
    for key in saved_weights:
        assert torch.equal(saved_weights[key], restored_weights[key]), key
    for key in saved_moments:
        assert torch.equal(saved_moments[key], restored_moments[key]), key
    assert torch.equal(after_saved["logp"], after_restored["logp"])
    for key in continued[0]:
        assert torch.equal(continued[0][key], continued[1][key]), key


# ----- the memory estimate ------------------------------------------------------------------------
@pytest.mark.parametrize("features", [False, True], ids=["plain", "memory-features"])
def test_memory_estimate_bounds_the_allocator_peak(pair, tmp_path, figures, monkeypatch, features):
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from graftrl.cli import app
    from graftrl.models.memory import GIB, estimate_config
    from graftrl.storage.data import load_problems
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    no_final_checkpoint(monkeypatch)
    e = SIZE.estimate
    train: dict[str, Any] = {
        "steps": 2,
        "batch_prompts": e["prompts"],
        "minibatch_prompts": e["prompts"] // 2,
        "micro_batch_size": e["micro_rows"],
    }
    if features:
        train.update(  # four chunks per response
            gradient_checkpointing=True,
            logprob_chunk_tokens=max(1, e["new_tokens"] // 4),
            micro_batch_tokens=e["micro_tokens"],
        )
    data = FIXTURES / "math_small.jsonl"
    raw = {
        "method": "grpo",
        "seed": 0,
        "policies": [
            {
                "name": "qwen",
                "path": str(pair["qwen"]),
                "template": "{problem}=",
                "dtype": DTYPE,
                "device": DEVICE,
            }
        ],
        "data": {"train": str(data), "prompt_suffix": None},
        # one generate call for the whole batch, as the estimate's HF term assumes (eager generate)
        "rollout": {
            "n": e["n"],
            "max_new_tokens": e["new_tokens"],
            "max_batch_size": e["prompts"] * e["n"],
            "compile": False,
        },
        "train": train,
        "optim": {"lr": 1e-5},
        "logging": {"progress": False, "log_samples": 0},
        "checkpoint": {"every": 0},
    }
    config = config_from_dict(raw)
    # What earlier tests left allocated (none, unless a failure's traceback holds its tensors) is
    # not this run's.
    baseline = torch.cuda.memory_allocated() if CUDA else 0
    Trainer(config, tmp_path / "run", verifier=MixedRewards()).train()
    rows = read_metrics(tmp_path / "run")
    # the last step's peak (AdamW's moments exist by then)
    measured = rows[-1]["memory_peak_mb"] * 2**20 - baseline
    tokenizer = AutoTokenizer.from_pretrained(pair["qwen"])
    prompt_tokens = max(
        len(ids) for ids in tokenizer([f"{p.problem}=" for p in load_problems(data)])["input_ids"]
    )
    device_bytes = torch.cuda.get_device_properties(0).total_memory if CUDA else 141 * GIB
    estimates, total = estimate_config(config, device_bytes, prompt_tokens)
    estimate = estimates[0]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    cli = CliRunner().invoke(
        app,
        [
            "estimate-memory",
            str(config_file),
            "--gpu-memory",
            str(device_bytes / GIB),
            "--prompt-tokens",
            str(prompt_tokens),
        ],
    )
    parts = ("model_states", "compute_copy", "activations", "logits", "generation")
    figures.record(
        f"memory_estimate_{'features' if features else 'plain'}",
        train=train,
        prompt_tokens=prompt_tokens,
        estimate_gib={**{k: getattr(estimate, k) / GIB for k in parts}, "peak": total / GIB},
        measured_gib=measured / GIB,
        baseline_gib=baseline / GIB,
        measured_is="torch.cuda.max_memory_allocated of step 2"
        if CUDA
        else "peak RSS of the process (CPU: not comparable)",
        ratio=measured / total if CUDA else None,
        per_step_peak_mb=[r["memory_peak_mb"] for r in rows],
    )

    assert cli.exit_code == 0, cli.output
    assert f"fits: {total / GIB:.1f} of" in cli.output, cli.output  # the CLI prints this same estimate
    assert estimate.activations > 0 and estimate.logits > 0 and total > estimate.resident > 0
    if CUDA:  # the estimate must not promise a fit that the allocator then exceeds, nor be loose
        assert 0.5 <= measured / total <= 1.2, (measured / GIB, total / GIB)


# ----- checkpoints and exact resume ---------------------------------------------------------------
def test_checkpoint_and_exact_resume(small_pair, tmp_path, figures):
    """Three GRAFT steps in one go against two, a checkpoint, and a resumed third: bit-identical
    weights, metrics and trajectory store (checkpoints of weights, AdamW state, RNG-free seeding)."""
    from graftrl.storage.store import TrajectoryStore
    from graftrl.training.trainer import Trainer

    def run(folder: Path, steps: int, resume: bool = False):
        raw = two_policy_config(small_pair, "graft", steps=steps)
        raw["checkpoint"] = {"every": 1, "keep_last": 3}
        raw["store"] = {"record": True}
        trainer = Trainer(config_from_dict(raw), folder, verifier=ScriptedRewards(CROSSED))
        trainer.train(resume=resume)
        return trainer

    with deterministic_kernels():
        reference = run(tmp_path / "reference", 3)
        run(tmp_path / "resumed", 2)
        resumed = run(tmp_path / "resumed", 3, resume=True)
    expected, got = weights_of(reference), weights_of(resumed)
    diffs = {k: float((got[k].float() - v.float()).abs().max()) for k, v in expected.items()}

    def store(folder: Path) -> list[list[dict]]:
        rows = TrajectoryStore(folder / "store")
        return [[r.to_dict() for r in rows.read_step(s)] for s in rows.steps()]

    figures.record(
        "exact_resume",
        start_step=resumed.start_step,
        weight_max_abs_diff=max(diffs.values()),
        tensors_differing=sum(d > 0 for d in diffs.values()),
        checkpoints=sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()),
    )
    assert resumed.start_step == 2
    assert all(torch.equal(got[k], v) for k, v in expected.items()), max(diffs.items(), key=lambda kv: kv[1])
    assert comparable_metrics(tmp_path / "resumed") == comparable_metrics(tmp_path / "reference")
    assert store(tmp_path / "resumed") == store(tmp_path / "reference")
    assert sum(r["peer_admitted"] for r in comparable_metrics(tmp_path / "resumed")) > 0
