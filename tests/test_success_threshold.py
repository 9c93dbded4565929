"""Continuous rewards (docs/algorithm.md §1.1): advantages from the reward itself, every count of
GRAFT from successes, rewards at or above ``reward.success_threshold``.

A group of partial passes with no full pass, (0.5, 0.5, 0.75, 0), counts 0 successes at the
default threshold 1.0 (all-fail for eq. 4, the diagnostics, the probe, the reports), 3 at 0.5.
On 0/1 rewards every changed function gives what the expression it replaced gave.
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch
from conftest import make_config

from graftrl.config import config_from_dict
from graftrl.config import rewards as reward_config
from graftrl.core import SUCCESS_THRESHOLD, complementarity, grpo_advantages, is_success
from graftrl.core.ablations import success_only_keep
from graftrl.core.diagnostics import all_fail_signal_fraction, group_outcome_fractions
from graftrl.core.hint import rescue_counts, rescued_advantages
from graftrl.core.sgt import pick_one_success
from graftrl.evaluation.evaluate import EvalProtocol, pass_at_k, sample_correctness, summarize_benchmark
from graftrl.methods import GroupOutcomes, build_method
from graftrl.methods.graft import GRAFT
from graftrl.methods.sgt import SGT
from graftrl.reporting.complementarity import Complementarity, check_against_store
from graftrl.reporting.contrast import moved_error_classes
from graftrl.reporting.diagnostics import advantage_mass, gate_by_outcome
from graftrl.reporting.probe_stats import COST_KEYS, WALL_KEYS, ProbeSettings, StepData, probe_statistics
from graftrl.reporting.run_logs import run_success_threshold, success_threshold_of
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.store_rows import StoredTrajectory
from graftrl.training.served_peers import all_fail_prompts
from graftrl.training.trajectories import peer_groups

PARTIAL = [0.5, 0.5, 0.75, 0.0]
"""A group of partial passes with no full pass: 0 successes at 1.0, 3 at 0.5."""


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def outcomes_of(rewards: list[list[float]], threshold: float = SUCCESS_THRESHOLD) -> GroupOutcomes:
    r = torch.tensor(rewards, dtype=torch.float32)
    return GroupOutcomes(r, grpo_advantages(r), threshold)


def binary(seed: int, shape: tuple[int, ...] = (64, 4)) -> torch.Tensor:
    """Random 0/1 rewards, some groups all-fail and some all-pass."""
    g = gen(seed)
    rewards = (torch.rand(shape, generator=g) < 0.4).float()
    rewards[0], rewards[1] = 0.0, 1.0
    return rewards


# --------------------------------------------------------------------------------------------
# One definition
# --------------------------------------------------------------------------------------------


def test_is_success_is_reward_at_or_above_the_threshold():
    rewards = torch.tensor([[0.0, 0.5, 0.75, 1.0]])
    assert is_success(rewards).tolist() == [[False, False, False, True]]
    assert is_success(rewards, 0.5).tolist() == [[False, True, True, True]]
    assert is_success(rewards).shape == rewards.shape and is_success(rewards).dtype == torch.bool
    assert is_success(1.0) is True and is_success(0.75) is False and is_success(0.75, 0.75) is True
    # the config's default is core's constant, declared once
    assert reward_config.SUCCESS_THRESHOLD is SUCCESS_THRESHOLD == 1.0
    assert reward_config.RewardConfig().success_threshold == 1.0


def test_on_binary_rewards_the_threshold_picks_what_the_old_tests_picked():
    for seed in range(5):
        r = binary(seed)
        assert torch.equal(is_success(r), r > 0.5) and torch.equal(is_success(r), r > 0)


# --------------------------------------------------------------------------------------------
# Counts: k, all-fail, all-pass, complementarity
# --------------------------------------------------------------------------------------------


def test_partial_passes_count_no_success_and_make_an_all_fail_group():
    rewards = torch.tensor([PARTIAL, [1.0, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    outcomes = GroupOutcomes(rewards, grpo_advantages(rewards))
    assert outcomes.successes.tolist() == [0, 1, 4]  # the rounded sum would say [2, 2, 4]
    all_fail, all_pass = group_outcome_fractions(rewards)
    assert float(all_fail) == pytest.approx(1 / 3) and float(all_pass) == pytest.approx(1 / 3)
    # threshold 0.5: the partial passes count
    lenient = GroupOutcomes(rewards, grpo_advantages(rewards), 0.5)
    assert lenient.successes.tolist() == [3, 2, 4]
    all_fail, all_pass = group_outcome_fractions(rewards, 0.5)
    assert float(all_fail) == 0.0 and float(all_pass) == pytest.approx(1 / 3)
    # advantages come from the reward itself, whatever the threshold: the partial group is mixed
    advantages = grpo_advantages(rewards)
    assert bool((advantages[0] != 0).all()) and advantages[0, 2] > advantages[0, 0] > advantages[0, 3]


def test_successes_and_group_fractions_match_the_old_expressions_on_binary_rewards():
    for seed in range(5):
        r = binary(seed)
        o = GroupOutcomes(r, grpo_advantages(r))
        old_k = r.sum(dim=-1).round().long()
        assert torch.equal(o.successes, old_k) and o.successes.dtype == old_k.dtype
        old_sums = r.sum(dim=-1)
        old = ((old_sums == 0).float().mean(), (old_sums == r.shape[-1]).float().mean())
        new = group_outcome_fractions(r)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


def test_graft_selects_into_a_group_of_partial_passes():
    # A's prompt 0 has partial passes only; B solved it once. B's prompt 1 likewise, A solved it.
    a = [PARTIAL, [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    b = [[1.0, 0.0, 0.0, 0.0], [0.25, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    strict = GRAFT().plan({"a": outcomes_of(a), "b": outcomes_of(b)}, gen())
    assert [g.prompt for g in strict["a"].peer_groups] == [0]
    assert [g.prompt for g in strict["b"].peer_groups] == [1]
    assert strict["a"].diagnostics["candidates/b"] == 1.0
    # the peer group keeps the source's own advantages (from its rewards)
    torch.testing.assert_close(strict["a"].peer_groups[0].advantages, outcomes_of(b).advantages[0])
    # threshold 0.5: prompt 0 is mixed for A (k = 3), prompt 1 for B (k = 1): nothing moves
    lenient = GRAFT().plan({"a": outcomes_of(a, 0.5), "b": outcomes_of(b, 0.5)}, gen())
    assert lenient["a"].peer_groups == [] and lenient["b"].peer_groups == []
    # complementarity from the counts
    k_a, k_b = outcomes_of(a).successes, outcomes_of(b).successes
    assert float(complementarity(k_a, k_b)) == 1.0
    assert math.isnan(float(complementarity(outcomes_of(a, 0.5).successes, outcomes_of(b, 0.5).successes)))


# --------------------------------------------------------------------------------------------
# Success-only transfer, SGT's pick
# --------------------------------------------------------------------------------------------


def test_success_only_keeps_only_rewards_at_or_above_the_threshold():
    rewards = torch.tensor([PARTIAL, [1.0, 0.9, 0.0, 1.0]])
    assert success_only_keep(rewards).tolist() == [[False] * 4, [True, False, False, True]]
    assert success_only_keep(rewards, 0.5).tolist() == [[True, True, True, False], [True, True, False, True]]
    for seed in range(5):
        r = binary(seed)
        assert torch.equal(success_only_keep(r), r > 0.5)
    # through GRAFT: the source's partial pass (0.9) does not enter
    a = [[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]]
    b = [[1.0, 0.9, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    plans = GRAFT(transfer="success_only").plan({"a": outcomes_of(a), "b": outcomes_of(b)}, gen())
    (peer,) = plans["a"].peer_groups
    assert peer.keep is not None and peer.keep.tolist() == [True, False, False, True]


def _old_pick_one_success(
    rewards: torch.Tensor, prompts: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """pick_one_success as it was before the threshold."""
    picked = torch.zeros(rewards.shape, dtype=torch.bool)
    for p in prompts.nonzero().flatten().tolist():
        successes = (rewards[p] > 0.5).nonzero().flatten()
        if successes.numel():
            j = int(torch.randint(successes.numel(), (1,), generator=generator))
            picked[p, successes[j]] = True
    return picked


def test_sgt_picks_only_a_success():
    rewards = torch.tensor([PARTIAL, [0.75, 1.0, 0.5, 0.0]])
    prompts = torch.tensor([True, True])
    for seed in range(20):
        picked = pick_one_success(rewards, prompts, gen(seed))
        assert picked[0].tolist() == [False] * 4  # no success: nothing to pick
        assert picked[1].tolist() == [False, True, False, False]
        lenient = pick_one_success(rewards, prompts, gen(seed), 0.5)
        assert int(lenient[0].sum()) == 1 and bool((rewards[0][lenient[0]] >= 0.5).all())
        assert int(lenient[1].sum()) == 1 and bool((rewards[1][lenient[1]] >= 0.5).all())
    for seed in range(5):
        r = binary(seed)
        chosen = torch.rand(r.shape[0], generator=gen(seed + 100)) < 0.5
        assert torch.equal(
            pick_one_success(r, chosen, gen(seed)), _old_pick_one_success(r, chosen, gen(seed))
        )
    # through SGT: a receiver whose group holds partial passes only is eligible
    a = [PARTIAL, [1.0, 0.0, 0.0, 0.0]]
    b = [[0.9, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    plans = SGT().plan({"a": outcomes_of(a), "b": outcomes_of(b)}, gen())
    (nll,) = plans["a"].peer_groups
    assert nll.prompt == 0 and nll.keep is not None and nll.keep.tolist() == [False, True, False, False]


# --------------------------------------------------------------------------------------------
# The rescue round (method: hint) and served peers
# --------------------------------------------------------------------------------------------


class _Record:
    def __init__(self, reward: float) -> None:
        self.reward, self.response = reward, f"r{reward}"


def test_rescue_targets_need_a_full_success():
    method = build_method("hint")
    a = [PARTIAL, [0.0, 0.0, 0.0, 0.0]]
    b = [[0.75, 0.5, 1.0, 0.0], [0.5, 0.75, 0.0, 0.0]]
    outcomes = {"a": outcomes_of(a), "b": outcomes_of(b)}
    records = {name: [_Record(float(r)) for r in o.rewards.view(-1)] for name, o in outcomes.items()}
    targets = method.rescue_targets("a", outcomes, records)  # type: ignore[attr-defined]
    # prompt 0: A all-fail (partial passes), B's first success is its third response; prompt 1: B
    # has no success to give
    assert [(t.prompt, t.source, t.response) for t in targets] == [(0, "b", 2)]
    lenient = {"a": outcomes_of(a, 0.5), "b": outcomes_of(b, 0.5)}
    targets = method.rescue_targets("a", lenient, records)  # type: ignore[attr-defined]
    assert [(t.prompt, t.source, t.response) for t in targets] == [(1, "b", 0)]  # 0.5 is a success
    # the rescued outcomes keep the run's threshold
    rescued = method.rescued_outcomes(lenient["a"], [1], torch.tensor([[0.5, 0.0, 0.0, 0.0]]))  # type: ignore[attr-defined]
    assert rescued.success_threshold == 0.5 and rescued.successes.tolist() == [3, 1]


def test_rescue_counts_and_bonus_count_successes():
    rewards = torch.tensor([PARTIAL, [1.0, 0.5, 0.0, 0.0]])
    assert rescue_counts(rewards) == (2, 1)
    assert rescue_counts(rewards, 0.5) == (2, 2)
    plain = grpo_advantages(rewards)
    torch.testing.assert_close(
        rescued_advantages(rewards, bonus=0.5), plain + 0.5 * torch.tensor([[0.0] * 4, [1.0, 0, 0, 0]])
    )
    for seed in range(5):
        r = binary(seed)
        assert rescue_counts(r) == (r.shape[0], int((r > 0).any(dim=-1).sum()))
        old = grpo_advantages(r) + 0.3 * (r > 0).float()
        assert torch.equal(rescued_advantages(r, bonus=0.3), old)


def test_served_peers_are_asked_the_prompts_without_a_success():
    outcomes = {
        "a": outcomes_of([PARTIAL, [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
        "b": outcomes_of([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]),
    }
    assert all_fail_prompts(outcomes) == [0, 2]
    lenient = {name: GroupOutcomes(o.rewards, o.advantages, 0.5) for name, o in outcomes.items()}
    assert all_fail_prompts(lenient) == [2]
    for seed in range(5):
        binary_outcomes = {m: outcomes_of(binary(seed + 10 * i).tolist()) for i, m in enumerate("ab")}
        old = torch.stack([(o.rewards > 0).sum(dim=-1) == 0 for o in binary_outcomes.values()]).any(dim=0)
        assert all_fail_prompts(binary_outcomes) == old.nonzero().flatten().tolist()


def test_stored_peer_outcomes_carry_the_runs_threshold():
    group = [
        StoredTrajectory.from_record(
            TrajectoryRecord("q", 0, "peer", i, f"r{i}", r, 0.1 * i, -1.0, 3, 3, True),
            prompt_text="q",
            tokenizer_id="t",
            n=4,
        )
        for i, r in enumerate(PARTIAL)
    ]
    strict = peer_groups([group], 4)
    lenient = peer_groups([group], 4, success_threshold=0.5)
    assert strict.outcomes.success_threshold == 1.0 and strict.outcomes.successes.tolist() == [0]
    assert lenient.outcomes.success_threshold == 0.5 and lenient.outcomes.successes.tolist() == [3]
    assert torch.equal(strict.outcomes.advantages, lenient.outcomes.advantages)  # stored, unchanged


# --------------------------------------------------------------------------------------------
# The trainer: the config's threshold reaches every count
# --------------------------------------------------------------------------------------------


class _Rewards:
    """Scripted rewards in policy order (llama, then gpt2) at every step."""

    def __init__(self, patterns: list[list[list[float]]]) -> None:
        self.patterns, self.calls = patterns, 0

    def score(self, responses, answers) -> list[float]:
        pattern = self.patterns[self.calls % len(self.patterns)]
        self.calls += 1
        return [r for group in pattern for r in group]

    def close(self) -> None:
        pass


# llama: partial passes only on prompt 0; gpt2: on prompt 1; both mixed on prompts 2 and 3.
PARTIAL_CROSSED = [
    [PARTIAL, [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]],  # llama
    [[1.0, 1.0, 0.0, 0.0], [0.25, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]],  # gpt2
]


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_a_run_counts_successes_at_its_threshold(tiny_checkpoints, tmp_path, threshold):
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    torch.set_num_threads(1)
    raw = make_config(tiny_checkpoints, method="graft", steps=1)
    config = config_from_dict({**raw, "reward": {"success_threshold": threshold}})
    Trainer(config, tmp_path / "run", verifier=_Rewards(PARTIAL_CROSSED)).train()
    rows = {row["model"]: row for row in read_metrics(tmp_path / "run")}
    rewards = {name: torch.tensor(p) for name, p in zip(("llama", "gpt2"), PARTIAL_CROSSED, strict=True)}
    for name, row in rows.items():
        assert row["reward_mean"] == pytest.approx(float(rewards[name].mean()))  # the reward itself
    if threshold == 1.0:  # prompt 0 is all-fail for llama, prompt 1 for gpt2: one exchange each way
        assert rows["llama"]["all_fail_frac"] == 0.25 and rows["gpt2"]["all_fail_frac"] == 0.25
        assert rows["llama"]["complementarity/gpt2"] == 1.0
        assert rows["llama"]["selected/gpt2"] == 1.0 and rows["gpt2"]["selected/llama"] == 1.0
    else:  # every group mixed: no all-fail prompt, nothing moves
        assert rows["llama"]["all_fail_frac"] == 0.0 and rows["gpt2"]["all_fail_frac"] == 0.0
        assert rows["llama"].get("complementarity/gpt2") is None
        assert rows["llama"]["selected/gpt2"] == 0.0 and rows["gpt2"]["selected/llama"] == 0.0


# --------------------------------------------------------------------------------------------
# Evaluation: pass@1 and pass@k count successes
# --------------------------------------------------------------------------------------------


def _old_summarize(correct: list[list[float]]) -> dict:
    n = len(correct[0])
    counts = [round(sum(row)) for row in correct]
    by_k = {k: statistics.fmean(pass_at_k(n, c, k) for c in counts) for k in range(1, n + 1)}
    pass_1 = statistics.fmean(statistics.fmean(row) for row in correct)
    return {"pass_at_1": pass_1, "pass_at_k": {str(k): v for k, v in by_k.items()}}


def test_pass_at_k_counts_successes():
    rewards = [PARTIAL, [1.0, 0.5, 0.0, 0.0]]
    strict = summarize_benchmark(rewards)
    assert strict["pass_at_1"] == pytest.approx(0.125)  # one success in eight samples
    assert strict["pass_at_k"]["4"] == pytest.approx(0.5)  # the partial problem is never solved
    lenient = summarize_benchmark(rewards, 0.5)
    assert lenient["pass_at_1"] == pytest.approx(5 / 8) and lenient["pass_at_k"]["4"] == 1.0
    for seed in range(5):
        r = binary(seed, (16, 4)).tolist()
        assert summarize_benchmark(r) == _old_summarize(r)
        ints = [[int(x) for x in row] for row in r]
        assert summarize_benchmark(ints) == _old_summarize(ints)


class _Engine:
    max_batch_size = 64

    def reseed(self, seed: int) -> None:
        pass

    def generate(self, policy, prompts, params):
        return SimpleNamespace(texts=[f"{p}/{i}" for p in prompts for i in range(params.n)])


class _Verifier:
    def __init__(self, rewards: list[float]) -> None:
        self.rewards = rewards

    def score(self, texts, answers) -> list[float]:
        return self.rewards[: len(texts)]


def test_sample_correctness_marks_successes():
    problems = [SimpleNamespace(problem="p0", answer="0"), SimpleNamespace(problem="p1", answer="1")]
    verifier = _Verifier([*PARTIAL, 1.0, 0.5, 0.0, 0.0])
    strict = sample_correctness(None, problems, verifier, EvalProtocol(samples=4), 0, _Engine())  # type: ignore[arg-type]
    assert strict == [[0.0] * 4, [1.0, 0.0, 0.0, 0.0]]
    lenient_protocol = EvalProtocol(samples=4, success_threshold=0.5)
    lenient = sample_correctness(None, problems, verifier, lenient_protocol, 0, _Engine())  # type: ignore[arg-type]
    assert lenient == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    binary_rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    got = sample_correctness(None, problems, _Verifier(binary_rewards), EvalProtocol(samples=4), 0, _Engine())  # type: ignore[arg-type]
    assert got == [binary_rewards[:4], binary_rewards[4:]]  # 0/1: the rewards as they were


# --------------------------------------------------------------------------------------------
# Reports: correct / wrong splits, the store's complementarity, the probe's figures
# --------------------------------------------------------------------------------------------


def _compat_row(rewards: list[float], s: list[float]) -> dict:
    return {
        "receiver": "b",
        "source": ["a"] * len(rewards),
        "s": s,
        "reward": rewards,
        "w": [min(x, 1.0) if x > 0.8 else 0.0 for x in s],
        "advantage": [float(a) for a in grpo_advantages(torch.tensor([rewards]))[0]],
        "prompt_id": ["q"] * len(rewards),
    }


def test_gate_and_mass_split_correct_and_wrong_at_the_threshold():
    row = _compat_row([1.0, 0.75, 0.5, 0.0], [0.9, 0.95, 0.5, 0.85])
    strict = gate_by_outcome([row])["b"]
    assert strict["correct"].responses == 1 and strict["wrong"].responses == 3
    lenient = gate_by_outcome([row], threshold=0.5)["b"]
    assert lenient["correct"].responses == 3 and lenient["wrong"].responses == 1
    mass = advantage_mass([row], 4)["b"]  # type: ignore[index]
    lenient_mass = advantage_mass([row], 4, threshold=0.5)["b"]  # type: ignore[index]
    assert mass.net == pytest.approx(lenient_mass.net)  # the same pushes, split differently
    assert mass.correct < lenient_mass.correct
    # 0/1 rewards: the default threshold, 0.5 and "> 0" split alike (what `reward > 0` gave)
    binary_row = _compat_row([1.0, 0.0, 1.0, 0.0], [0.9, 0.95, 0.5, 0.85])
    for threshold in (0.5, 1e-9):
        assert gate_by_outcome([binary_row]) == gate_by_outcome([binary_row], threshold=threshold)
        assert advantage_mass([binary_row], 4) == advantage_mass([binary_row], 4, threshold=threshold)


def test_error_classes_read_only_the_responses_below_the_threshold():
    scores = [
        {"receiver": "b", "prompt_id": ["q"] * 3, "response": ["x", "y", "z"], "reward": [1.0, 0.5, 0.0]}
    ]
    classify = lambda problem, text: "copy" if text == "y" else "fact"  # noqa: E731
    outcomes = ("correct", "copy", "fact")
    strict = moved_error_classes(scores, {"q": "1+1"}, classify, outcomes)
    assert strict["b"] == {"wrong_responses": 2, "copy": 0.5, "fact": 0.5}
    lenient = moved_error_classes(scores, {"q": "1+1"}, classify, outcomes, threshold=0.5)
    assert lenient["b"] == {"wrong_responses": 1, "copy": 0.0, "fact": 1.0}


class _Store:
    """What the complementarity check reads of a trajectory store: one step, two sources."""

    def __init__(self, rewards: dict[str, list[list[float]]]) -> None:
        self.rows = [
            SimpleNamespace(source=source, group_index=g, prompt_id=f"q{g}", reward=r)
            for source, groups in rewards.items()
            for g, group in enumerate(groups)
            for r in group
        ]

    def verify(self):
        return SimpleNamespace(ok=True, __str__=lambda self: "ok")

    def steps(self) -> list[int]:
        return [0]

    def read_step(self, step: int, token_logprobs: bool = True):
        return self.rows


def test_the_store_check_recounts_complementarity_from_successes():
    store = _Store({"a": [PARTIAL, [1.0, 0.0, 0.0, 0.0]], "b": [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]})
    logged = Complementarity("a", "b", {0: 1.0})
    check_against_store([logged], store, [0], [])
    assert logged.store_by_step == {0: 1.0} and logged.mismatches == []
    lenient = Complementarity("a", "b", {0: 1.0})
    check_against_store([lenient], store, [0], [], threshold=0.5)
    assert lenient.store_by_step == {}  # a has no all-fail prompt at 0.5: undefined


def test_the_threshold_is_read_from_a_runs_config(tmp_path):
    assert success_threshold_of({"reward": {"success_threshold": 0.5}}) == 0.5
    assert success_threshold_of({}) == 1.0 and success_threshold_of({"reward": "x"}) == 1.0
    assert success_threshold_of({"reward": {"success_threshold": "high"}}) == 1.0
    assert run_success_threshold(tmp_path) == 1.0  # no config.yaml: the default
    (tmp_path / "config.yaml").write_text("reward:\n  success_threshold: 0.75\n")
    assert run_success_threshold(tmp_path) == 0.75
    (tmp_path / "config.yaml").write_bytes(b"\xff\xfe not yaml")
    assert run_success_threshold(tmp_path) == 1.0


def _probe_steps(rewards: dict[str, list[list[float]]]) -> list[StepData]:
    return [
        StepData(
            step=0,
            prompt_ids=[f"q{p}" for p in range(len(rewards["a"]))],
            rewards={m: torch.tensor(r) for m, r in rewards.items()},
            tokens={m: 0 for m in rewards},
            candidates=[],
            compatibility=[],
            moved_groups=[],
            costs={m: dict.fromkeys(COST_KEYS, 0.0) for m in rewards},
            wall=dict.fromkeys(WALL_KEYS, 0.0),
        )
    ]


def _settings(threshold: float) -> ProbeSettings:
    return ProbeSettings(
        config="c.yaml", method="grpo", seed=0, prompts=2, batch_prompts=2, n=4, delta=0.8,
        policies=["a", "b"], models=["a", "b"], backend="local", engine="hf", success_threshold=threshold,
    )  # fmt: skip


def test_the_probes_figures_count_successes():
    steps = _probe_steps({"a": [PARTIAL, [1.0, 0.0, 1.0, 0.0]], "b": [[1.0, 0.5, 0.0, 0.0], [0.0] * 4]})
    strict = probe_statistics(_settings(1.0), steps)
    assert strict["models"]["a"]["correct"] == 2 and strict["models"]["a"]["all_fail"] == 0.5
    assert strict["models"]["b"]["correct"] == 1 and strict["models"]["b"]["all_fail"] == 0.5
    (b_to_a,) = [p for p in strict["pairs"] if p["receiver"] == "a"]
    assert b_to_a["receiver_all_fail"] == 1 and b_to_a["solved_by_source"] == 1 and b_to_a["candidates"] == 1
    lenient = probe_statistics(_settings(0.5), steps)
    assert lenient["models"]["a"]["correct"] == 5 and lenient["models"]["a"]["all_fail"] == 0.0
    assert lenient["probe"]["success_threshold"] == 0.5
    # 0/1 rewards: the figures of the old count (the sums of the rewards)
    binary_steps = _probe_steps(
        {"a": [[0.0] * 4, [1.0, 0.0, 1.0, 0.0]], "b": [[1.0, 1.0, 0.0, 0.0], [0.0] * 4]}
    )
    figures = probe_statistics(_settings(1.0), binary_steps)
    for model in ("a", "b"):
        r = binary_steps[0].rewards[model]
        k = r.sum(dim=-1).round().long()
        assert figures["models"][model]["correct"] == int(r.sum())
        assert figures["models"][model]["all_fail"] == int((k == 0).sum()) / 2
        assert figures["models"][model]["all_pass"] == int((k == 4).sum()) / 2
    # an older probe.json (no threshold recorded) recounts as 0/1 rewards were counted
    old = {k: v for k, v in figures["probe"].items() if k != "success_threshold"}
    assert ProbeSettings(**old).success_threshold == 1.0


def test_all_fail_signal_counts_the_all_fail_groups_partial_credit_still_ranks():
    """Of four groups: one mixed, one all-fail with partial rewards that differ (GRPO learns there),
    one all-fail at equal partial rewards, one all zero: only the second has a signal without a
    success; with 0.5 counted a success it is mixed instead, and no group is all-fail with a signal."""
    rewards = torch.tensor([[1.0, 0.5, 0.0], [0.5, 0.0, 0.5], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    assert float(all_fail_signal_fraction(rewards)) == 0.25
    assert float(all_fail_signal_fraction(rewards, threshold=0.5)) == 0.0
    assert float(all_fail_signal_fraction((rewards == 1.0).float())) == 0.0  # 0/1 rewards: never
