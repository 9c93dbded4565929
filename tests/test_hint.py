"""`method: hint` (CoRe's rescue round, algorithm.md §3.1): the hint's text and its fit to the
context, which prompts are rescued and the rescued group's advantages, and the round inside real
training steps on the tiny pair, a stored peer, K = 3 and the embedded pair."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import CROSSED, make_config

from graftrl.config import config_from_dict
from graftrl.core.advantages import grpo_advantages
from graftrl.core.hint import NO_PEER, rescue_counts, rescue_sources, rescued_advantages
from graftrl.methods import GroupOutcomes, build_method
from graftrl.methods.hint import DEFAULT_TEMPLATE, hint_text, hinted_problem
from graftrl.models.prompts import fit_hint
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer

RESPONSE = "ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{42}."


class RescueRewards:
    """``CROSSED``'s cold rounds (one call per policy, in policy order, each P x n) and, for a
    rescue round (any other size of call), ``rescue`` per rescued group: the pattern of a forced
    exchange, everything else real."""

    def __init__(self, rescue: Sequence[float], cold: Sequence[list[list[float]]] = CROSSED) -> None:
        self.cold, self.rescue = cold, list(rescue)
        self.cold_calls = 0
        self.rescue_calls: list[int] = []
        """The size of each rescue round's call."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        pattern = self.cold[self.cold_calls % len(self.cold)]
        if len(responses) == sum(len(g) for g in pattern):
            self.cold_calls += 1
            return [r for g in pattern for r in g]
        self.rescue_calls.append(len(responses))
        return [self.rescue[i % len(self.rescue)] for i in range(len(responses))]

    def close(self) -> None:
        pass


# ----- the math ----------------------------------------------------------------------------------


def test_rescue_sources_pick_the_peer_with_most_successes_on_the_receivers_all_fail_prompts():
    receiver = torch.tensor([0, 0, 0, 2])
    peers = torch.tensor([[0, 1, 2, 3], [0, 3, 2, 0]])  # [K = 2, P = 4]
    # prompt 0: no peer success (no rescue); 1: peer 1 has more; 2: a tie goes to the first; 3: solved
    assert rescue_sources(receiver, peers).tolist() == [NO_PEER, 1, 0, NO_PEER]
    assert rescue_sources(receiver, torch.zeros(0, 4, dtype=torch.long)).tolist() == [NO_PEER] * 4


def test_rescued_advantages_are_grpo_of_their_own_rewards_and_the_bonus_goes_to_successes():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    plain = rescued_advantages(rewards)
    assert torch.equal(plain, grpo_advantages(rewards))
    assert plain[1].abs().sum() == 0 and plain[2].abs().sum() == 0  # no contrast, no signal
    bonus = rescued_advantages(rewards, bonus=0.5)
    assert torch.allclose(bonus - plain, 0.5 * (rewards > 0).float())
    assert rescue_counts(rewards) == (3, 2)


# ----- the hint's text ------------------------------------------------------------------------------


def test_hint_forms():
    assert hint_text(RESPONSE, "solution") == RESPONSE
    # plan: the reasoning, cut back to the sentence before the boxed answer
    assert hint_text(RESPONSE, "plan") == "ones 7+5=12, write 2 carry 1; tens 3+1=4."
    assert "42" not in hint_text(RESPONSE, "plan")
    # no boxed answer: the response without its last line
    assert hint_text("step one\nstep two\nso 12", "plan") == "step one\nstep two"
    assert hint_text(RESPONSE, "prefix", 0.25) == RESPONSE[: -(-len(RESPONSE) // 4)].rstrip()
    assert hint_text(RESPONSE, "prefix", 1.0) == RESPONSE
    assert hinted_problem(DEFAULT_TEMPLATE, "3+4", "add") == "3+4\nHint: add\n"


def test_hint_section_refuses_a_template_without_its_fields(tiny_checkpoints):
    config = make_config(tiny_checkpoints, method="hint")
    with pytest.raises(ValueError, match=r"template: must hold \{hint\}"):
        config_from_dict({**config, "hint": {"template": "{problem} and nothing else"}})
    with pytest.raises(ValueError, match="fraction"):
        config_from_dict({**config, "hint": {"form": "prefix", "fraction": 0}})


def test_a_hint_longer_than_the_context_is_cut_to_fit(tiny_checkpoints):
    from graftrl.models.policy import Policy

    policy = Policy.from_pretrained("gpt2", tiny_checkpoints["gpt2"], template="Q: {problem}\nA: ")
    count = lambda text: len(policy.encode_prompts([text])[0])  # noqa: E731
    build = lambda h: hinted_problem(DEFAULT_TEMPLATE, "3+4", h)  # noqa: E731
    long_hint = "carry the one " * 200
    assert count(build(long_hint)) > 60
    text, cut = fit_hint(build, long_hint, count, budget=60)
    assert cut and count(text) <= 60 and text.startswith("3+4\nHint: carry the one")
    # one more character no longer fits: the longest head
    head = text[len("3+4\nHint: ") : -1]
    assert count(build(long_hint[: len(head) + 2])) > 60 or len(head) + 2 > len(long_hint)
    assert fit_hint(build, "short", count, budget=None) == (build("short"), False)
    assert fit_hint(build, long_hint, count, budget=count(build(""))) is None  # nothing fits


# ----- the rescue round inside a step ----------------------------------------------------------------


def test_the_rescue_round_replaces_the_all_fail_groups(tiny_checkpoints, tmp_path):
    """CROSSED: llama fails prompt 0 (gpt2 mixed there), gpt2 fails prompt 1 (llama mixed)."""
    config = config_from_dict(
        {**make_config(tiny_checkpoints, method="hint", steps=1), "hint": {"rescue_bonus": 0.5}}
    )
    verifier = RescueRewards([1.0, 0.0, 0.0, 0.0])
    trainer = Trainer(config, tmp_path / "run", verifier=verifier)
    planned = trainer.exchange(0, trainer.sampler.batch(0))
    assert verifier.rescue_calls == [4, 4]  # one prompt x n = 4 each
    for receiver, prompt, peer in (("llama", 0, "gpt2"), ("gpt2", 1, "llama")):
        outcome = planned.outcomes[receiver]
        assert outcome.rewards[prompt].tolist() == [1.0, 0.0, 0.0, 0.0]
        expected = rescued_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), bonus=0.5)[0]
        assert torch.allclose(outcome.advantages[prompt], expected)
        # the other groups keep their cold-round rewards and advantages
        cold = torch.tensor(CROSSED[0 if receiver == "llama" else 1], dtype=torch.float32)
        others = [p for p in range(4) if p != prompt]
        assert torch.equal(outcome.rewards[others], cold[others])
        assert torch.equal(planned.shared[receiver].rewards, cold)  # complementarity: the cold round
        diagnostics = planned.plans[receiver].diagnostics
        assert diagnostics["rescue_attempted"] == 1 and diagnostics["rescue_solved"] == 1
        assert diagnostics["rescue_rate"] == 1.0 and diagnostics[f"rescue/{peer}"] == 1
        # every trained group is the receiver's own: nothing of the peer enters the gradient
        assert all(not g.peer and g.source == receiver for g in planned.plans[receiver].groups)
        # the records stay the cold round's (what the store and the probe's samples hold)
        assert [r.reward for r in planned.records[receiver][prompt * 4 : prompt * 4 + 4]] == [0.0] * 4
    # on-policy (condition: hinted): the group's prompt ids are the hinted prompt the responses
    # were sampled from, the peer's response inside it (a tokenizer without a chat template: the
    # policy's own template wraps the hinted problem)
    llama = trainer.workers[0]
    peer_response = planned.records["gpt2"][0 * 4 + 0].response  # gpt2's first success on prompt 0
    problem = trainer.sampler.batch(0)[0].problem
    method = trainer.method
    hinted = hinted_problem(DEFAULT_TEMPLATE, problem, method.hint_for(peer_response))  # type: ignore[attr-defined]
    fitted = fit_hint(
        lambda h: hinted_problem(DEFAULT_TEMPLATE, problem, h),
        method.hint_for(peer_response),  # type: ignore[attr-defined]
        lambda t: len(llama.policy.encode_prompts([t])[0]),
        llama.policy.context_length - config.rollout.max_new_tokens,
    )
    assert fitted is not None and fitted[0] == hinted
    assert llama._rollout.prompt_ids[0] == llama.policy.encode_prompts([hinted])[0]
    assert (
        llama._rollout.prompt_ids[1] == llama.policy.encode_prompts([trainer.sampler.batch(0)[1].problem])[0]
    )
    trainer.close()


def test_condition_original_keeps_the_cold_prompt(tiny_checkpoints, tmp_path):
    config = config_from_dict(
        {**make_config(tiny_checkpoints, method="hint", steps=1), "hint": {"condition": "original"}}
    )
    trainer = Trainer(config, tmp_path / "run", verifier=RescueRewards([1.0, 0.0, 0.0, 0.0]))
    problems = trainer.sampler.batch(0)
    trainer.exchange(0, problems)
    llama = trainer.workers[0]
    assert llama._rollout.prompt_ids[0] == llama.policy.encode_prompts([problems[0].problem])[0]
    trainer.close()


def test_no_peer_success_means_no_rescue_round(tiny_checkpoints, tmp_path):
    both_fail = [[[0, 0, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1]]] * 2  # prompt 0: nobody solved it
    config = config_from_dict(make_config(tiny_checkpoints, method="hint", steps=1))
    verifier = RescueRewards([1.0], cold=both_fail)
    trainer = Trainer(config, tmp_path / "run", verifier=verifier)
    planned = trainer.exchange(0, trainer.sampler.batch(0))
    assert verifier.rescue_calls == []
    for receiver in ("llama", "gpt2"):
        assert planned.plans[receiver].diagnostics["rescue_attempted"] == 0
        assert torch.equal(
            planned.outcomes[receiver].rewards, torch.tensor(both_fail[0], dtype=torch.float32)
        )
    trainer.close()


def test_hint_trains_and_logs_its_rescue_round(tiny_checkpoints, tmp_path):
    config = config_from_dict(make_config(tiny_checkpoints, method="hint", steps=2))
    trainer = Trainer(config, tmp_path / "run", verifier=RescueRewards([0.0, 1.0, 0.0, 0.0]))
    before = {k: v.clone() for k, v in trainer.policies[0].model.state_dict().items()}
    trainer.train()
    after = trainer.policies[0].model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4 and all(r["method"] == "hint" and r["rescue_attempted"] == 1 for r in rows)
    assert all(r["rescue_rate"] == 1.0 and r["time_rollout"] > 0 for r in rows)
    # rescues.jsonl: each rescued response, its hinted prompt and reward (texts: logging.log_transfers)
    from graftrl.storage.log_keys import RESCUE_KEYS, row_problem, undeclared_keys
    from graftrl.storage.rundir import RunDir, read_jsonl

    rescues = read_jsonl(RunDir(tmp_path / "run").rescues)
    assert len(rescues) == 2 * 2 * 4  # steps x receivers x n
    assert undeclared_keys(rescues, RESCUE_KEYS) == [] and all(
        row_problem(r, RESCUE_KEYS) is None for r in rescues
    )
    assert [r["reward"] for r in rescues[:4]] == [0.0, 1.0, 0.0, 0.0] and [
        r["index"] for r in rescues[:4]
    ] == [0, 1, 2, 3]
    assert {(r["receiver"], r["source"]) for r in rescues} == {("llama", "gpt2"), ("gpt2", "llama")}
    assert all("\nHint: " in r["hinted"] and "response" not in r for r in rescues)


def test_compare_counts_the_rescue_rollouts(tiny_checkpoints, tmp_path):
    from graftrl.experiments.cells import _compute_per_model
    from graftrl.storage.rundir import RunDir, read_jsonl

    raw = make_config(tiny_checkpoints, method="hint", steps=2)
    config = config_from_dict({**raw, "logging": {**raw["logging"], "log_transfers": True}})
    Trainer(config, tmp_path / "run", verifier=RescueRewards([0.0, 1.0, 0.0, 0.0])).train()
    # 2 steps x (4 prompts + 1 rescued) x n = 4
    assert _compute_per_model(tmp_path / "run", 4, 4)["rollouts_per_model"] == 2 * 5 * 4
    # with logging.log_transfers the rescued responses' texts are logged, for their errors
    assert all(isinstance(r["response"], str) for r in read_jsonl(RunDir(tmp_path / "run").rescues))


def test_k3_rescue_targets_take_any_peer():
    method = build_method("hint")
    n = 2
    outcomes = {
        "a": GroupOutcomes(torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]), torch.zeros(3, n)),
        "b": GroupOutcomes(torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]), torch.zeros(3, n)),
        "c": GroupOutcomes(torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]), torch.zeros(3, n)),
    }

    class Record:
        def __init__(self, reward: float) -> None:
            self.reward, self.response = reward, f"r{reward}"

    records = {name: [Record(float(r)) for r in o.rewards.view(-1)] for name, o in outcomes.items()}
    targets = method.rescue_targets("a", outcomes, records)  # type: ignore[attr-defined]
    assert [(t.prompt, t.source, t.response) for t in targets] == [(1, "c", 0)]  # c: 2 successes > b: 1
    targets = method.rescue_targets("b", outcomes, records)  # type: ignore[attr-defined]
    assert [(t.prompt, t.source, t.response) for t in targets] == [(2, "a", 0)]


def test_with_a_stored_peer_the_hint_is_the_stored_successful_response(tiny_checkpoints, tmp_path):
    from conftest import ScriptedRewards

    from graftrl.storage.store import TrajectoryStore

    llama_cold, gpt2_cold = CROSSED
    record = make_config(tiny_checkpoints, method="grpo", steps=1)
    record = {**record, "policies": record["policies"][1:], "store": {"record": True}}
    Trainer(config_from_dict(record), tmp_path / "gpt2", verifier=ScriptedRewards([gpt2_cold])).train()
    stored = sorted(
        TrajectoryStore(tmp_path / "gpt2" / "store").read_step(0), key=lambda r: (r.group_index, r.index)
    )
    config = make_config(tiny_checkpoints, method="hint", steps=1)
    config = {
        **config,
        "policies": config["policies"][:1],
        "peers": [{"name": "gpt2", "path": str(tmp_path / "gpt2" / "store")}],
    }
    verifier = RescueRewards([1.0, 1.0, 0.0, 0.0], cold=[llama_cold, gpt2_cold])
    trainer = Trainer(config_from_dict(config), tmp_path / "llama", verifier=verifier)
    planned = trainer.exchange(0, trainer.sampler.batch(0))
    assert verifier.rescue_calls == [4]  # llama's prompt 0, which the stored gpt2 solved
    assert planned.plans["llama"].diagnostics["rescue/gpt2"] == 1
    assert planned.outcomes["llama"].rewards[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    llama = trainer.workers[0]
    hint = trainer.method.hint_for(stored[0].response)  # type: ignore[attr-defined]
    problem = trainer.sampler.batch(0)[0].problem
    assert (
        llama._rollout.prompt_ids[0]
        == llama.policy.encode_prompts([hinted_problem(DEFAULT_TEMPLATE, problem, hint)])[0]
    )
    trainer.close()


def test_hint_refuses_a_run_without_a_peer(tiny_checkpoints):
    config = make_config(tiny_checkpoints, method="hint")
    with pytest.raises(ValueError, match="needs a peer"):
        config_from_dict({**config, "policies": config["policies"][:1]})
    with pytest.raises(ValueError, match=r"rollout\.tis_cap"):
        config_from_dict(
            {**config, "hint": {"condition": "original"}, "rollout": {**config["rollout"], "tis_cap": 2.0}}
        )


def test_graftrl_train_runs_hint_on_the_embedded_pair_from_a_user_config(tmp_path):
    """A user's YAML (the shipped embedded pair by path, its task's problems, a `hint:` section)
    through `graftrl train`, with the real verifier: the rescue round runs on real failures."""
    import yaml
    from typer.testing import CliRunner

    from graftrl.cli import app
    from graftrl.embedded.base import write_problems
    from graftrl.embedded.models import MODEL_SPECS
    from graftrl.embedded.shipped import SHIPPED_DIR
    from graftrl.embedded.task import get_task, make_split

    train, _ = make_split(seed=0, n_train=64, n_eval=8, task="worked")
    write_problems(train, tmp_path / "train.jsonl")
    policies = [
        {
            "name": name,
            "path": str(next(SHIPPED_DIR.glob(f"{name}-*"))),
            "template": MODEL_SPECS[name]["template"],
        }
        for name in ("llama-char", "gpt2-bpe")
    ]
    config = {
        "method": "hint",
        "hint": {"form": "prefix", "fraction": 0.5},
        "policies": policies,
        "data": {"train": str(tmp_path / "train.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 4, "temperature": 1.0, "max_new_tokens": get_task("worked").max_new_tokens},
        "train": {"steps": 2, "batch_prompts": 16, "minibatch_prompts": 8, "micro_batch_size": 64},
        "logging": {"progress": False},
    }
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "pair.yaml"), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4 and {r["method"] for r in rows} == {"hint"}
    attempted = sum(r["rescue_attempted"] for r in rows)
    assert attempted > 0  # the pair's complementary families: each fails prompts the other solves
    assert sum(r["rescue_solved"] for r in rows) <= attempted


def test_compares_hint_preset_puts_hint_beside_the_mastery_cells(tiny_checkpoints, tmp_path):
    import yaml
    from conftest import write_sums
    from typer.testing import CliRunner

    from graftrl.cli import app
    from graftrl.experiments.matrix import preset_matrix

    hint, mastery = preset_matrix("hint"), preset_matrix("mastery")
    assert [v.name for v in hint.variants] == ["grpo", "graft", "success-only", "sgt", "hint"]
    # the mastery line's cells unchanged (reused by digest), the hint method beside them
    assert hint.variants[:4] == mastery.variants and hint.baseline == mastery.baseline
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(make_config(tiny_checkpoints)))
    bench = f"b={write_sums(tmp_path / 'b.jsonl', 4, 1, 'b')}"
    listed = CliRunner().invoke(
        app, ["compare", "--base", str(base), "--preset", "hint", "--bench", bench, "--list-cells"]
    )
    assert listed.exit_code == 0, listed.output
    assert listed.output.split() == ["warm-start", *(f"{v.name}-seed0" for v in hint.variants)]


def test_the_probe_reports_the_rescue_rate(tiny_checkpoints, tmp_path):
    from graftrl.experiments.probe import run_probe
    from graftrl.reporting.probe_stats import recount

    config = config_from_dict(make_config(tiny_checkpoints, method="hint"))
    # CROSSED: each model fails one prompt the other solved, per step of 4; the hint solves 1 of 4
    result = run_probe(
        config, tmp_path / "probe", 8, verifier=RescueRewards([0.0, 0.0, 1.0, 0.0]), progress=False
    )
    rescue = result.figures["rescue"]
    assert rescue == {
        "llama": {"attempted": 2, "solved": 2, "rescue_rate": 1.0},
        "gpt2": {"attempted": 2, "solved": 2, "rescue_rate": 1.0},
    }
    assert recount(tmp_path / "probe")["rescue"] == rescue  # from the files alone
    # the cold round stays what the samples and the pairs' figures count
    assert {p["receiver"]: p["receiver_all_fail"] for p in result.figures["pairs"]} == {"llama": 2, "gpt2": 2}
    # every candidate group of the cold round is scored, the rescued (now solved) prompts' included
    assert all(p["candidates"] == 2 and p["scored"]["responses"] == 2 * 4 for p in result.figures["pairs"])
    assert "rescue rate" in (tmp_path / "probe" / "probe.md").read_text()


def test_a_probe_without_a_rescue_round_has_no_rescue_figures(tiny_checkpoints, tmp_path):
    from conftest import ScriptedRewards

    from graftrl.experiments.probe import run_probe

    config = config_from_dict(make_config(tiny_checkpoints, method="grpo"))
    result = run_probe(config, tmp_path / "probe", 4, verifier=ScriptedRewards(CROSSED), progress=False)
    assert "rescue" not in result.figures


def test_sweep_takes_the_hint_preset_for_the_mastery_line_only(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from graftrl.cli import app

    ran = {}
    monkeypatch.setattr(
        "graftrl.experiments.sweep.run_points",
        lambda out, points, settings, knob, console: ran.update(preset=knob.preset, points=points),
    )
    result = CliRunner().invoke(
        app, ["sweep", "--knob", "mastery", "--preset", "hint", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert ran["preset"] == "hint"
    wrong = CliRunner().invoke(
        app, ["sweep", "--knob", "mastery", "--preset", "table1", "--out", str(tmp_path)]
    )
    assert wrong.exit_code == 2 and "--preset: `mastery`, `hint` or `rule`" in wrong.output
    overlap = CliRunner().invoke(app, ["sweep", "--preset", "hint", "--out", str(tmp_path)])
    assert overlap.exit_code == 2 and "--preset goes with --knob mastery" in overlap.output


def test_the_hint_sits_in_the_user_turn_with_a_chat_template_and_in_the_template_without(
    tiny_checkpoints, tmp_path
):
    import shutil

    from transformers import AutoTokenizer

    from graftrl.models.policy import Policy

    hinted = hinted_problem(DEFAULT_TEMPLATE, "3+4", hint_text(RESPONSE, "plan"))
    plain = Policy.from_pretrained("gpt2", tiny_checkpoints["gpt2"], template="Q: {problem}\nA: ")
    assert plain.tokenizer.chat_template is None  # no chat template: the policy's own template wraps it
    assert plain.format_prompt(hinted) == f"Q: {hinted}\nA: "
    chatty = shutil.copytree(tiny_checkpoints["gpt2"], tmp_path / "gpt2-chat")
    tokenizer = AutoTokenizer.from_pretrained(chatty)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(chatty)
    chat = Policy.from_pretrained("gpt2", chatty, chat_template=True)
    assert chat.format_prompt(hinted) == f"<|user|>{hinted}<|end|><|assistant|>"
    # the fit counts the chat template's tokens too
    count = lambda text: len(chat.encode_prompts([text])[0])  # noqa: E731
    build = lambda h: hinted_problem(DEFAULT_TEMPLATE, "3+4", h)  # noqa: E731
    budget = count(build("")) + 5
    text, cut = fit_hint(build, RESPONSE, count, budget)
    assert cut and count(text) <= budget


def test_hint_resumes_exactly(tiny_checkpoints, tmp_path):
    """The rescue round's draws come from (seed, step, stream): a resumed run samples, trains and
    logs what an uninterrupted one does (rescues.jsonl included)."""
    from conftest import comparable_metrics, weights_of

    from graftrl.storage.rundir import RunDir

    raw = make_config(tiny_checkpoints, method="hint", steps=3)
    rescue = [0.0, 1.0, 0.0, 0.0]
    full = Trainer(config_from_dict(raw), tmp_path / "full", verifier=RescueRewards(rescue))
    full.train()
    cut = {**raw, "checkpoint": {"every": 1, "keep_last": 5}}
    Trainer(
        config_from_dict({**cut, "train": {**cut["train"], "steps": 2}}),
        tmp_path / "cut",
        verifier=RescueRewards(rescue),
    ).train()
    resumed = Trainer(config_from_dict(cut), tmp_path / "cut", verifier=RescueRewards(rescue))
    resumed.train(resume=True)
    assert resumed.start_step == 2
    full_weights, resumed_weights = weights_of(full), weights_of(resumed)
    assert all(torch.equal(value, resumed_weights[key]) for key, value in full_weights.items())
    assert comparable_metrics(tmp_path / "full") == comparable_metrics(tmp_path / "cut")
    assert RunDir(tmp_path / "full").rescues.read_text() == RunDir(tmp_path / "cut").rescues.read_text()


def test_in_a_step_a_hint_longer_than_the_context_is_cut_to_fit(tiny_checkpoints, tmp_path):
    """512 positions, 412 of them for the response: a prompt holds 100 tokens, and the llama's
    characters leave a long hint a few of them."""
    raw = make_config(tiny_checkpoints, method="hint", steps=1)
    raw = {**raw, "rollout": {**raw["rollout"], "max_new_tokens": 412}, "hint": {"form": "solution"}}
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=RescueRewards([1.0, 0.0, 0.0, 0.0]))
    planned = trainer.exchange(0, trainer.sampler.batch(0))
    llama = trainer.workers[0]
    budget = llama.policy.context_length - 412
    diagnostics = planned.plans["llama"].diagnostics
    assert diagnostics["rescue_truncated"] == diagnostics["rescue_attempted"] == 1
    hinted = llama._rollout.prompt_ids[0]
    assert len(hinted) == budget  # the longest head that fits (one character, one token)
    trainer.close()
