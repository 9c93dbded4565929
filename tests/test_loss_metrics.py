"""What a loss measures reaches metrics.jsonl: sums and counts, added over micro-batches exactly,
declared by each method in the log schema (issue 23), as its plan's diagnostics are."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CROSSED, ScriptedRewards, make_config

from graftrl.config import config_from_dict
from graftrl.core import grpo_advantages
from graftrl.methods import (
    METHODS,
    ClippedSurrogate,
    GroupOutcomes,
    LossInputs,
    RowOrigins,
    TrainSettings,
    build_method,
)
from graftrl.methods.loss_metrics import CLIP_OWN, KL, LossMetric
from graftrl.storage.log_keys import LogKey, undeclared_keys
from graftrl.storage.rundir import read_metrics
from graftrl.training.log_schema import loss_metric_keys, metric_keys, plan_metric_keys
from graftrl.training.trainer import Trainer
from graftrl.training.update import LossTotals

B, T = 6, 5


def random_batch(seed: int, **fields) -> LossInputs:
    """Six rows (three own, two peer, one NLL), right-padded, with a reference policy."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 4, 5, 2, 4])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)  # [B, T]
    old = -torch.rand(B, T, generator=g) - 0.5
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-0.01)
    batch = LossInputs(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor([1.0, -0.5, 0.0, 0.8, -1.2, 0.0]),
        weights=torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.0]),
        mask=mask,
        is_peer=torch.tensor([False, False, False, True, True, True]),
        normalizer=float(lengths[:5].sum()),
        is_nll=torch.tensor([False, False, False, False, False, True]),
        nll_normalizer=4.0,
        minibatch_tokens=float(lengths.sum()),
        ref_logp=old - 0.1 * torch.rand(B, T, generator=g),
        origins=RowOrigins(
            receiver="a",
            sources=("a", "a", "a", "b", "b", "b"),
            source_mean_logp=-torch.rand(B, generator=g) - 0.5,
            finished=torch.tensor([True, False, True, True, False, True]),
            minibatch_index=0,
            minibatch_rows=5,
        ),
    )
    return dataclasses.replace(batch, **fields)


def rows(batch: LossInputs, index: list[int]) -> LossInputs:
    """The micro-batch of rows ``index`` (the minibatch's denominators kept)."""
    per_row = ("logp", "old_logp", "advantages", "weights", "mask", "is_peer", "is_nll", "ref_logp")
    cut = {name: getattr(batch, name)[index] for name in per_row if getattr(batch, name) is not None}
    origins = batch.origins
    assert origins is not None
    origins = dataclasses.replace(
        origins,
        sources=tuple(origins.sources[i] for i in index),
        source_mean_logp=origins.source_mean_logp[index],
        finished=origins.finished[index],
    )
    return dataclasses.replace(batch, origins=origins, **cut)


@pytest.mark.parametrize("method", ["grpo", "graft", "sgt", "hacpo", "luffy", "pooling"])
def test_micro_batches_add_up_to_the_minibatch(method):
    """A minibatch cut into micro-batches gives the same loss (their sum) and the same sums."""
    loss_of = build_method(method, train=TrainSettings(kl_coef=0.01)).loss
    batch = random_batch(0)
    if method == "hacpo":  # HACPO plans no NLL rows
        batch = dataclasses.replace(batch, is_nll=None, weights=torch.ones(B))
    whole_loss, whole = loss_of(batch)
    parts = [loss_of(rows(batch, index)) for index in ([0, 3, 5], [1, 2, 4])]
    assert float(sum(loss for loss, _ in parts)) == pytest.approx(float(whole_loss), rel=1e-5)
    for key, value in whole.items():
        added = sum(float(sums.get(key, 0.0)) for _, sums in parts)
        assert added == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
    declared = {name for metric in type(build_method(method)).loss_metrics for name in metric.sums()}
    assert set(whole) <= declared, "a loss returns only the sums its loss_metrics name"
    expected = {"kl_sum", "kl_tokens"} | ({"nll_sum", "nll_tokens"} if method == "sgt" else set())
    assert expected <= set(whole)


class Probe(ClippedSurrogate):
    loss_metrics = (
        CLIP_OWN,
        KL,
        LossMetric("odd", "odd_sum", "odd_count", "a probe", "count", empty=-1.0),
    )


def test_totals_divide_sums_and_refuse_undeclared_keys():
    totals = LossTotals(Probe())
    first, second = totals.minibatch(), totals.minibatch()
    totals.accumulate(first, {"own_clipped_tokens": torch.tensor(2.0), "odd_sum": torch.tensor(3.0)})
    totals.accumulate(first, {"own_clipped_tokens": torch.tensor(1.0), "odd_count": torch.tensor(0.0)})
    totals.accumulate(second, {"own_clipped_tokens": torch.tensor(1.0)})
    totals.add(*first)
    totals.add(*second)
    totals.count("trained_own_tokens", 10)
    # clipped 4 of 10 own tokens; KL never measured: left out; the probe's count is 0: `empty`
    assert totals.values() == {"clip_frac_own": 0.4, "odd": -1.0}
    with pytest.raises(ValueError, match=r"returned 'surprise', which none of its loss_metrics names"):
        totals.accumulate(totals.minibatch(), {"surprise": torch.tensor(1.0)})
    nothing = LossTotals(Probe())
    # no loss call at all: a count-divided metric is still logged (CLIP_OWN's empty 0), the others not
    assert nothing.values() == {"clip_frac_own": 0.0}
    with pytest.raises(ValueError, match="the worker's count"):
        LossMetric("bad", "trained_own_tokens", "x", "m", "u")


def test_every_method_declares_its_keys_in_the_log_schema(monkeypatch):
    keys = {key.name: key for key in metric_keys()}
    for name, method in METHODS.items():
        for metric in method.loss_metrics:
            assert keys[metric.key].meaning == metric.meaning, (name, metric.key)
    groups = {key.name: key.group for key in loss_metric_keys()}
    assert groups["clip_frac_own"] == "loss: every method" and groups["nll"] == "loss: sgt"
    assert groups["peer_lower_bound"] == "loss: hacpo"

    class Clash(ClippedSurrogate):
        loss_metrics = (LossMetric("kl", "kl_sum", "kl_tokens", "another meaning", "nats"),)

    monkeypatch.setitem(METHODS, "clash", Clash)
    with pytest.raises(ValueError, match="'kl' is declared twice, differently"):
        loss_metric_keys()


@pytest.mark.parametrize("name", ["grpo", "graft", "sgt", "hacpo", "luffy", "pooling"])
def test_each_method_declares_the_diagnostics_its_plan_logs(name):
    """A plan's diagnostics are the keys its method declares (``plan_keys``), not another's."""
    rewards = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]], [[1.0, 1.0, 0.0, 0.0], [0.0] * 4]])
    outcomes = {model: GroupOutcomes(r, grpo_advantages(r)) for model, r in zip("ab", rewards, strict=True)}
    method = build_method(name)
    own = [LogKey(key.name, key.meaning, key.unit, name) for key in type(method).plan_keys]
    logged = [plan.diagnostics for plan in method.plan(outcomes, torch.Generator()).values()]
    assert undeclared_keys(logged, own) == []
    assert bool(own) == any(logged), "a method declares keys its plan does not log, or the reverse"
    groups = {key.name: key.group for key in plan_metric_keys()}
    assert groups["candidates/<source>"] == "plan: graft, luffy" and groups["omega/<source>"] == "plan: hacpo"


def graft_rows(tiny_checkpoints, tmp_path, name: str, **train) -> list[dict]:
    config = make_config(tiny_checkpoints, "graft", **train)
    config["graft"] = {"delta": 0.0}  # no floor: every transferred response trains
    Trainer(config_from_dict(config), tmp_path / name, verifier=ScriptedRewards(CROSSED)).train()
    return read_metrics(tmp_path / name)


def test_graft_logs_own_and_peer_ratios_whatever_the_micro_batches(tiny_checkpoints, tmp_path):
    """The sequence ratios of own and peer rows reach metrics.jsonl, with the KL under a KL term,
    and do not depend on the micro-batch size (sums and counts, not means of means). One
    optimizer step per step (the whole batch), so both runs measure the same weights."""
    sizes = {"steps": 1, "minibatch_prompts": 4, "kl_coef": 0.01}
    small = graft_rows(tiny_checkpoints, tmp_path, "small", micro_batch_size=1, **sizes)
    large = graft_rows(tiny_checkpoints, tmp_path, "large", micro_batch_size=64, **sizes)
    measured = ("own_s_mean", "peer_s_mean", "kl", "clip_frac_own", "clip_frac_peer", "loss")
    for a, b in zip(small, large, strict=True):
        assert 0.5 < a["own_s_mean"] < 2 and 0.5 < a["peer_s_mean"] < 2 and a["kl"] >= 0
        for key in measured:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    plain = graft_rows(tiny_checkpoints, tmp_path, "plain", steps=1)
    assert all("kl" not in row and "own_s_mean" in row for row in plain)  # no KL term: not measured
