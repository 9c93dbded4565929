"""A method is one module: a brand-new method, defined in this test module, is registered with its
own config section, validated, lays out its own minibatches and trains end to end on the tiny
checkpoints, with no change to graftrl.config, the worker or the trainer.

The method is "GRPO with a different clip": GRPO's plan, the clipped surrogate with the clip range
of its own ``grpo_wide:`` section (fixed when it is built), one prompt per optimizer step, last
prompt first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch
import yaml
from conftest import CROSSED, ScriptedRewards, make_config, weights_of
from pydantic import Field

from graftrl.config import ConfigError, config_from_dict, config_reference, dump_config
from graftrl.core import clipped_policy_loss
from graftrl.methods import (
    METHODS,
    ConfigSection,
    ExchangePlan,
    LossInputs,
    TrainSettings,
    build_method,
    register_method,
)
from graftrl.methods.grpo import GRPO
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer


class WideClipConfig(ConfigSection):
    """GRPO with its own clip range (the plug-in method of tests/test_method_plugin.py)."""

    eps_low: float = Field(default=0.1, ge=0, lt=1)
    """Lower clip range of the token ratio."""
    eps_high: float = Field(default=0.5, ge=0)
    """Upper clip range of the token ratio."""


class WideClipGRPO(GRPO):
    """GRPO whose surrogate clips at its own (eps_low, eps_high); one prompt per optimizer step,
    last prompt first."""

    section = WideClipConfig
    options: WideClipConfig
    reads_row_origins = True  # only for the test's spy: the minibatch index and the receiver
    orders: ClassVar[list[tuple[ExchangePlan, list[list[int]]]]] = []
    """Every (plan, order) it laid out, for the test to compare with what the loss saw."""

    def __init__(self, options: WideClipConfig | None = None, /, **fields: Any) -> None:
        super().__init__(options, **fields)
        # its own clip range replaces the train section's, once, when it is built
        self.train = dataclasses.replace(
            self.train, eps_low=self.options.eps_low, eps_high=self.options.eps_high
        )

    @classmethod
    def check(cls, config: Any) -> None:
        super().check(config)
        if config.rollout.n < 4:
            raise ValueError(
                f"rollout.n: method {cls.name!r} needs groups of at least 4, got {config.rollout.n}"
            )

    def order_minibatches(
        self, plan: ExchangePlan, prompts_per_minibatch: int, generator: torch.Generator
    ) -> list[torch.Tensor]:
        order = [torch.tensor([i]) for i in reversed(range(len(plan.groups)))]
        self.orders.append((plan, [o.tolist() for o in order]))
        return order


@pytest.fixture
def grpo_wide():
    """Registered for one test only, so other tests see the built-in methods alone."""
    register_method("grpo_wide")(WideClipGRPO)
    WideClipGRPO.orders.clear()
    yield WideClipGRPO
    del METHODS["grpo_wide"]


def test_its_section_is_part_of_every_config_and_validated(grpo_wide, tiny_checkpoints):
    raw = make_config(tiny_checkpoints, method="grpo_wide")
    config = config_from_dict({**raw, "grpo_wide": {"eps_high": 0.7}})
    assert (config.grpo_wide.eps_low, config.grpo_wide.eps_high) == (0.1, 0.7)
    method = build_method("grpo_wide", config)
    assert isinstance(method, WideClipGRPO) and (method.options.eps_low, method.options.eps_high) == (
        0.1,
        0.7,
    )
    assert (method.train.eps_low, method.train.eps_high) == (0.1, 0.7)
    assert method.train == dataclasses.replace(TrainSettings.of(config.train), eps_low=0.1, eps_high=0.7)
    assert yaml.safe_load(dump_config(config))["grpo_wide"] == {"eps_low": 0.1, "eps_high": 0.7}
    rows = {key: (default, text) for key, default, text in config_reference()}
    assert rows["grpo_wide.eps_low"] == ("0.1", "Lower clip range of the token ratio.")
    assert rows["grpo_wide"][1].startswith("GRPO with its own clip range")

    with pytest.raises(ConfigError, match=r"grpo_wide\.eps_low: Input should be less than 1"):
        config_from_dict({**raw, "grpo_wide": {"eps_low": 1.5}})
    with pytest.raises(ConfigError, match=r"grpo_wide\.clip: unknown key"):
        config_from_dict({**raw, "grpo_wide": {"clip": 0.3}})
    with pytest.raises(ConfigError, match=r"rollout\.n: method 'grpo_wide' needs groups of at least 4"):
        config_from_dict({**raw, "rollout": {**raw["rollout"], "n": 2}})
    # the generic rules still hold for it (no stored peers: it does not declare them)
    with pytest.raises(
        ConfigError, match="peers: stored peers are used by method 'graft' or 'hint', not 'grpo_wide'"
    ):
        config_from_dict({**raw, "peers": [{"name": "old", "path": "store"}]})


def test_its_loss_uses_its_own_clip(grpo_wide):
    logp = torch.tensor([[-0.2, -0.2]], requires_grad=True)
    old = torch.tensor([[-0.7, -0.7]])  # ratio e^0.5 = 1.65: clipped at 1.5 here, at 1.28 by default
    batch = LossInputs(
        logp=logp,
        old_logp=old,
        advantages=torch.ones(1),
        weights=torch.ones(1),
        mask=torch.ones(1, 2, dtype=torch.bool),
        is_peer=torch.zeros(1, dtype=torch.bool),
        normalizer=2,
    )
    loss, _ = WideClipGRPO().loss(batch)
    expected, _ = clipped_policy_loss(
        logp, old, batch.advantages, batch.weights, batch.mask, 0.1, 0.5, normalizer=2
    )
    assert float(loss.detach()) == pytest.approx(float(expected.detach())) == pytest.approx(-1.5)


def test_it_trains_end_to_end_in_its_own_minibatch_order(grpo_wide, tiny_checkpoints, tmp_path, monkeypatch):
    seen: list[tuple[str, int, list[float]]] = []
    original = WideClipGRPO.loss

    def spy(self, batch):
        seen.append(
            (batch.origins.receiver, batch.origins.minibatch_index, sorted(batch.advantages.tolist()))
        )
        return original(self, batch)

    monkeypatch.setattr(WideClipGRPO, "loss", spy)
    trainer = Trainer(
        config_from_dict(make_config(tiny_checkpoints, method="grpo_wide")),
        tmp_path / "run",
        verifier=ScriptedRewards(CROSSED),
    )
    assert isinstance(trainer.method, WideClipGRPO)
    before = weights_of(trainer)
    trainer.train()
    after = weights_of(trainer)
    for name in ("llama", "gpt2"):
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(name + ".")), name

    rows = read_metrics(tmp_path / "run")
    assert [(r["step"], r["model"], r["method"]) for r in rows] == [
        (s, m, "grpo_wide") for s in (0, 1) for m in ("llama", "gpt2")
    ]
    # one optimizer step per prompt (4), where the default order would take 2 (minibatch_prompts 2)
    assert all(r["optimizer_steps"] == 4 for r in rows)

    # 2 steps x 2 policies laid out, one update after another: the loss calls split into one run
    # per update. Minibatch m holds the nonzero-advantage responses of group order[m].
    updates: list[list[tuple[str, int, list[float]]]] = []
    for entry in seen:
        if not updates or updates[-1][0][0] != entry[0]:
            updates.append([])
        updates[-1].append(entry)
    assert len(WideClipGRPO.orders) == len(updates) == 4
    checked = 0
    for row, (plan, order), calls in zip(rows, WideClipGRPO.orders, updates, strict=True):
        assert order == [[3], [2], [1], [0]]  # last prompt first, one per step
        assert {g.source for g in plan.groups} == {row["model"]} == {calls[0][0]}
        for m, [group] in enumerate(order):
            advantages = sorted(a for a in plan.groups[group].advantages.tolist() if a != 0)
            at_m = [adv for _, index, adv in calls if index == m]
            assert at_m == ([advantages] if advantages else []), (row["model"], m)  # no signal: no pass
            checked += bool(advantages)
    assert checked == 4 * 3  # CROSSED: each policy has one all-equal group per step
