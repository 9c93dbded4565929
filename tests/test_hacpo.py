"""HACPO (algorithm.md §3): expectations derived by hand from the spec, and a short real run."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import ScriptedRewards, make_config, weights_of

from graftrl.config import config_from_dict
from graftrl.core import (
    capability_baseline,
    capability_ratios,
    content_mask,
    gspo_own_terms,
    hacpo_advantages,
    hacpo_peer_terms,
    pooled_minibatch_order,
    stepwise_lower_bound,
)
from graftrl.methods import GroupOutcomes, LossInputs, RowOrigins, TrainSettings, build_method
from graftrl.methods.hacpo import HACPO
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer

STRONG = [1.0, 1.0, 0.0, 1.0]
WEAK = [0.0, 1.0, 0.0, 0.0]
STD_50_50 = math.sqrt(2 / 7)  # unbiased std of four 1s and four 0s


def outcomes_of(*groups: list[list[float]]) -> dict[str, GroupOutcomes]:
    """Agents a0, a1, ... with the given [P][n] rewards (own advantages unused by HACPO)."""
    return {
        f"a{i}": GroupOutcomes(torch.tensor(g), torch.zeros(len(g), len(g[0]))) for i, g in enumerate(groups)
    }


# ----- capability ratios and the capability-aware advantage -----------------------------------
def test_capability_ratios_clip_and_undefined_cases():
    omega = capability_ratios(torch.tensor([0.6, 0.3]))
    assert omega.flatten().tolist() == pytest.approx([1.0, 2.0, 0.5, 1.0])
    omega = capability_ratios(torch.tensor([0.6, 0.05]))  # 12 -> 10, 1/12 -> 0.1
    assert omega.flatten().tolist() == pytest.approx([1.0, 10.0, 0.1, 1.0])
    omega = capability_ratios(torch.tensor([0.0, 0.0, 0.5, math.nan]))
    assert omega[0, 1] == 1.0  # 0 / 0: equally capable
    assert omega[2, 0] == pytest.approx(10.0) and omega[0, 2] == pytest.approx(0.1)  # x/0, 0/x
    assert omega[3].tolist() == [1.0] * 4 and omega[:, 3].tolist() == [1.0] * 4  # unknown P_hat
    assert torch.diagonal(omega[:3, :3]).tolist() == [1.0, 1.0, 1.0]


def test_capability_aware_advantage_by_hand():
    """P_hat = (0.6, 0.3): omega^(0,1) = 2, omega^(1,0) = 0.5; pooled rewards 1101 | 0100."""
    rewards = torch.tensor([[STRONG], [WEAK]])  # [K=2, P=1, n=4]
    omega = capability_ratios(torch.tensor([0.6, 0.3]))
    # learner 0 (strong): mu = (3 + 2 * 1) / 8 = 0.625; std over the 8 pooled rewards = sqrt(2/7)
    mu, fell_back = capability_baseline(rewards, omega[0], 0)
    assert mu.tolist() == pytest.approx([0.625]) and not fell_back.any()
    a = hacpo_advantages(rewards, omega[0], 0)
    up, down = (1 - 0.625) / (STD_50_50 + 1e-6), (0 - 0.625) / (STD_50_50 + 1e-6)
    assert a[0, 0].tolist() == pytest.approx([up, up, down, up], abs=1e-6)
    assert a[1, 0].tolist() == pytest.approx([down, up, down, down], abs=1e-6)  # peer: same formula
    # learner 1 (weak): mu = (0.5 * 3 + 1) / 8 = 0.3125
    a = hacpo_advantages(rewards, omega[1], 1)
    up, down = (1 - 0.3125) / (STD_50_50 + 1e-6), (0 - 0.3125) / (STD_50_50 + 1e-6)
    assert a[1, 0].tolist() == pytest.approx([down, up, down, down], abs=1e-6)
    assert a[0, 0].tolist() == pytest.approx([up, up, down, up], abs=1e-6)
    # population std when asked: sqrt(1/4) = 0.5
    a = hacpo_advantages(rewards, omega[1], 1, unbiased=False)
    assert float(a[1, 0, 1]) == pytest.approx(0.6875 / (0.5 + 1e-6), abs=1e-6)


def test_baseline_above_one_falls_back_to_the_learners_own_mean():
    """omega^(0,1) = 10 (clipped): mu = (3 + 10 * 3) / 8 > 1 -> the learner's own mean 0.75."""
    rewards = torch.tensor([[[1.0, 1.0, 1.0, 0.0]], [[1.0, 1.0, 0.0, 1.0]]])
    omega = capability_ratios(torch.tensor([0.6, 0.05]))
    mu, fell_back = capability_baseline(rewards, omega[0], 0)
    assert mu.tolist() == pytest.approx([0.75]) and fell_back.tolist() == [True]
    std = math.sqrt((6 * 0.25**2 + 2 * 0.75**2) / 7)  # pooled 1110 1101, mean 0.75
    a = hacpo_advantages(rewards, omega[0], 0)
    assert a[0, 0].tolist() == pytest.approx([0.25 / std] * 3 + [-0.75 / std], abs=1e-5)
    assert a[1, 0].tolist() == pytest.approx([0.25 / std] * 2 + [-0.75 / std, 0.25 / std], abs=1e-5)
    # the weak learner's baseline (omega 0.1) stays below 1: no fallback
    _, fell_back = capability_baseline(rewards, omega[1], 1)
    assert fell_back.tolist() == [False]


def test_uniform_pooled_groups_get_zero_advantage():
    omega = torch.tensor([1.0, 10.0])  # mu would be 5.5 for all-ones
    for value in (0.0, 1.0):
        rewards = torch.full((2, 1, 4), value)
        assert torch.equal(hacpo_advantages(rewards, omega, 0), torch.zeros(2, 1, 4))
        mu, fell_back = capability_baseline(rewards, omega, 0)
        assert mu.tolist() == [value] and not fell_back.any()  # the plain mean


# ----- loss pieces -----------------------------------------------------------------------------
def test_stepwise_lower_bound():
    assert stepwise_lower_bound(0) == pytest.approx(0.8)
    assert stepwise_lower_bound(1) == pytest.approx(0.825)
    assert stepwise_lower_bound(4) == pytest.approx(0.9)
    assert stepwise_lower_bound(8) == 1.0 and stepwise_lower_bound(13) == 1.0


def test_gspo_own_term_clips_with_the_tiny_range():
    """s = exp(mean log rho): 1.001 and 0.999 are outside [1 - 3e-4, 1 + 4e-4]; 1.0001 inside."""
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.bool)
    log_rho = torch.tensor([1e-3, 1e-3, -1e-3, -1e-3, 1e-4, 1e-4]).view(6, 1).expand(6, 3)
    old = torch.zeros(6, 3)
    old[:, 2] = 5.0  # padding must not matter
    logp = (old + log_rho).clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -2.0])
    term, s, clipped = gspo_own_terms(logp, old, adv, mask, 3e-4, 4e-4)
    e_hi, e_lo, e_in = math.exp(1e-3), math.exp(-1e-3), math.exp(1e-4)
    assert s.tolist() == pytest.approx([e_hi, e_hi, e_lo, e_lo, e_in, e_in], rel=1e-6)
    expected = [1.0004, -e_hi, e_lo, -0.9997, 2 * e_in, -2 * e_in]
    assert term.tolist() == pytest.approx(expected, rel=1e-6)
    assert clipped.tolist() == [True, False, False, True, False, False]
    term.sum().backward()
    # d term / d logp_t = A * s / |y| where unclipped, 0 where the clip binds
    grad = [0.0, -e_hi / 2, e_lo / 2, 0.0, 2 * e_in / 2, -2 * e_in / 2]
    assert logp.grad[:, 0].tolist() == pytest.approx(grad, rel=1e-5)
    assert logp.grad[:, 2].tolist() == [0.0] * 6


def test_content_mask_drops_the_terminal_eos_of_finished_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    finished = torch.tensor([True, False, True, True])
    expected = [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert content_mask(mask, finished).int().tolist() == expected


def peer_rows(log_s: list[float], source_mean: float = -2.0):
    """Rows of 3 content tokens + EOS whose content lbar is source_mean + log_s."""
    logp = torch.tensor([[source_mean + x] * 3 + [-9.0] for x in log_s], requires_grad=True)
    mask = torch.ones(len(log_s), 4, dtype=torch.bool)
    cmask = content_mask(mask, torch.ones(len(log_s), dtype=torch.bool))
    return logp, torch.full((len(log_s),), source_mean), cmask


def test_peer_term_value_and_gradient_through_autograd():
    """c * sg(c)^alpha * omega * A: the value has c^(1+alpha), the gradient only one factor c."""
    logp, src, cmask = peer_rows([math.log(0.9)] * 2)
    adv, omega = torch.tensor([0.5, -1.0]), torch.tensor([2.0, 0.5])
    term, s, clipped = hacpo_peer_terms(logp, src, adv, omega, cmask, lower=0.8, alpha=1.0)
    assert s.tolist() == pytest.approx([0.9, 0.9])
    assert term.tolist() == pytest.approx([0.9 * 0.9 * 2 * 0.5, 0.9 * 0.9 * 0.5 * -1.0])
    assert not clipped.any()
    term.sum().backward()
    # d/dlogp_t = (dc/dlbar = c) * (1/3) * sg(c) * omega * A per content token; EOS gets nothing
    assert logp.grad[0, :3].tolist() == pytest.approx([0.9 * 0.9 * 2 * 0.5 / 3] * 3)
    assert logp.grad[1, :3].tolist() == pytest.approx([0.9 * 0.9 * 0.5 * -1.0 / 3] * 3)
    assert logp.grad[:, 3].tolist() == [0.0, 0.0]
    # alpha = 3: value c^4, gradient c^4 / 3 (stop-gradient factor not differentiated)
    logp, src, cmask = peer_rows([math.log(0.9)])
    term, _, _ = hacpo_peer_terms(logp, src, torch.ones(1), torch.ones(1), cmask, 0.8, alpha=3.0)
    term.sum().backward()
    assert float(term.detach()) == pytest.approx(0.9**4)
    assert logp.grad[0, 0] == pytest.approx(0.9**4 / 3)


def test_peer_ratio_clip_bounds_and_stepwise_tightening():
    # s = 0.85: inside [0.8, 1] at m = 0, below lower_4 = 0.9 at m = 4 (clipped to 0.9, no grad)
    for m, c, has_grad in [(0, 0.85, True), (4, 0.9, False), (8, 1.0, False)]:
        logp, src, cmask = peer_rows([math.log(0.85)])
        lower = stepwise_lower_bound(m)
        term, _, clipped = hacpo_peer_terms(logp, src, torch.ones(1), torch.ones(1), cmask, lower)
        assert float(term.detach()) == pytest.approx(c * c)
        assert bool(clipped[0]) is not has_grad
        term.sum().backward()
        assert bool(logp.grad.abs().sum() > 0) is has_grad
    # s > 1 clips to 1; an enormous ratio stays finite
    logp, src, cmask = peer_rows([0.5, 500.0])
    term, _, clipped = hacpo_peer_terms(logp, src, torch.ones(2), torch.ones(2), cmask, 0.8)
    term.sum().backward()
    assert term.tolist() == [1.0, 1.0] and clipped.all() and torch.equal(logp.grad, torch.zeros(2, 4))
    # "raw" (the review's eq. 53): sg(min(s, 1))^alpha with the unclipped s
    logp, src, cmask = peer_rows([math.log(0.7)])
    term, _, _ = hacpo_peer_terms(logp, src, torch.ones(1), torch.ones(1), cmask, 0.8, exp_ratio="raw")
    assert float(term.detach()) == pytest.approx(0.8 * 0.7)


def test_method_loss_aggregates_own_and_peer_rows_and_adds_kl_on_own_rows():
    """Sequence-mean over the minibatch's rows; k3 KL token-mean per own row, own rows only."""
    method = HACPO(train=TrainSettings(kl_coef=1e-3))
    method.observe({"r": 0.3, "p": 0.6})  # omega^(p, r) = 2
    logp_peer, src, _ = peer_rows([math.log(0.9)])
    own_logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    logp = torch.cat([own_logp, logp_peer.detach()]).requires_grad_(True)
    ref = torch.tensor([[-1.5, -1.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    batch = LossInputs(
        logp=logp,
        old_logp=torch.cat([own_logp, torch.zeros(1, 4)]),
        advantages=torch.tensor([1.0, 0.5]),
        weights=torch.ones(2),
        mask=torch.ones(2, 4, dtype=torch.bool),
        is_peer=torch.tensor([False, True]),
        normalizer=8,
        ref_logp=ref,
        origins=RowOrigins(
            receiver="r",
            sources=("r", "p"),
            source_mean_logp=torch.tensor([-1.0, float(src[0])]),
            finished=torch.tensor([True, True]),
            minibatch_index=0,
            minibatch_rows=4,  # two more rows of this minibatch are in other micro-batches
        ),
    )
    loss, metrics = method.loss(batch)
    own_term = 1.0  # s = 1 on own rows before any update
    peer_term = 0.9 * 0.9 * 2.0 * 0.5
    k3 = math.exp(-0.5) + 0.5 - 1.0  # only the first own token differs from the reference
    kl = (k3 / 4) / 4  # own row's token-mean, over the minibatch's 4 rows
    assert float(loss.detach()) == pytest.approx(-(own_term + peer_term) / 4 + 1e-3 * kl, rel=1e-6)
    # the sums the worker adds up over the step: k3 over the own row's 4 tokens, one row each side
    assert float(metrics["kl_sum"]) == pytest.approx(k3) and float(metrics["kl_tokens"]) == 4
    assert float(metrics["peer_s_sum"]) == pytest.approx(0.9) and float(metrics["peer_rows"]) == 1
    assert float(metrics["own_s_sum"]) == pytest.approx(1.0) and float(metrics["own_rows"]) == 1
    assert float(metrics["peer_lower_bound_sum"]) == pytest.approx(0.8)  # lower_0 x 1 peer row
    # token-mean: each row's term weighted by its 4 tokens over the 8-token normalizer
    token_method = HACPO(loss_agg="token-mean", train=method.train, history=dict(method.history))
    loss, _ = token_method.loss(batch)
    assert float(loss.detach()) == pytest.approx(-4 * (own_term + peer_term) / 8 + 1e-3 * k3 / 8, rel=1e-6)


# ----- tracker, state, plans -------------------------------------------------------------------
def test_tracker_window_of_five_and_state_round_trip():
    method = HACPO()
    means = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    for step, m in enumerate(means):
        # a0's rewards average m over 2 prompts x 5 samples; a1 always 0.5
        rewards_a0 = [[1.0] * round(10 * m) + [0.0] * (10 - round(10 * m))]
        method.plan(outcomes_of(rewards_a0, [[1.0] * 5 + [0.0] * 5]), torch.Generator())
        assert len(method.history["a0"]) == min(step + 1, 5)
    assert method.history["a0"] == pytest.approx([0.3, 0.4, 0.5, 0.6, 0.7])
    assert method.capability("a0") == pytest.approx(0.5) and method.capability("a1") == 0.5
    state = json.loads(json.dumps(method.state_dict()))
    restored = HACPO()
    restored.load_state_dict(state)
    assert restored.history == method.history
    assert torch.equal(restored.omega(["a0", "a1"]), method.omega(["a0", "a1"]))
    nxt = outcomes_of([[1.0, 0.0, 0.0, 0.0, 0.0]], [[1.0, 1.0, 0.0, 0.0, 0.0]])
    a, b = method.plan(nxt, torch.Generator()), restored.plan(nxt, torch.Generator())
    assert method.history == restored.history
    for receiver in a:
        for ga, gb in zip(a[receiver].groups, b[receiver].groups, strict=True):
            assert torch.equal(ga.advantages, gb.advantages)
    with pytest.raises(ValueError):
        restored.load_state_dict({"history": {}, "bogus": 1})
    restored.load_state_dict({})
    assert restored.history == {} and math.isnan(restored.capability("a0"))
    assert restored.omega(["a0", "a1"]).tolist() == [[1.0, 1.0], [1.0, 1.0]]  # before any step


def test_three_agent_plan_pools_every_group():
    groups = ([[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 1.0]], [[0.0, 1.0], [1.0, 1.0]])
    outcomes = outcomes_of(*groups)
    method = HACPO()
    plans = method.plan(outcomes, torch.Generator())
    assert set(plans) == {"a0", "a1", "a2"}
    rewards = torch.tensor(groups)
    omega = method.omega(["a0", "a1", "a2"])  # P_hat = (0.75, 0.5, 0.75)
    assert omega[0, 1] == pytest.approx(1.5) and omega[1, 0] == pytest.approx(2 / 3)
    for k, receiver in enumerate(["a0", "a1", "a2"]):
        plan = plans[receiver]
        assert len(plan.groups) == 2 * 3
        expected = hacpo_advantages(rewards, omega[k], k)
        seen = set()
        for g in plan.groups:
            j = int(g.source[1])
            assert g.peer == (j != k)
            assert torch.allclose(g.advantages, expected[j, g.prompt])
            seen.add((g.prompt, g.source))
        assert seen == {(p, f"a{j}") for p in range(2) for j in range(3)}
        assert plan.diagnostics[f"omega/{'a1' if k != 1 else 'a0'}"] == pytest.approx(
            float(omega[1 if k != 1 else 0, k])
        )
        assert torch.equal(expected[:, 1], torch.zeros(3, 2))  # prompt 1 is all-correct: A = 0
        # one optimizer step per prompt holds its own group and both peer groups
        order = method.order_minibatches(plan, 1, torch.Generator())
        assert [sorted(plan.groups[i].source for i in step.tolist()) for step in order] == [
            ["a0", "a1", "a2"]
        ] * 2
    assert [t.tolist() for t in pooled_minibatch_order(torch.tensor([0, 0, 1, 1, 2, 2]), 2)] == [
        [0, 1, 2, 3],
        [4, 5],
    ]
    with pytest.raises(ValueError, match="two agents"):
        method.plan({"a0": outcomes["a0"]}, torch.Generator())


def test_recipe_minibatch_is_minibatch_prompts_times_n_rows_of_the_pooled_batch():
    """verl's ppo_mini_batch_size counts prompts of one agent's batch: 64 x n rows. Over the pooled
    2 x 128 x n rows that is 4 optimizer steps of 32 whole prompts (own + peer groups)."""
    rewards = [[[float((p + i) % 3 == 0) for i in range(8)] for p in range(128)]] * 2
    outcomes = outcomes_of(*rewards)
    plan = HACPO().plan(outcomes, torch.Generator())["a0"]
    order = HACPO().order_minibatches(plan, 64, torch.Generator())
    assert len(order) == 4
    for step in order:
        groups = [plan.groups[i] for i in step.tolist()]
        assert len(groups) * 8 == 64 * 8  # 64 x n rows per optimizer step
        prompts = {g.prompt for g in groups}
        assert len(prompts) == 32 and all(sum(g.prompt == p for g in groups) == 2 for p in prompts)
    assert len(HACPO(minibatch="prompts").order_minibatches(plan, 64, torch.Generator())) == 2


def test_recipe_minibatch_needs_a_multiple_of_the_agents(tiny_checkpoints):
    raw = make_config(tiny_checkpoints, method="hacpo", minibatch_prompts=1)
    with pytest.raises(ValueError, match="multiple of the 2 agents"):
        config_from_dict(raw)
    config_from_dict({**raw, "hacpo": {"minibatch": "prompts"}})


def test_build_from_config_reads_the_hacpo_section(tiny_checkpoints):
    raw = make_config(tiny_checkpoints, method="hacpo", kl_coef=1e-3)
    raw["hacpo"] = {"window": 3, "alpha": 3.0, "clip_lower": 0.2, "exp_ratio": "raw"}
    method = build_method("hacpo", config_from_dict(raw))
    assert isinstance(method, HACPO)
    options = method.options
    assert (options.window, options.alpha, options.clip_lower, options.exp_ratio) == (3, 3.0, 0.2, "raw")
    assert (options.own_clip_low, options.own_clip_high, options.clip_step) == (3e-4, 4e-4, 0.025)
    assert method.train.kl_coef == 1e-3  # the loss's KL weight: fixed when built, not sent per batch
    one = {**raw, "policies": raw["policies"][:1]}
    with pytest.raises(ValueError, match="at least two"):
        build_method("hacpo", config_from_dict(one))


# llama solves 12/16, gpt2 6/16: omega^(llama, gpt2) = 2; prompt 2 is all-correct for both.
SKEWED = [
    [[1, 1, 0, 1], [1, 0, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]],  # llama
    [[0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]],  # gpt2
]


# ----- end to end ------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny models run fastest on one intra-op thread (and do not thrash a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_hacpo_trains_and_resumes_with_the_tracker(tiny_checkpoints, tmp_path, one_thread):
    """2 steps, 2 tiny models, n = 4, KL 1e-3; resume from step 1 reproduces step 2 exactly."""
    raw = make_config(tiny_checkpoints, method="hacpo", kl_coef=1e-3)
    raw["checkpoint"] = {"every": 1, "keep_last": 5}
    raw["hacpo"] = {"minibatch": "prompts"}  # minibatch_prompts whole prompts per optimizer step
    full = Trainer(config_from_dict(raw), tmp_path / "full", verifier=ScriptedRewards(SKEWED))
    captured: list[tuple[LossInputs, dict]] = []
    original = full.method.loss

    def spy(batch):
        loss, metrics = original(batch)
        captured.append((batch, metrics))
        return loss, metrics

    full.method.loss = spy
    full.train()

    # the tracker after each step, saved in each checkpoint (SKEWED: llama 12/16, gpt2 6/16)
    states = [
        json.loads((tmp_path / "full" / "checkpoints" / f"step_00000{s}" / "method_state.json").read_text())
        for s in (1, 2)
    ]
    assert states[0]["history"] == {"llama": [0.75], "gpt2": [0.375]}
    assert states[1]["history"] == {"llama": [0.75] * 2, "gpt2": [0.375] * 2}

    rows = {(r["step"], r["model"]): r for r in read_metrics(tmp_path / "full")}
    for model, peer in (("llama", "gpt2"), ("gpt2", "llama")):
        row = rows[(0, model)]
        assert row["peer_responses"] == 4 * 4  # every prompt's peer group
        assert row["optimizer_steps"] == 2  # 4 prompts, 2 per minibatch, own + peer together
        assert row["peer_admitted"] == 16  # no gate
        assert row["grad_norm"] > 0  # it trains
        expected = (states[0]["history"][peer][0]) / states[0]["history"][model][0]
        assert row[f"omega/{peer}"] == pytest.approx(expected)

    # every micro-batch holds whole prompts' pooled groups; the minibatch index runs 0, 1
    assert {b.origins.minibatch_index for b, _ in captured} == {0, 1}
    assert full.method.train.kl_coef == 1e-3 and all(b.ref_logp is not None for b, _ in captured)
    assert any(bool(b.is_peer.any()) and bool((~b.is_peer).any()) for b, _ in captured)
    assert any("kl_sum" in m for _, m in captured)
    for model in ("llama", "gpt2"):  # what the loss measured reaches metrics.jsonl
        row = rows[(0, model)]
        assert row["kl"] >= 0 and row["own_s_mean"] > 0 and row["peer_s_mean"] > 0
        # peer rows in minibatches 0 and 1, lower_m = 0.8 + 0.025 m: the mean lies between
        assert 0.8 <= row["peer_lower_bound"] <= 0.825
        assert "clip_frac_peer_pos" not in row  # its peer clip has no sign split
    # before the first update the loss's peer ratio is the trainer's compatibility score
    compat = [
        json.loads(line) for line in (tmp_path / "full" / "compatibility.jsonl").read_text().splitlines()
    ]
    first = {c["receiver"]: c["s"] for c in compat[:2]}
    for batch, _ in captured:
        origins = batch.origins
        if origins.minibatch_index != 0 or not bool(batch.is_peer.any()):
            continue
        _, s, _ = hacpo_peer_terms(
            batch.logp.detach(),
            origins.source_mean_logp,
            batch.advantages,
            torch.ones(len(batch.advantages)),
            content_mask(batch.mask, origins.finished),
            0.8,
        )
        for value in s[batch.is_peer].tolist():
            assert min(abs(math.log(value) - math.log(x)) for x in first[origins.receiver]) < 1e-3
        break

    # resume from step 1: the tracker comes back, and step 2 matches the uninterrupted run
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    resumed = Trainer(config_from_dict(raw), cut, verifier=ScriptedRewards(SKEWED))
    seen = {}
    resumed.step_callback = lambda step, metrics: seen.setdefault(step, dict(resumed.method.history))
    original_resume = resumed.checkpoints.resume

    def resume_and_check(force):
        where = original_resume(force)
        assert resumed.method.history == states[0]["history"]
        return where

    resumed.checkpoints.resume = resume_and_check
    resumed.train(resume=True)
    assert resumed.start_step == 1 and seen[1] == states[1]["history"]
    assert resumed.method.state_dict() == full.method.state_dict()
    full_weights, resumed_weights = weights_of(full), weights_of(resumed)
    for key, value in full_weights.items():
        assert torch.equal(value, resumed_weights[key]), key


def test_method_hacpo_trains_with_its_recipe_unless_the_config_says_otherwise(tiny_task):
    """`method: hacpo` trained with kl_coef 0 and GRPO's minibatch while compare's table1 HACPO used
    1e-3 and half the batch: the recipe is now the method's default (one place, ``HACPO.recipe``),
    which the preset's cell takes too; fields the config sets win."""
    from graftrl.experiments.cells import cell_config
    from graftrl.experiments.matrix import preset_matrix
    from graftrl.methods.hacpo import KL_COEF

    raw = {**tiny_task.base_config, "method": "hacpo"}
    raw["train"] = {k: v for k, v in raw["train"].items() if k not in ("kl_coef", "minibatch_prompts")}
    raw["train"]["batch_prompts"] = 8
    config = config_from_dict(raw)
    assert (config.train.kl_coef, config.train.minibatch_prompts) == (KL_COEF, 4)
    assert build_method("hacpo", config).train.kl_coef == KL_COEF
    grpo = {**raw, "method": "grpo", "train": {**raw["train"], "minibatch_prompts": 4}}
    assert config_from_dict(grpo).train.kl_coef == 0.0  # GRPO's defaults stay
    mine = config_from_dict({**raw, "train": {**raw["train"], "kl_coef": 0.0, "minibatch_prompts": 8}})
    assert (mine.train.kl_coef, mine.train.minibatch_prompts) == (0.0, 8)
    hacpo = next(v for v in preset_matrix("table1", 8, 2).variants if v.method == "hacpo")
    task = type(tiny_task)(**{**vars(tiny_task), "base_config": raw})
    cell = cell_config(task, hacpo, seed=0, steps=None)
    assert (cell.train.kl_coef, cell.train.minibatch_prompts) == (KL_COEF, 4)
    # a base that sets its own minibatch (the embedded one does) still gets the recipe's in table1
    own = {**raw, "train": {**raw["train"], "minibatch_prompts": 2}}
    cell = cell_config(type(tiny_task)(**{**vars(tiny_task), "base_config": own}), hacpo, seed=0, steps=None)
    assert (cell.train.kl_coef, cell.train.minibatch_prompts) == (KL_COEF, 4)
    assert hacpo.set == {"train.kl_coef": KL_COEF, "train.minibatch_prompts": 4}
