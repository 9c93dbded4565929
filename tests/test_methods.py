"""The method family: SGT, LUFFY-style peer updates, naive pooling and GRAFT's ablation switches.

Unit tests check each method's and switch's math against numbers derived by hand from docs/algorithm.md
(sections 2.4 and 3) and the paper's Appendix G; end-to-end tests run two real steps of each on
the tiny checkpoints with scripted rewards and check the method-specific counts in the metrics.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CROSSED, ScriptedRewards, make_config, weights_of

from graftrl.config import ConfigError, config_from_dict
from graftrl.core import clipped_policy_loss, compatibility_weight, grpo_advantages
from graftrl.core.ablations import (
    random_admission_weight,
    random_prompt_selection,
    sequence_log_ratio,
    sequence_ratio_logp,
)
from graftrl.core.luffy import luffy_policy_loss, luffy_shaping
from graftrl.core.pooling import pooled_advantages
from graftrl.core.sgt import pick_one_success, sgt_eligible
from graftrl.methods import (
    METHODS,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    TrainGroup,
    TrainSettings,
    build_method,
    own_groups,
)
from graftrl.methods.graft import GRAFT
from graftrl.methods.luffy import LUFFY
from graftrl.methods.pooling import Pooling
from graftrl.methods.sgt import SGT
from graftrl.storage.rundir import read_metrics
from graftrl.training import worker as worker_module
from graftrl.training.trainer import Trainer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run far faster on one thread, and do not fight other processes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def outcomes_of(rewards: list[list[float]]) -> GroupOutcomes:
    r = torch.tensor(rewards, dtype=torch.float32)
    return GroupOutcomes(r, grpo_advantages(r))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Four prompts, n = 4. A fails prompts 0 and 2; B fails prompts 1 and 3.
# SGT's rule (k_R = 0, k_S >= 1): B -> A on 0 and 2 (2 is all-correct for B); A -> B on 1 and 3.
# GRAFT's candidates (1 <= k_S < n): A -> B {1 (k=2), 3 (k=3)}, B -> A {0 (k=2)} (2 has k_B = n);
# m = 1: A -> B keeps prompt 3 (most source successes), B -> A keeps prompt 0.
SGT_A = [[0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1]]
SGT_B = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def pair(a=SGT_A, b=SGT_B) -> dict[str, GroupOutcomes]:
    return {"a": outcomes_of(a), "b": outcomes_of(b)}


def loss_inputs(**kw) -> LossInputs:
    """A micro-batch: tensors and counts only (the clip range is the method's, fixed when built)."""
    return LossInputs(**kw)


# --------------------------------------------------------------------------------------------
# Registry and configuration
# --------------------------------------------------------------------------------------------


def test_every_method_is_registered_and_reads_its_section(tiny_checkpoints):
    assert {"grpo", "graft", "sgt", "luffy", "pooling"} <= set(METHODS)
    base = make_config(tiny_checkpoints)
    config = config_from_dict(
        {
            **base,
            "method": "sgt",
            "sgt": {"nll_coef": 0.3, "selection": "balanced", "peer_position": "last"},
            "luffy": {"gamma": 0.2},
            "graft": {"balance": False, "peer_position": "first", "delta": 0.7, "ratio_level": "sequence"},
            "train": {**base["train"], "adv_eps": 1e-4},
        }
    )
    sgt = build_method("sgt", config)
    assert (sgt.options.nll_coef, sgt.options.selection, sgt.peer_position) == (0.3, "balanced", "last")
    luffy = build_method("luffy", config)
    assert (luffy.options.gamma, luffy.balance, luffy.peer_position) == (0.2, False, "first")
    graft = build_method("graft", config)
    options = graft.options
    assert (options.delta, options.balance, options.ratio_level, graft.train.adv_eps) == (
        0.7,
        False,
        "sequence",
        1e-4,
    )
    assert build_method("pooling", config).train.adv_eps == 1e-4
    # every method reads the train section's loss settings once, when built
    assert all(build_method(name, config).train == TrainSettings.of(config.train) for name in METHODS)


def test_paper_defaults_and_rejected_combinations(tiny_checkpoints):
    config = config_from_dict(make_config(tiny_checkpoints))
    g = config.graft
    assert (g.gate, g.delta, g.balance, g.ratio_level, g.selection) == (
        True,
        0.8,
        True,
        "token",
        "complementary",
    )
    assert (g.admission, g.peer_position, g.groups, g.transfer) == ("gate", "last", "replace", "all")
    assert (config.sgt.nll_coef, config.sgt.selection, config.luffy.gamma) == (0.1, "all", 0.1)
    assert TrainSettings.of(config.train) == TrainSettings()  # a method built in code: the section's defaults
    with pytest.raises(ConfigError, match="gate"):
        config_from_dict({**make_config(tiny_checkpoints), "graft": {"gate": False, "admission": "random"}})
    with pytest.raises(ConfigError, match="ratio_level"):
        config_from_dict({**make_config(tiny_checkpoints), "graft": {"ratio_level": "row"}})
    with pytest.raises(ValueError, match="gate"):
        GRAFT(gate=False, admission="random")
    with pytest.raises(ValueError, match="selection"):
        SGT(selection="some")


# --------------------------------------------------------------------------------------------
# GRAFT's defaults are unchanged
# --------------------------------------------------------------------------------------------


def replacement_plan(
    receiver: str, outcomes: dict[str, GroupOutcomes], incoming: dict[str, torch.Tensor]
) -> ExchangePlan:
    """GRAFT's group replacement written out: the receiver's group at each incoming prompt is swapped
    for the source's whole group, every response keeping its source-computed advantage (algorithm.md §2.1).

    incoming: source name -> BoolTensor [P] of prompts whose group comes from that source.
    """
    replaced = torch.zeros(outcomes[receiver].num_prompts, dtype=torch.bool)
    peer: list[TrainGroup] = []
    for source, selected in incoming.items():
        replaced |= selected
        peer += [
            TrainGroup(prompt=p, source=source, peer=True, advantages=outcomes[source].advantages[p])
            for p in selected.nonzero().flatten().tolist()
        ]
    return ExchangePlan(groups=own_groups(receiver, outcomes[receiver], skip=replaced) + peer)


def test_graft_defaults_are_the_replacement_plan():
    outcomes = pair()
    plans = GRAFT().plan(outcomes, gen())
    expected = {"b": replacement_plan("b", outcomes, {"a": _bool([0, 0, 0, 1])})}
    expected["a"] = replacement_plan("a", outcomes, {"b": _bool([1, 0, 0, 0])})
    for receiver, plan in plans.items():
        got = [(g.prompt, g.source, g.peer, g.advantages.tolist(), g.keep, g.nll) for g in plan.groups]
        want = [
            (g.prompt, g.source, g.peer, g.advantages.tolist(), g.keep, g.nll)
            for g in expected[receiver].groups
        ]
        assert got == want
    assert plans["b"].diagnostics == {"candidates/a": 2.0, "selected/a": 1.0, "transferred/a": 4.0}
    s = torch.tensor([0.5, 0.81, 0.8, 1.3])
    torch.testing.assert_close(GRAFT().peer_weights(s, gen()), torch.tensor([0.0, 0.81, 0.0, 1.0]))


def _bool(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.bool)


# --------------------------------------------------------------------------------------------
# Gate, floor, random admission (eq. 8, eq. 11)
# --------------------------------------------------------------------------------------------


def test_no_gate_weights_every_transferred_response_one():
    s = torch.tensor([0.01, 0.5, 0.9, 3.0])
    assert torch.equal(GRAFT(gate=False).peer_weights(s, gen()), torch.ones(4))
    # delta = 0 is "no floor": w = min(s, 1) for everything
    torch.testing.assert_close(GRAFT(delta=0.0).peer_weights(s, gen()), torch.tensor([0.01, 0.5, 0.9, 1.0]))


def test_random_admission_is_count_matched_without_floor():
    s = torch.tensor([0.5, 0.9, 1.2, 0.85, 0.3, 0.95, 0.1, 0.7])  # s > 0.8: 0.9, 1.2, 0.85, 0.95 -> 4
    below_floor_admitted = 0
    chosen_sets = set()
    for seed in range(40):
        w = GRAFT(admission="random").peer_weights(s, gen(seed))
        admitted = w > 0
        assert int(admitted.sum()) == 4
        torch.testing.assert_close(w[admitted], s[admitted].clamp(max=1.0))  # w = min(s, 1)
        assert torch.equal(w, random_admission_weight(s, 0.8, gen(seed)))
        below_floor_admitted += int((admitted & (s <= 0.8)).sum())
        chosen_sets.add(tuple(admitted.nonzero().flatten().tolist()))
    assert below_floor_admitted > 0  # no floor: responses with s <= delta do get in, with w = s
    assert len(chosen_sets) > 5  # and which ones is random
    assert torch.equal(random_admission_weight(torch.tensor([0.1, 0.2]), 0.8, gen()), torch.zeros(2))


# --------------------------------------------------------------------------------------------
# Random prompts (count-matched selection)
# --------------------------------------------------------------------------------------------


def test_random_prompts_are_count_matched_and_ignore_rewards():
    # A -> B candidates: 0 (k_A 2), 1 (k_A 2), 4 (k_A 1); B -> A: 2 (k_B 1). m = 1, so A -> B keeps
    # prompt 0 and its tie 1 (two prompts), B -> A keeps prompt 2 (one prompt).
    a = [[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    b = [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]]
    outcomes = pair(a, b)
    graft = GRAFT().plan(outcomes, gen())
    assert [g.prompt for g in graft["b"].peer_groups] == [0, 1]
    assert [g.prompt for g in graft["a"].peer_groups] == [2]
    seen: set[int] = set()
    for seed in range(30):
        plans = GRAFT(selection="random_prompts").plan(outcomes, gen(seed))
        to_b, to_a = plans["b"].peer_groups, plans["a"].peer_groups
        assert len(to_b) == 2 and len(to_a) == 1
        assert len({g.prompt for g in to_b}) == 2
        for receiver, source, groups in (("b", "a", to_b), ("a", "b", to_a)):
            for g in groups:  # transferred with their source-computed advantages
                assert g.source == source and torch.equal(g.advantages, outcomes[source].advantages[g.prompt])
            own = [g.prompt for g in plans[receiver].groups if not g.peer]
            assert sorted(own + [g.prompt for g in groups]) == list(range(6))  # replaced there
        assert plans["b"].diagnostics["selected/a"] == 2 and plans["a"].diagnostics["selected/b"] == 1
        seen |= {g.prompt for g in to_b + to_a}
    assert seen == set(range(6))  # every prompt can be drawn, whatever its rewards
    assert int(random_prompt_selection(3, 7, gen()).sum()) == 3
    assert not random_prompt_selection(0, 7, gen()).any()
    # the weights still come from the compatibility gate
    s = torch.tensor([0.5, 0.9])
    torch.testing.assert_close(
        GRAFT(selection="random_prompts").peer_weights(s, gen()), torch.tensor([0.0, 0.9])
    )


# --------------------------------------------------------------------------------------------
# Pooled groups (eq. 12) and naive pooling
# --------------------------------------------------------------------------------------------


def test_pooled_advantages_hand_values():
    # Receiver 0/4, peer 2/4: pool of 8 with k = 2, mean = 2 / 8 = k_A / (2n) = 0.25. Squared
    # deviations: 2 * 0.75^2 + 6 * 0.25^2 = 1.5; unbiased std = sqrt(1.5 / 7) = sqrt(3 / 14).
    receiver, peer = pooled_advantages([torch.tensor([[0.0, 0, 0, 0]]), torch.tensor([[1.0, 1, 0, 0]])])
    std = math.sqrt(3 / 14) + 1e-6
    torch.testing.assert_close(receiver, torch.full((1, 4), -0.25 / std))
    torch.testing.assert_close(peer, torch.tensor([[0.75, 0.75, -0.25, -0.25]]) / std)
    assert (receiver < 0).all()  # the receiver's failures are pushed down
    # A uniform pool carries no signal.
    zero = pooled_advantages([torch.ones(1, 4), torch.ones(1, 4)])
    assert all(torch.equal(z, torch.zeros(1, 4)) for z in zero)


def test_graft_pooled_groups_keep_the_failed_group():
    outcomes = pair()
    plans = GRAFT(groups="pooled").plan(outcomes, gen())
    # B receives A's group on prompt 3 (B 0/4, A 3/4): pool mean 3/8.
    rows = torch.tensor([0.0, 0, 0, 0, 1, 1, 0, 1])
    std = float(rows.std()) + 1e-6
    b_groups = {(g.prompt, g.peer): g for g in plans["b"].groups}
    assert set(b_groups) == {(0, False), (1, False), (2, False), (3, False), (3, True)}
    torch.testing.assert_close(b_groups[3, False].advantages, torch.full((4,), -0.375 / std))
    torch.testing.assert_close(b_groups[3, True].advantages, (torch.tensor([1.0, 1, 0, 1]) - 0.375) / std)
    for p in (0, 1, 2):  # unselected prompts keep the receiver's own advantages
        assert torch.equal(b_groups[p, False].advantages, outcomes["b"].advantages[p])
    assert b_groups[3, True].source == "a" and b_groups[3, False].source == "b"
    # peers keep the gate, receiver rows are own rows (weight 1 in the trainer)
    torch.testing.assert_close(
        GRAFT(groups="pooled").peer_weights(torch.tensor([0.5, 0.9]), gen()), torch.tensor([0.0, 0.9])
    )


def test_naive_pooling_plan_and_order():
    outcomes = pair()
    plans = Pooling().plan(outcomes, gen())
    pools = pooled_advantages([outcomes["a"].rewards, outcomes["b"].rewards])
    for receiver, other, own_adv, peer_adv in (
        ("a", "b", pools[0], pools[1]),
        ("b", "a", pools[1], pools[0]),
    ):
        plan = plans[receiver]
        assert [(g.prompt, g.source, g.peer) for g in plan.groups] == [
            (p, m, m != receiver) for p in range(4) for m in (receiver, other)
        ]
        for g in plan.groups:
            assert torch.equal(g.advantages, (own_adv if not g.peer else peer_adv)[g.prompt])
            assert g.keep is None and not g.nll
        assert plan.diagnostics[f"pooled/{other}"] == 4.0
    # prompt 2: A 0/4, B 4/4 -> pool of 8 with mean 1/2: A's responses -1/(2 std), B's +1/(2 std)
    std = math.sqrt(8 * 0.25 / 7) + 1e-6
    torch.testing.assert_close(pools[0][2], torch.full((4,), -0.5 / std))
    assert plans["a"].diagnostics["pool_rescued"] == 2.0  # A's prompts 0 and 2 had no own signal
    assert plans["a"].diagnostics["mixed_pools"] == 4.0
    assert torch.equal(Pooling().peer_weights(torch.tensor([0.1, 5.0]), gen()), torch.ones(2))
    # one optimizer step holds whole prompts: own + peer group of the same prompts
    chunks = Pooling().order_minibatches(plans["a"], 2, gen())
    assert [sorted({plans["a"].groups[i].prompt for i in c.tolist()}) for c in chunks] == [[0, 1], [2, 3]]
    assert [len(c) for c in chunks] == [4, 4]


# --------------------------------------------------------------------------------------------
# Success-only transfer
# --------------------------------------------------------------------------------------------


def test_success_only_keeps_rewarded_responses_with_full_group_advantages():
    outcomes = pair()
    plans = GRAFT(transfer="success_only").plan(outcomes, gen())
    (peer,) = plans["b"].peer_groups  # A's group on prompt 3: rewards 1, 1, 0, 1
    assert peer.prompt == 3 and peer.keep is not None
    assert peer.keep.tolist() == [True, True, False, True]
    # advantages of the full group (mean 3/4, unbiased std 1/2): +0.5 for successes
    torch.testing.assert_close(peer.advantages, torch.tensor([0.5, 0.5, -1.5, 0.5]), atol=1e-5, rtol=0)
    assert plans["b"].diagnostics["transferred/a"] == 3.0
    (peer_a,) = plans["a"].peer_groups
    assert peer_a.keep.tolist() == [True, True, False, False]


# --------------------------------------------------------------------------------------------
# Sequence-level ratio
# --------------------------------------------------------------------------------------------


def test_sequence_level_ratio_hand_values_clip_and_gradient():
    # row 0 own (ratio 1, a = 1, two tokens); row 1 peer, log rho = 0.1, 0.2, 0.6: the sequence
    # ratio exp(0.3) = 1.3499 > 1.28 with a = 0.5 -> clipped, 1.28 * 0.5 per token, w = 0.9;
    # row 2 peer, log rho = 0.3, -0.3, 0: s = 1, a = -1 -> -1 per token. Tokens: 2 + 3 + 3 = 8.
    # J = (2 * 1 + 3 * 0.9 * 0.64 + 3 * (-1)) / 8 = 0.728 / 8.
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    delta = torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.2, 0.6], [0.3, -0.3, 0.0]])
    logp = (old + delta).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    batch = loss_inputs(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor([1.0, 0.5, -1.0]),
        weights=torch.tensor([1.0, 0.9, 1.0]),
        mask=mask,
        is_peer=_bool([0, 1, 1]),
        normalizer=8,
    )
    torch.testing.assert_close(sequence_log_ratio(logp, old, mask), torch.tensor([0.0, 0.3, 0.0]))
    loss, metrics = GRAFT(ratio_level="sequence").loss(batch)
    assert float(loss.detach()) == pytest.approx(-0.728 / 8, rel=1e-5)
    assert float(metrics["peer_clipped_tokens"]) == 3  # the whole clipped row
    loss.backward()
    grad = logp.grad
    assert torch.equal(grad[1], torch.zeros(3))  # clipped row: no gradient
    # unclipped row: d/dlogp_t of -(3 s a)/8 with s = exp(mean log rho): -(a s)/8 = +0.125 each
    torch.testing.assert_close(grad[2], torch.full((3,), 0.125))
    torch.testing.assert_close(grad[0, :2], torch.full((2,), -1 / 8))
    # token level on the same batch differs: per-token ratios, the 0.6 token clipped at 1.28
    # (a > 0) and the -0.3 token at 0.8 (a < 0), the +0.3 token of row 2 not (a < 0, rho > 1).
    token_loss, _ = GRAFT().loss(batch)
    expected = (2 + 0.9 * 0.5 * (math.exp(0.1) + math.exp(0.2) + 1.28) - (math.exp(0.3) + 0.8 + 1)) / 8
    assert float(token_loss.detach()) == pytest.approx(-expected, rel=1e-5)
    # own rows are never converted
    assert torch.equal(sequence_ratio_logp(logp, old, mask, _bool([0, 0, 0])), logp)


# --------------------------------------------------------------------------------------------
# LUFFY-style peer update
# --------------------------------------------------------------------------------------------


def test_luffy_shaping_gradient_matches_hand_value():
    x = torch.tensor([0.5, 0.05, 0.9, 0.001])
    logp = x.log().requires_grad_(True)
    a = torch.tensor([2.0, 2.0, -1.0, 0.5])
    (luffy_shaping(logp, 0.1) * a).sum().backward()
    # d f(exp(l)) / dl = gamma / (x + gamma)^2 * x: 0.1 * 0.5 / 0.36, 0.1 * 0.05 / 0.0225, ...
    hand = torch.tensor([0.1 * 0.5 / 0.36, 0.1 * 0.05 / 0.0225, 0.1 * 0.9 / 1.0, 0.1 * 0.001 / 0.101**2])
    torch.testing.assert_close(logp.grad, a * hand)
    torch.testing.assert_close(luffy_shaping(x.log(), 0.1), x / (x + 0.1))


def test_luffy_loss_own_clipped_peer_shaped_token_mean():
    # row 0 own: ratio 1, a = 1, 2 tokens -> 2. row 1 peer: pi = 0.5, 0.05, a = 2 ->
    # 2 * (0.5 / 0.6 + 0.05 / 0.15) = 2 * 7/6. Token-mean over all 4 tokens.
    logp = torch.tensor([[-1.0, -1.0], [math.log(0.5), math.log(0.05)]]).requires_grad_(True)
    old = torch.tensor([[-1.0, -1.0], [-9.0, -9.0]])  # a peer ratio to old would be huge: ignored
    batch = loss_inputs(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor([1.0, 2.0]),
        weights=torch.tensor([1.0, 1.0]),
        mask=torch.ones(2, 2, dtype=torch.bool),
        is_peer=_bool([0, 1]),
        normalizer=4,
    )
    loss, metrics = LUFFY().loss(batch)
    assert float(loss.detach()) == pytest.approx(-(2 + 2 * 7 / 6) / 4, rel=1e-6)
    assert float(metrics["peer_clipped_tokens"]) == 0 and "peer_s_sum" not in metrics  # no peer ratio
    loss.backward()
    hand = -(2.0 / 4) * torch.tensor([0.1 * 0.5 / 0.36, 0.1 * 0.05 / 0.0225])
    torch.testing.assert_close(logp.grad[1], hand)
    torch.testing.assert_close(logp.grad[0], torch.full((2,), -1 / 4))
    # the own row is still clipped: ratio e^1 with a > 0 -> 1.28 per token, no gradient
    clipped, _ = luffy_policy_loss(
        old[:1] + 1.0, old[:1], torch.tensor([1.0]), torch.ones(1), torch.ones(1, 2), _bool([0])
    )
    assert float(clipped) == pytest.approx(-1.28, rel=1e-6)


def test_luffy_plan_is_graft_and_admits_every_peer():
    outcomes = pair()
    for balance in (True, False):
        got, want = LUFFY(balance=balance).plan(outcomes, gen()), GRAFT(balance=balance).plan(outcomes, gen())
        for receiver in want:
            assert [(g.prompt, g.source, g.peer) for g in got[receiver].groups] == [
                (g.prompt, g.source, g.peer) for g in want[receiver].groups
            ]
    assert torch.equal(LUFFY().peer_weights(torch.tensor([0.01, 0.5, 3.0]), gen()), torch.ones(3))
    assert LUFFY().peer_position == "last"


# --------------------------------------------------------------------------------------------
# SGT
# --------------------------------------------------------------------------------------------


def test_sgt_picks_one_correct_peer_response_per_eligible_prompt():
    outcomes = pair()
    assert sgt_eligible(outcomes["a"].successes, outcomes["b"].successes).tolist() == [
        True,
        False,
        True,
        False,
    ]
    picks: dict[tuple[str, int], set[int]] = {}
    for seed in range(40):
        plans = SGT().plan(outcomes, gen(seed))
        for receiver, source, prompts in (("a", "b", [0, 2]), ("b", "a", [1, 3])):
            plan = plans[receiver]
            own = [g for g in plan.groups if not g.peer]
            assert [g.prompt for g in own] == [0, 1, 2, 3]  # every own group stays: GRPO
            for g in own:
                assert torch.equal(g.advantages, outcomes[receiver].advantages[g.prompt])
            nll = plan.peer_groups
            assert [g.prompt for g in nll] == prompts and all(g.nll and g.source == source for g in nll)
            for g in nll:
                assert g.keep is not None and int(g.keep.sum()) == 1
                (i,) = g.keep.nonzero().flatten().tolist()
                assert outcomes[source].rewards[g.prompt, i] == 1  # a correct response
                picks.setdefault((receiver, g.prompt), set()).add(i)
            assert plan.diagnostics == {f"eligible/{source}": 2.0, f"nll_responses/{source}": 2.0}
    # uniform among the successes of each group
    assert picks == {("a", 0): {0, 1}, ("a", 2): {0, 1, 2, 3}, ("b", 1): {0, 2}, ("b", 3): {0, 1, 3}}


def test_sgt_balanced_is_graft_selection():
    plans = SGT(selection="balanced").plan(pair(), gen())
    assert [g.prompt for g in plans["a"].peer_groups] == [0]  # B -> A: only prompt 0 (2 is k_B = n)
    assert [g.prompt for g in plans["b"].peer_groups] == [3]  # A -> B: m = 1, most successes
    assert plans["b"].diagnostics == {"eligible/a": 1.0, "nll_responses/a": 1.0}
    # nothing where the peer never succeeds
    none = pick_one_success(torch.zeros(2, 4), _bool([1, 1]), gen())
    assert not none.any()


def sgt_batch(logp: torch.Tensor, **fields) -> LossInputs:
    """One own row (ratio 1, a = 1, 2 tokens) and two NLL rows (-log p = 1, 2 | 3: 3 NLL tokens)."""
    return loss_inputs(
        logp=logp,
        old_logp=torch.tensor([[-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]),
        advantages=torch.tensor([1.0, 0.0, 0.0]),
        weights=torch.tensor([1.0, 0.0, 0.0]),
        mask=torch.tensor([[True, True], [True, True], [True, False]]),
        is_peer=_bool([0, 1, 1]),
        is_nll=_bool([0, 1, 1]),
        normalizer=2,
        nll_normalizer=3,
        **fields,
    )


SGT_LOGP = [[-0.5, -0.5], [-1.0, -2.0], [-3.0, 0.0]]


def test_sgt_loss_is_grpo_plus_lambda_token_mean_nll():
    # own row: ratio 1, a = 1, 2 tokens -> GRPO loss -2/2 = -1; NLL rows: -log p = 1, 2 | 3 -> 6/3.
    logp = torch.tensor(SGT_LOGP).requires_grad_(True)
    batch = sgt_batch(logp)
    loss, metrics = SGT().loss(batch)
    grpo, _ = clipped_policy_loss(
        logp, batch.old_logp, batch.advantages, batch.weights, batch.mask, normalizer=2
    )
    assert float(grpo.detach()) == pytest.approx(-1.0)
    assert float(loss.detach()) == pytest.approx(float(grpo.detach()) + 0.1 * 2.0)
    assert float(metrics["nll_sum"]) == pytest.approx(6.0) and float(metrics["nll_tokens"]) == 3
    loss.backward()
    torch.testing.assert_close(logp.grad[1:], torch.tensor([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]]))
    # without NLL rows it is exactly the GRPO loss
    plain = loss_inputs(**{**batch.__dict__, "is_nll": _bool([0, 0, 0]), "logp": logp.detach()})
    assert float(SGT().loss(plain)[0]) == pytest.approx(-1.0)


def test_sgt_nll_normalization_over_nll_tokens_or_the_whole_minibatch():
    # the NLL rows' 6 nats over their 3 tokens, or over all 5 tokens (the own row adds 2)
    batch = sgt_batch(torch.tensor(SGT_LOGP), minibatch_tokens=5)
    assert float(SGT().loss(batch)[0]) == pytest.approx(-1.0 + 0.1 * 6 / 3)
    whole = SGT(nll_normalization="minibatch_tokens").loss(batch)
    assert float(whole[0]) == pytest.approx(-1.0 + 0.1 * 6 / 5)
    # the logged NLL is the token-mean either way: 6 nats over 3 tokens
    assert float(whole[1]["nll_sum"]) == pytest.approx(6.0) and float(whole[1]["nll_tokens"]) == 3


def test_sgt_nll_groups_train_with_their_prompt():
    plan = SGT().plan(pair(), gen())["a"]  # own 0..3, NLL on 0 and 2
    chunks = SGT().order_minibatches(plan, 2, gen())
    groups = [[(plan.groups[i].prompt, plan.groups[i].nll) for i in c.tolist()] for c in chunks]
    assert groups == [[(0, False), (1, False), (0, True)], [(2, False), (3, False), (2, True)]]
    last = SGT(peer_position="last").order_minibatches(plan, 2, gen())
    assert [[plan.groups[i].nll for i in c.tolist()] for c in last] == [
        [False, False],
        [False, False],
        [True, True],
    ]


# --------------------------------------------------------------------------------------------
# End to end: two real steps of each method on the tiny checkpoints
# --------------------------------------------------------------------------------------------


def run(tiny_checkpoints, tmp_path, method: str, **sections):
    config = make_config(tiny_checkpoints, method=method)
    config.update(sections)
    trainer = Trainer(config_from_dict(config), tmp_path / method, verifier=ScriptedRewards(CROSSED))
    before = weights_of(trainer)
    trainer.train()
    after = weights_of(trainer)
    for name in ("llama", "gpt2"):
        changed = [k for k in before if k.startswith(name + ".") and not torch.equal(before[k], after[k])]
        assert changed, f"{method}: {name} did not train"
    rows = read_metrics(tmp_path / method)
    assert [(r["step"], r["model"], r["method"]) for r in rows] == [
        (s, m, method) for s in (0, 1) for m in ("llama", "gpt2")
    ]
    return rows, tmp_path / method


def test_sgt_end_to_end(tiny_checkpoints, tmp_path, monkeypatch):
    seen = []
    receivers: list[str] = []  # the policy whose rows are built, then trained (one update at a time)
    original, original_rows = SGT.loss, worker_module.build_rows

    def rows_spy(*args, policy, **kwargs):
        receivers.append(policy.name)
        return original_rows(*args, policy=policy, **kwargs)

    def spy(self, batch):
        loss, metrics = original(self, batch)
        nll = int(batch.is_nll.sum()) if batch.is_nll is not None else 0
        seen.append((receivers[-1], nll, float(metrics.get("nll_sum", 0.0))))
        return loss, metrics

    monkeypatch.setattr(worker_module, "build_rows", rows_spy)
    monkeypatch.setattr(SGT, "loss", spy)
    rows, _ = run(tiny_checkpoints, tmp_path, "sgt")
    # one NLL row per model per step reaches the loss, with a positive NLL
    assert sorted((r, n) for r, n, _ in seen if n) == [("gpt2", 1)] * 2 + [("llama", 1)] * 2
    assert all(value > 0 for _, n, value in seen if n)
    for row in rows:  # CROSSED: llama fails prompt 0 (gpt2 2/4), gpt2 fails prompt 1 (llama 2/4)
        source = "gpt2" if row["model"] == "llama" else "llama"
        assert row[f"eligible/{source}"] == 1 and row[f"nll_responses/{source}"] == 1
        assert row["peer_responses"] == 0  # NLL rows are not scored or weighted
        assert row["optimizer_steps"] == 2  # 4 prompts, 2 per step; the NLL row rides with its prompt
        assert row["train_tokens"] > 0
        assert row["nll"] > 0  # the NLL term's token-mean reaches metrics.jsonl


def test_luffy_end_to_end(tiny_checkpoints, tmp_path):
    rows, _ = run(tiny_checkpoints, tmp_path, "luffy")
    for row in rows:
        source = "gpt2" if row["model"] == "llama" else "llama"
        assert row[f"selected/{source}"] == 1 and row["peer_responses"] == 4
        assert row["peer_admitted"] == 4 and row["w_mean"] == 1.0  # no gate
        assert row["clip_frac_peer"] == 0.0  # no clip on peer tokens


def test_pooling_end_to_end(tiny_checkpoints, tmp_path):
    rows, _ = run(tiny_checkpoints, tmp_path, "pooling")
    for row in rows:
        assert row["pooled_prompts"] == 4 and row["peer_responses"] == 16  # every prompt, whole peer group
        assert row["peer_admitted"] == 16 and row["w_mean"] == 1.0
        assert row["pool_rescued"] == 1 and row["mixed_pools"] == 4
        assert row["optimizer_steps"] == 2  # whole prompts per step, as GRPO


def test_graft_switches_end_to_end_pooled_success_only_sequence_ungated(tiny_checkpoints, tmp_path):
    graft = {"gate": False, "ratio_level": "sequence", "groups": "pooled", "transfer": "success_only"}
    rows, _ = run(tiny_checkpoints, tmp_path, "graft", graft=graft)
    for row in rows:
        # llama receives gpt2's prompt-0 group (1, 1, 0, 0), gpt2 llama's prompt-1 group (1, 0, 1, 0)
        source = "gpt2" if row["model"] == "llama" else "llama"
        assert row[f"selected/{source}"] == 1 and row[f"transferred/{source}"] == 2
        assert row["peer_responses"] == 2 and row["peer_admitted"] == 2 and row["w_mean"] == 1.0


def test_graft_switches_end_to_end_random_prompts_and_admission(tiny_checkpoints, tmp_path):
    graft = {"selection": "random_prompts", "admission": "random", "peer_position": "uniform"}
    rows, run_dir = run(tiny_checkpoints, tmp_path, "graft", graft=graft)
    compat = [json.loads(line) for line in (run_dir / "compatibility.jsonl").read_text().splitlines()]
    assert len(compat) == 4
    for row, c in zip(rows, compat, strict=True):
        assert c["receiver"] == row["model"]
        source = "gpt2" if row["model"] == "llama" else "llama"
        assert row[f"selected/{source}"] == 1 and row["peer_responses"] == 4
        # as many admitted as the gate would admit, whichever they are
        assert row["peer_admitted"] == int((compatibility_weight(torch.tensor(c["s"]), 0.8) > 0).sum())
