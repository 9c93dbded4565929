"""Numerical safety of the loss: masked positions are selected out, optional dual clip and log-ratio
clamp, and non-finite minibatches skip their optimizer step (issue 12, item 7)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL_MIXED, ScriptedRewards, make_config, weights_of

from graftrl.config import config_from_dict
from graftrl.core import clipped_policy_loss, k3_kl, nll_loss
from graftrl.core.compatibility import mean_token_logprob
from graftrl.core.hacpo import gspo_own_terms, hacpo_peer_terms
from graftrl.core.luffy import luffy_policy_loss
from graftrl.errors import TrainingDivergedError
from graftrl.storage.metrics import MetricsLogger
from graftrl.training.trainer import Trainer

B, T = 3, 5
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)


def clean_inputs():
    generator = torch.Generator().manual_seed(0)
    logp = (-torch.rand(B, T, generator=generator, dtype=torch.float64)).requires_grad_(True)
    old = -torch.rand(B, T, generator=generator, dtype=torch.float64)
    return logp, old


def poisoned(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with NaN, +inf and -inf in the padded positions."""
    values = tensor.detach().clone()
    pad = ~MASK
    fill = torch.tensor([math.nan, math.inf, -math.inf], dtype=values.dtype)
    values[pad] = fill[torch.arange(int(pad.sum())) % 3]
    return values.requires_grad_(tensor.requires_grad)


LOSSES = {
    "clipped": lambda logp, old: clipped_policy_loss(
        logp, old, torch.tensor([1.0, -0.5, 2.0]), torch.tensor([1.0, 0.7, 1.0]), MASK
    )[0],
    "clipped-dual-clamp": lambda logp, old: clipped_policy_loss(
        logp,
        old,
        torch.tensor([1.0, -0.5, -2.0]),
        torch.ones(3),
        MASK,
        clip_ratio_c=3.0,
        log_ratio_clamp=5.0,
    )[0],
    "k3": lambda logp, old: k3_kl(logp, old, MASK),
    "k3-weighted": lambda logp, old: k3_kl(logp, old, MASK.double() / MASK.sum(-1, keepdim=True)),
    "nll": lambda logp, old: nll_loss(logp, MASK),
    "luffy": lambda logp, old: luffy_policy_loss(
        logp, old, torch.tensor([1.0, -0.5, 2.0]), torch.ones(3), MASK, torch.tensor([False, True, True])
    )[0],
    "gspo": lambda logp, old: gspo_own_terms(logp, old, torch.tensor([1.0, -0.5, 2.0]), MASK)[0].sum(),
    "hacpo-peer": lambda logp, old: hacpo_peer_terms(
        logp, torch.tensor([-0.5, -0.4, -0.3]), torch.tensor([1.0, -0.5, 2.0]), torch.ones(3), MASK, 0.8
    )[0].sum(),
    "lbar": lambda logp, old: mean_token_logprob(logp, MASK).sum(),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_nonfinite_padding_reaches_neither_loss_nor_gradient(name):
    loss_fn = LOSSES[name]
    logp, old = clean_inputs()
    clean = loss_fn(logp, old)
    (clean_grad,) = torch.autograd.grad(clean, logp)

    bad_logp, bad_old = poisoned(logp), poisoned(old)
    dirty = loss_fn(bad_logp, bad_old)
    (dirty_grad,) = torch.autograd.grad(dirty, bad_logp)
    assert torch.isfinite(dirty) and torch.isfinite(dirty_grad).all()
    assert dirty.item() == clean.item()
    assert torch.equal(dirty_grad, clean_grad)
    assert (dirty_grad[~MASK] == 0).all()


def test_nonfinite_values_in_a_removed_row_are_ignored():
    logp, old = clean_inputs()
    advantages, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(B, T, dtype=torch.bool)
    weights = torch.tensor([1.0, 0.0, 1.0])  # row 1 removed by the gate
    clean, _ = clipped_policy_loss(logp, old, advantages, weights, mask)
    bad_old = old.clone()
    bad_old[1] = math.nan
    dirty, metrics = clipped_policy_loss(logp, bad_old, advantages, weights, mask)
    assert dirty.item() == clean.item() and torch.isfinite(metrics["ratio_mean"])


def test_dual_clip_bounds_negative_advantage_tokens():
    """With a < 0 each token's term is max(min(rho a, clip(rho) a), c a): at most c |a| of loss."""
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 1.0, 2.5, 10.0]]))  # ratios 0.5, 1, 2.5, 10
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([-1.0])
    plain, _ = clipped_policy_loss(logp, old, adv, torch.ones(1), mask)
    dual, _ = clipped_policy_loss(logp, old, adv, torch.ones(1), mask, clip_ratio_c=3.0)
    # terms without dual clip: min(rho a, clip(rho, .8, 1.28) a) = -0.8, -1, -2.5, -10
    assert float(plain) == pytest.approx((0.8 + 1 + 2.5 + 10) / 4)
    assert float(dual) == pytest.approx((0.8 + 1 + 2.5 + 3) / 4)  # the ratio-10 token capped at c = 3
    positive, _ = clipped_policy_loss(logp, old, -adv, torch.ones(1), mask, clip_ratio_c=3.0)
    unclipped, _ = clipped_policy_loss(logp, old, -adv, torch.ones(1), mask)
    assert float(positive) == float(unclipped)  # positive advantages are untouched


def test_log_ratio_clamp_caps_the_ratio():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.0, 50.0]])  # exp(50) would dominate any sum
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = clipped_policy_loss(logp, old, adv, torch.ones(1), mask, log_ratio_clamp=2.0)
    assert float(loss) == pytest.approx((1.0 + math.exp(2.0)) / 2)
    assert float(metrics["ratio_mean"]) == pytest.approx((1.0 + math.exp(2.0)) / 2)


def test_config_documents_and_validates_the_new_fields():
    config = config_from_dict(
        {"policies": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], "data": {"train": "x.jsonl"}}
    )
    assert config.train.clip_ratio_c is None and config.train.log_ratio_clamp is None
    assert config.train.max_nonfinite_steps == 3
    described = type(config.train).model_fields["clip_ratio_c"].description or ""
    assert "3.0" in described and "verl" in described


class _Wrapped:
    """A method whose loss is replaced; everything else is the real method's. It reads the row
    origins (the minibatch index)."""

    reads_row_origins = True

    def __init__(self, method, loss):
        self._method, self.loss = method, loss

    def __getattr__(self, name):
        return getattr(self._method, name)


def _poisoned_trainer(tiny_checkpoints, tmp_path, bad_minibatches: set[int] | None, **train):
    """A GRPO trainer whose loss is NaN on the given minibatches of every step (None: all)."""
    config = config_from_dict(make_config(tiny_checkpoints, "grpo", **train))
    trainer = Trainer(config, tmp_path / "run", verifier=ScriptedRewards(ALL_MIXED))
    for worker in trainer.workers:

        def loss(batch, method_loss=worker.method.loss):
            value, metrics = method_loss(batch)
            if bad_minibatches is None or batch.origins.minibatch_index in bad_minibatches:
                value = value * math.nan
            return value, metrics

        worker.method = _Wrapped(worker.method, loss)
    trainer.logger = MetricsLogger(trainer.run_dir)
    return trainer


def test_a_nonfinite_minibatch_skips_its_optimizer_step(tiny_checkpoints, tmp_path):
    trainer = _poisoned_trainer(tiny_checkpoints, tmp_path, bad_minibatches={0})
    before = weights_of(trainer)
    metrics = trainer.step(0)
    trainer.logger.close()
    for name, row in metrics.items():
        assert row["nonfinite_skips"] == 1, name
        assert row["optimizer_steps"] == 1  # two minibatches, the poisoned one skipped
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    after = weights_of(trainer)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the clean minibatch trained
    trainer.close()


def test_consecutive_nonfinite_steps_stop_the_run(tiny_checkpoints, tmp_path):
    trainer = _poisoned_trainer(tiny_checkpoints, tmp_path, bad_minibatches=None, max_nonfinite_steps=2)
    before = weights_of(trainer)
    with pytest.raises(TrainingDivergedError, match=r"max_nonfinite_steps"):
        trainer.step(0)
    trainer.logger.close()
    after = weights_of(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing non-finite was applied
    trainer.close()
