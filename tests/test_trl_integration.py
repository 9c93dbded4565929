"""graftrl.integrations.trl against TRL itself (tier ``-m trl``, in the TRL venv).

Runs in ``.venv-trl`` (``bash scripts/setup_trl.sh``): ``.venv-trl/bin/python -m pytest -m trl``.

- Equivalence: one GraftGRPOTrainer step and one ``graftrl train`` step against the same stored
  peer, from the same weights, prompts and injected rollouts, give the same transfer plan,
  compatibility scores and weights, loss, gradients and updated weights. The two differences by
  design are isolated in their own test: TRL's ``dapo`` denominator is the generation batch's token
  count spread evenly over its optimizer steps (graftrl: each minibatch's own count), and TRL
  shuffles rows across the generation batch (graftrl keeps groups whole).
- Without a transfer, GraftGRPOTrainer is TRL's GRPOTrainer bit for bit.
- Record -> store -> replay: a RecordingGRPOTrainer run is a stored peer for ``graftrl train`` and
  for GraftGRPOTrainer.
- Continuous rewards (a fraction of tests passed): both trainers record them as they are, and
  GraftGRPOTrainer counts successes at ``graft_success_threshold``.
- Refusals: one line each, before training.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from graftrl.config import config_from_dict
from graftrl.core import compatibility_weight, grpo_advantages, transfer_candidates
from graftrl.integrations.trl import StoredPeer, TRLIntegrationError
from graftrl.integrations.trl.exchange import IS_PEER
from graftrl.models.policy import Policy
from graftrl.models.rollout import RolloutBatch, content_mean_logprob
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.storage.rundir import read_metrics
from graftrl.storage.store import StoredTrajectory, StoreError, TrajectoryStore, TrajectoryWriter

# Deselected by default (pyproject addopts); `-m trl` runs it where TRL is installed.
pytestmark = pytest.mark.trl

TEMPLATE = "{problem}="
N = 4
# Four prompts of one length (5 characters with the template): no left padding, so TRL's forward
# (no position ids) and graftrl's (position ids skipping padding) see identical inputs.
PROBLEMS = [
    MathProblem("p0", "12+3", "15"),
    MathProblem("p1", "45+6", "51"),
    MathProblem("p2", "78-9", "69"),
    MathProblem("p3", "23+4", "27"),
]
# Per prompt: the receiver's injected rollout and the stored peer's group, as (text, finished, reward);
# the peer's target compatibility s sets its stored mean log-prob. p0 and p1: the receiver fails all
# n, the peer is mixed (both transfer); p2: the receiver is mixed; p3: the receiver passes all.
OWN = {
    "p0": [("1", True, 0), ("x=2", False, 0), ("17", True, 0), ("ab", True, 0)],
    "p1": [("50", True, 0), ("y", True, 0), ("5", False, 0), ("49+", True, 0)],
    "p2": [("69", True, 1), ("68", True, 0), ("6", False, 0), ("69.", True, 1)],
    "p3": [("27", True, 1), ("2 7", True, 1), ("027", True, 1), ("27!", False, 1)],
}
PEER = {
    "p0": [
        ("2+3=5, so 15", True, 1, 1.3),
        ("it is 14", True, 0, 0.95),
        ("15", True, 1, 0.85),
        ("16 ok", False, 0, 0.5),
    ],
    "p1": [("5+6=11", True, 0, 0.7), ("so 51", True, 1, 1.0), ("=51", False, 1, 0.9), ("51.", True, 1, 1.1)],
    "p2": [("69", True, 1, 1.0), ("sixty-nine", True, 0, 1.0), ("69", True, 1, 1.0), ("70", True, 0, 1.0)],
    "p3": [("27", True, 1, 1.0), ("28", True, 0, 1.0), ("26", True, 0, 1.0), ("29", True, 0, 1.0)],
}
LR = 1e-3


def rewards_of(table: dict[str, list[tuple]]) -> dict[str, list[float]]:
    return {pid: [float(item[2]) for item in group] for pid, group in table.items()}


REWARD_OF_TEXT = {
    item[0]: float(item[2]) for table in (OWN, PEER) for group in table.values() for item in group
}
# a text that appears in both tables must score alike (here: the correct answers)
assert all(REWARD_OF_TEXT[item[0]] == item[2] for table in (OWN, PEER) for g in table.values() for item in g)


class LookupVerifier:
    """graftrl's verifier interface: the reward of a response text from the tables."""

    def score(self, responses, answers):
        return [REWARD_OF_TEXT[r] for r in responses]

    def close(self):
        pass


def lookup_reward(completions, **kwargs):
    """The same rewards as a TRL reward function."""
    return [REWARD_OF_TEXT[c] for c in completions]


def text_reward(completions, **kwargs):
    """About 1 in 3 completions of a random model is 'correct' (a pure function of the text)."""
    return [float(zlib.crc32(c.encode()) % 3 == 0) for c in completions]


# ----- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def order() -> list[MathProblem]:
    """graftrl's step-0 prompt batch (TRL's dataset is given in this order, unshuffled)."""
    return PromptSampler(PROBLEMS, len(PROBLEMS), seed=0).batch(0)


def own_ids(policy: Policy, text: str, finished: bool) -> list[int]:
    return policy.encode_response(text, finished)


@pytest.fixture(scope="module")
def peer_store(tiny_checkpoints, tmp_path_factory) -> Path:
    """The stored peer's step 0: PEER's groups, mean log-probs set so that the receiver's initial
    weights give the target compatibility s of each response."""
    policy = Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]), template=TEMPLATE)
    rows = []
    for group_index, problem in enumerate(PROBLEMS):
        group = PEER[problem.id]
        rewards = torch.tensor([[item[2] for item in group]], dtype=torch.float32)
        advantages = grpo_advantages(rewards)[0]
        for index, (text, finished, reward, s) in enumerate(group):
            ids = policy.encode_response(text, finished)
            logprobs = policy.score(policy.encode_prompts([problem.problem]), [ids])[0]
            receiver_mean = content_mean_logprob(logprobs, finished)
            rows.append(
                StoredTrajectory(
                    prompt_id=problem.id,
                    step=0,
                    source="gpt2",
                    index=index,
                    response=text,
                    reward=float(reward),
                    advantage=float(advantages[index]),
                    mean_logprob=min(receiver_mean - math.log(s), 0.0),
                    num_tokens=max(1, len(text) // 2),
                    num_bytes=len(text.encode()),
                    finished=finished,
                    prompt_text=problem.problem,
                    tokenizer_id="gpt2@test",
                    n=N,
                    group_index=group_index,
                )
            )
    root = tmp_path_factory.mktemp("peer-store")
    TrajectoryWriter(root).write_step(0, rows)
    return root


class FakeEngine:
    """graftrl's rollout engine, returning OWN's responses with the policy's exact log-probs."""

    def generate(self, policy, prompts, sampling, seed, **kwargs):
        by_problem = {p.problem: p.id for p in PROBLEMS}
        prompt_ids = policy.encode_prompts(prompts)
        responses, finished, texts, repeated = [], [], [], []
        for prompt, ids in zip(prompts, prompt_ids, strict=True):
            for text, done, _ in OWN[by_problem[prompt]]:
                responses.append(policy.encode_response(text, done))
                finished.append(done)
                texts.append(text)
                repeated.append(ids)
        logprobs = policy.score(repeated, responses)
        return RolloutBatch(prompt_ids, responses, logprobs, finished, texts, sampling.n)

    def sync_weights(self, policy):
        pass

    def reseed(self, seed):
        pass

    def close(self):
        pass


@dataclass
class GraftrlStep:
    loss: float
    metrics: dict[str, Any]
    s: list[float]
    rewards: list[float]
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


def graftrl_step(checkpoints, store: Path, order, tmp_path: Path, graft: dict[str, Any]) -> GraftrlStep:
    """One `graftrl train` step of the llama against the stored peer, rollout injected."""
    from graftrl.training.trainer import Trainer

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n" for p in PROBLEMS)
    )
    config = {
        "method": "graft",
        "seed": 0,
        "policies": [{"name": "llama", "path": str(checkpoints["llama"]), "template": TEMPLATE}],
        "peers": [{"name": "gpt2", "path": str(store), "match": "step"}],
        "data": {"train": str(data), "prompt_suffix": None},
        "rollout": {"n": N, "max_new_tokens": 16},
        # TRL's advantage eps (1e-4) so both sides compute the same own advantages
        "train": {
            "steps": 1,
            "batch_prompts": 4,
            "minibatch_prompts": 4,
            "micro_batch_size": 64,
            "adv_eps": 1e-4,
        },
        "optim": {"lr": LR, "weight_decay": 0.0, "grad_clip": 1e6},
        "logging": {"progress": False},
        "graft": graft,
    }
    run = tmp_path / "graftrl"
    trainer = Trainer(config_from_dict(config), run, verifier=LookupVerifier())
    assert [p.id for p in trainer.sampler.batch(0)] == [p.id for p in order]
    worker = trainer.workers[0]
    worker.engine = FakeEngine()
    grads: dict[str, torch.Tensor] = {}
    optimizer = worker.policy.optimizer
    original = optimizer.step

    def step(*args, **kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in worker.policy.model.named_parameters()})
        return original(*args, **kwargs)

    optimizer.step = step
    trainer.train()
    row = read_metrics(run)[0]
    compat = [json.loads(line) for line in (run / "compatibility.jsonl").read_text().splitlines()]
    weights = {n: p.detach().clone() for n, p in worker.policy.model.named_parameters()}
    return GraftrlStep(row["loss"], row, compat[0]["s"], compat[0]["reward"], grads, weights)


@dataclass
class TRLRun:
    trainer: Any
    losses: list[float] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def trl_config(tmp_path: Path, **overrides: Any):
    from graftrl.integrations.trl import GraftGRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "trl"),
        "per_device_train_batch_size": len(PROBLEMS) * N,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_generations": N,
        "max_completion_length": 16,
        "max_steps": 1,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1e6,
        "optim": "adamw_torch",
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "scale_rewards": "group",
        "shuffle_dataset": False,
        "bf16": False,
        "use_cpu": True,
        "activation_checkpointing": False,
        "disable_dropout": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": 0,
        "graft_peer_match": "step",
    }
    settings.update(overrides)
    return GraftGRPOConfig(**settings)


def dataset_of(problems):
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": TEMPLATE.format(problem=p.problem), "prompt_id": p.id, "answer": p.answer}
            for p in problems
        ]
    )


def trl_run(
    checkpoint: Path,
    args,
    dataset,
    peer_stores,
    *,
    inject: bool = True,
    trainer_class=None,
    own: dict[str, list[tuple]] = OWN,
    reward_funcs=None,
    **kwargs,
) -> TRLRun:
    """A GraftGRPOTrainer (or ``trainer_class``) run; ``inject``: ``own``'s responses replace
    sampling; ``reward_funcs``: default ``lookup_reward`` (injected) or ``text_reward``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from graftrl.integrations.trl import GraftGRPOTrainer

    trainer_class = trainer_class or GraftGRPOTrainer
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    run = TRLRun(None)

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            run.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    extra = {"peers": peer_stores} if peer_stores is not None else {}
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_funcs or (lookup_reward if inject else text_reward),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Grads()],
        **extra,
        **kwargs,
    )
    run.trainer = trainer
    if inject:
        policy = Policy("llama", model, tokenizer, template=TEMPLATE)
        prompt_of_ids = {tuple(policy.encode_prompts([p.problem])[0]): p.id for p in PROBLEMS}

        def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            completions = []
            for g in range(0, len(prompt_ids), num_generations):
                pid = prompt_of_ids[tuple(prompt_ids[g])]
                completions += [policy.encode_response(text, done) for text, done, _ in own[pid]]
            return completions, None

        trainer._generate_single_turn = generate
    original = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kw):
        loss = original(model, inputs, *args, **kw)
        run.losses.append(float(loss.detach()))
        run.inputs.append(
            {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        )
        return loss

    trainer.compute_loss = compute_loss
    trainer.train()
    return run


VARIANTS = {
    "graft": {},
    "success_only": {"transfer": "success_only"},
    "no_gate": {"gate": False},
}


@pytest.fixture(scope="module")
def equivalence_runs(tiny_checkpoints, peer_store, order, tmp_path_factory):
    """Per variant: (graftrl step, GraftGRPOTrainer step) from the same start."""
    out = {}
    for name, graft in VARIANTS.items():
        tmp = tmp_path_factory.mktemp(f"equivalence-{name}")
        reference = graftrl_step(tiny_checkpoints, peer_store, order, tmp, graft)
        args = trl_config(tmp, **{f"graft_{k}": v for k, v in graft.items()})
        run = trl_run(tiny_checkpoints["llama"], args, dataset_of(order), [StoredPeer(peer_store, "gpt2")])
        out[name] = (reference, run)
    return out


# ----- equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_graft_step_equals_graftrl(equivalence_runs, order, variant):
    reference, run = equivalence_runs[variant]
    exchange = run.trainer.graft_last_exchange
    # the transfer plan: both selected the prompts of eq. 4, and moved the same responses
    own = rewards_of(OWN)
    peer = rewards_of(PEER)
    expected = transfer_candidates(
        torch.tensor([sum(own[p.id]) for p in order]), torch.tensor([sum(peer[p.id]) for p in order]), N
    )
    assert [order[p].id for p in exchange.selected] == [order[p].id for p in expected.nonzero().flatten()]
    assert sorted(order[p].id for p in exchange.selected) == ["p0", "p1"]
    for key in ("candidates/gpt2", "selected/gpt2", "transferred/gpt2", "peer_responses", "peer_admitted"):
        assert exchange.metrics[key] == reference.metrics[key], key
    # compatibility scores and weights, response by response (plan order on both sides)
    assert exchange.rewards == reference.rewards
    assert exchange.s.tolist() == pytest.approx(reference.s, abs=2e-5)
    targets = [item[3] for p in order if p.id in ("p0", "p1") for item in PEER[p.id]]
    kept = [
        item[2] == 1 or variant != "success_only"
        for p in order
        if p.id in ("p0", "p1")
        for item in PEER[p.id]
    ]
    assert exchange.s.tolist() == pytest.approx(
        [s for s, k in zip(targets, kept, strict=True) if k], rel=1e-4
    )
    expected_w = (
        torch.ones(len(exchange.s))
        if variant == "no_gate"
        else compatibility_weight(torch.tensor(reference.s))
    )
    assert exchange.w.tolist() == pytest.approx(expected_w.tolist(), abs=2e-5)
    assert float(exchange.w.mean()) == pytest.approx(reference.metrics["w_mean"], abs=1e-5)
    # loss, gradients and the updated weights
    assert len(run.losses) == 1 and len(run.grads) == 1
    assert run.losses[0] == pytest.approx(reference.loss, rel=1e-4, abs=1e-7)
    assert run.grads[0].keys() == reference.grads.keys()
    for name, grad in reference.grads.items():
        torch.testing.assert_close(run.grads[0][name], grad, rtol=1e-3, atol=1e-6, msg=name)
    weights = dict(run.trainer.model.named_parameters())
    for name, value in reference.weights.items():
        torch.testing.assert_close(weights[name].detach(), value, rtol=1e-4, atol=1e-6, msg=name)


def test_w_folds_into_advantages_and_w0_rows_leave_the_loss(equivalence_runs, order):
    _, run = equivalence_runs["graft"]
    exchange, batch = run.trainer.graft_last_exchange, run.inputs[0]
    peer = batch[IS_PEER]
    assert int(peer.sum()) == 2 * N
    # rows are shuffled; recover each peer row's (w, source advantage) by its completion
    mask = batch["completion_mask"].bool()
    admitted = (exchange.w > 0).sum()
    assert int((mask[peer].sum(-1) > 0).sum()) == int(admitted)  # w = 0 rows: empty masks
    assert int(batch["num_items_in_batch"]) == int(mask.sum())  # the denominator counts kept tokens only
    folded = sorted(round(float(a), 5) for a in batch["advantages"][peer] if float(a) != 0)
    stored = {
        order[p].id: grpo_advantages(torch.tensor([rewards_of(PEER)[order[p].id]]))[0]
        for p in exchange.selected
    }
    expected = sorted(
        round(float(w) * float(a), 5)
        for w, a in zip(exchange.w, torch.cat([stored[order[p].id] for p in exchange.selected]), strict=True)
        if float(w) > 0 and float(a) != 0
    )
    assert folded == pytest.approx(expected, abs=1e-5)


def test_several_optimizer_steps_differ_only_by_trl_normaliser(
    tiny_checkpoints, peer_store, order, equivalence_runs, tmp_path
):
    """Two optimizer steps per generation batch (lr 0, so both see the same weights).

    By design: (1) TRL divides each step's token sum by the batch's tokens / steps, graftrl by the
    step's own token count; (2) TRL shuffles rows over the batch, graftrl keeps groups whole. With
    peer rows last and the same denominator, the steps' gradients still add up to graftrl's
    one-minibatch gradient times the number of steps: the rows are the same, only the split and
    the per-step denominator differ.
    """
    reference, _ = equivalence_runs["graft"]
    args = trl_config(
        tmp_path, per_device_train_batch_size=8, steps_per_generation=2, max_steps=2, learning_rate=0.0
    )
    run = trl_run(tiny_checkpoints["llama"], args, dataset_of(order), [StoredPeer(peer_store, "gpt2")])
    assert len(run.grads) == 2 and len(run.inputs) == 2
    first, second = run.inputs
    assert not bool(first[IS_PEER].any()) and bool(second[IS_PEER].all())  # peer rows in the last step
    total = int(first["num_items_in_batch"])
    tokens = [int(b["completion_mask"].sum()) for b in run.inputs]
    assert total == sum(tokens)  # TRL's dapo denominator: total / 2 for each step, not tokens[k]
    for name, grad in reference.grads.items():
        summed = run.grads[0][name] + run.grads[1][name]
        torch.testing.assert_close(summed, 2 * grad, rtol=1e-3, atol=1e-6, msg=name)
    # TRL computed old log-probs (several optimizer steps); the peer rows' are the receiver's scores
    kept = second["completion_mask"].bool()
    assert bool((second["old_per_token_logps"][kept] < 0).all())


def test_without_a_transfer_graft_trainer_is_grpo_trainer(tiny_checkpoints, tmp_path):
    """A store whose groups never qualify (all fail): GraftGRPOTrainer reproduces GRPOTrainer."""
    from trl import GRPOTrainer

    problems = [MathProblem(f"q{i}", f"{10 + i}+{i % 9 + 1}", "0") for i in range(8)]
    rows = [
        StoredTrajectory(
            prompt_id=p.id,
            step=0,
            source="peer",
            index=i,
            response="no",
            reward=0.0,
            advantage=0.0,
            mean_logprob=-1.0,
            num_tokens=1,
            num_bytes=2,
            finished=True,
            prompt_text=p.problem,
            tokenizer_id="peer@test",
            n=N,
            group_index=g,
        )
        for g, p in enumerate(problems)
        for i in range(N)
    ]
    TrajectoryWriter(tmp_path / "store").write_step(0, rows)
    common = dict(
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=4,
        shuffle_dataset=True,
        max_completion_length=6,
        graft_peer_match="prompt_id",
    )
    graft = trl_run(
        tiny_checkpoints["llama"],
        trl_config(tmp_path / "a", **common),
        dataset_of(problems),
        [tmp_path / "store"],
        inject=False,
    )
    plain = trl_run(
        tiny_checkpoints["llama"],
        trl_config(tmp_path / "b", **common),
        dataset_of(problems),
        None,
        inject=False,
        trainer_class=GRPOTrainer,
    )
    history = [h for h in graft.trainer.state.log_history if "graft/peer_prompts_found/peer" in h]
    assert history and all(h["graft/candidates/peer"] == 0 for h in history)
    assert any(h["graft/peer_prompts_found/peer"] > 0 for h in history)
    theirs = dict(plain.trainer.model.named_parameters())
    for name, value in graft.trainer.model.named_parameters():
        assert torch.equal(value, theirs[name]), name
    assert graft.losses == plain.losses


def test_several_iterations_reuse_the_batch_with_peer_old_logprobs(
    tiny_checkpoints, peer_store, order, tmp_path
):
    args = trl_config(tmp_path, num_iterations=2, max_steps=2)
    run = trl_run(tiny_checkpoints["llama"], args, dataset_of(order), [StoredPeer(peer_store, "gpt2")])
    first, second = run.inputs
    assert torch.equal(first["completion_ids"], second["completion_ids"])  # one generation, two passes
    peer = first[IS_PEER] & (first["completion_mask"].sum(-1) > 0)
    old = first["old_per_token_logps"][peer]
    assert bool(torch.isfinite(old).all()) and bool((old[first["completion_mask"][peer].bool()] < 0).all())
    assert run.losses[0] != run.losses[1]  # the second pass sees updated weights against the same old


# ----- record -> store -> replay ---------------------------------------------------------------


def test_record_store_replay_round_trip(tiny_checkpoints, tmp_path):
    from graftrl.integrations.trl import RecordingGRPOTrainer
    from graftrl.training.trainer import Trainer

    problems = [MathProblem(f"q{i}", f"{10 + i}+{i % 9 + 1}", "0") for i in range(8)]
    captured: list[dict[str, Any]] = []

    class Recording(RecordingGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            captured.append({"advantages": batch["advantages"].clone(), "rollout": self._graft_rollout})
            return batch

    store = tmp_path / "gpt2-store"
    args = trl_config(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        max_steps=4,
        max_completion_length=6,
        shuffle_dataset=True,
    )
    run = trl_run(
        tiny_checkpoints["gpt2"],
        args,
        dataset_of(problems),
        None,
        inject=False,
        trainer_class=Recording,
        record_store=store,
        record_source="gpt2",
    )
    reader = TrajectoryStore(store)
    assert reader.verify().ok and reader.steps() == [0, 1] and reader.sources() == ["gpt2"]
    tokenizer = run.trainer.processing_class
    fresh = Policy.from_pretrained("gpt2", str(tiny_checkpoints["gpt2"]), template="{problem}")
    for step, seen in enumerate(captured):
        rows = reader.read_step(step)
        assert len(rows) == len(problems) * N // 2
        rollout = seen["rollout"]
        for row in rows:
            b = row.group_index * N + row.index
            ids = rollout.completion_ids[b]
            assert row.prompt_id == rollout.inputs[b]["prompt_id"] and row.n == N
            assert row.response == tokenizer.decode(ids, skip_special_tokens=True)
            assert row.reward == text_reward([row.response])[0]
            assert row.advantage == pytest.approx(float(seen["advantages"][b]), abs=1e-6)
            assert row.finished == (bool(ids) and ids[-1] == tokenizer.eos_token_id)
            assert row.num_tokens == len(ids) - int(row.finished)
            assert row.num_bytes == len(row.response.encode())
            if step == 0:  # recorded before the first update: the checkpoint's own log-probs
                logprobs = fresh.score(fresh.encode_prompts([rollout.prompts[b]]), [ids])[0]
                assert row.mean_logprob == pytest.approx(
                    content_mean_logprob(logprobs, row.finished), abs=1e-4
                )
                assert len(row.token_logprobs) == row.num_tokens
    # replay 1: `graftrl train` takes the TRL-recorded store as a stored peer
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n" for p in problems)
    )
    config = {
        "method": "graft",
        "seed": 0,
        "policies": [{"name": "llama", "path": str(tiny_checkpoints["llama"]), "template": TEMPLATE}],
        "peers": [{"name": "gpt2", "path": str(store), "match": "prompt_id"}],
        "data": {"train": str(data), "prompt_suffix": None},
        "rollout": {"n": N, "max_new_tokens": 6},
        "train": {"steps": 2, "batch_prompts": 8, "minibatch_prompts": 4, "micro_batch_size": 64},
        "logging": {"progress": False},
    }

    class TextVerifier:
        def score(self, responses, answers):
            return text_reward(responses)

        def close(self):
            pass

    Trainer(config_from_dict(config), tmp_path / "graftrl", verifier=TextVerifier()).train()
    metrics = read_metrics(tmp_path / "graftrl")
    assert all(row["stored_reward_changes/gpt2"] == 0 for row in metrics)
    assert all(row["peer_responses"] == row["transferred/gpt2"] for row in metrics)
    # replay 2: GraftGRPOTrainer on the same store (match by prompt id: any recorded step)
    replay = trl_run(
        tiny_checkpoints["llama"],
        trl_config(
            tmp_path / "replay",
            per_device_train_batch_size=8,
            steps_per_generation=2,
            max_steps=2,
            max_completion_length=6,
            shuffle_dataset=True,
            graft_peer_match="prompt_id",
        ),
        dataset_of(problems),
        [store],
        inject=False,
    )
    history = [h for h in replay.trainer.state.log_history if "graft/peer_prompts_found/gpt2" in h]
    assert history and history[0]["graft/peer_prompts_found/gpt2"] == 4  # every prompt of the batch
    assert history[0]["graft/stored_reward_changes/gpt2"] == 0


# ----- continuous rewards ----------------------------------------------------------------------

# Fractional rewards (of tests passed, say), per prompt as (text, finished, reward). p0: the receiver's
# partial passes, no full one; the peer has full passes. p2: the receiver scores 0 everywhere; the
# peer has partial passes only. At threshold 1.0, p0 is all-fail (k = 0) and receives the peer's
# group, while the peer's p2 group holds no success (no candidate); at 0.5, p0 is mixed (k = 3) and
# p2 receives. p1 and p3 never qualify (the receiver has a full pass there).
FRACTION_OWN = {
    "p0": [("a1", True, 0.5), ("a2", True, 0.5), ("a3", False, 0.75), ("a4", True, 0.0)],
    "p1": [("b1", True, 1.0), ("b2", True, 0.25), ("b3", True, 0.0), ("b4", False, 0.5)],
    "p2": [("c1", True, 0.0), ("c2", True, 0.0), ("c3", False, 0.0), ("c4", True, 0.0)],
    "p3": [("d1", True, 1.0), ("d2", True, 1.0), ("d3", True, 1.0), ("d4", False, 1.0)],
}
FRACTION_PEER = {
    "p0": [("e1", True, 1.0), ("e2", True, 0.25), ("e3", True, 1.0), ("e4", False, 0.0)],
    "p1": [("f1", True, 1.0), ("f2", True, 0.0), ("f3", True, 0.5), ("f4", True, 0.25)],
    "p2": [("g1", True, 0.5), ("g2", True, 0.25), ("g3", False, 0.0), ("g4", True, 0.75)],
    "p3": [("h1", True, 1.0), ("h2", True, 0.0), ("h3", True, 0.0), ("h4", True, 0.0)],
}
FRACTION_OF_TEXT = {
    item[0]: float(item[2])
    for table in (FRACTION_OWN, FRACTION_PEER)
    for group in table.values()
    for item in group
}


def fraction_reward(completions, **kwargs):
    """A continuous reward function: the fraction of FRACTION_* tables."""
    return [FRACTION_OF_TEXT[c] for c in completions]


def fraction_text_reward(completions, **kwargs):
    """A continuous reward of any text: 0, 0.25, 0.5, 0.75 or 1 (a pure function of the text)."""
    return [zlib.crc32(c.encode()) % 5 / 4 for c in completions]


@pytest.fixture(scope="module")
def fraction_store(tmp_path_factory) -> Path:
    """FRACTION_PEER's groups as a stored peer's step 0, advantages eq. 1 of the fractions."""
    root = tmp_path_factory.mktemp("fraction-store")
    rows = []
    for group_index, problem in enumerate(PROBLEMS):
        group = FRACTION_PEER[problem.id]
        advantages = grpo_advantages(torch.tensor([[item[2] for item in group]]))[0]
        rows += [
            StoredTrajectory(
                prompt_id=problem.id,
                step=0,
                source="gpt2",
                index=index,
                response=text,
                reward=reward,
                advantage=float(advantages[index]),
                mean_logprob=-1.0,
                num_tokens=len(text),
                num_bytes=len(text.encode()),
                finished=finished,
                prompt_text=problem.problem,
                tokenizer_id="gpt2@test",
                n=N,
                group_index=group_index,
            )
            for index, (text, finished, reward) in enumerate(group)
        ]
    TrajectoryWriter(root).write_step(0, rows)
    return root


@pytest.mark.parametrize(("threshold", "receives"), [(None, "p0"), (1.0, "p0"), (0.5, "p2")])
def test_graft_trainer_counts_successes_at_the_threshold(
    tiny_checkpoints, fraction_store, order, tmp_path, threshold, receives
):
    """Fractional rewards train a step and are recorded as they are; a group of partial passes is
    all-fail at threshold 1.0 (the default) and not at 0.5."""
    overrides = {} if threshold is None else {"graft_success_threshold": threshold}
    args = trl_config(tmp_path, **overrides)
    assert args.graft_success_threshold == (1.0 if threshold is None else threshold)
    run = trl_run(
        tiny_checkpoints["llama"],
        args,
        dataset_of(order),
        [StoredPeer(fraction_store, "gpt2")],
        own=FRACTION_OWN,
        reward_funcs=fraction_reward,
        record_store=tmp_path / "own",
        record_source="llama",
    )
    exchange = run.trainer.graft_last_exchange
    assert [order[p].id for p in exchange.selected] == [receives]
    assert exchange.metrics["candidates/gpt2"] == 1 and exchange.metrics["transferred/gpt2"] == N
    assert exchange.rewards == [item[2] for item in FRACTION_PEER[receives]]  # the fractions, as stored
    assert exchange.metrics["stored_reward_changes/gpt2"] == 0  # re-verified: the same fractions
    assert len(run.losses) == 1 and math.isfinite(run.losses[0]) and len(run.grads) == 1
    # own rows not replaced keep TRL's advantages of the fractions (eq. 1: partial credit ranks)
    batch = run.inputs[0]
    own_rows = ~batch[IS_PEER]
    assert int(own_rows.sum()) == 3 * N
    assert bool((batch["advantages"][own_rows] != 0).any())
    # the receiver's own fractional rewards are in its store as they are
    rows = TrajectoryStore(tmp_path / "own").read_step(0)
    assert {(r.prompt_id, r.response): r.reward for r in rows} == {
        (pid, text): reward for pid, group in FRACTION_OWN.items() for text, _, reward in group
    }


def test_recording_trainer_records_fractional_rewards(tiny_checkpoints, tmp_path):
    from graftrl.integrations.trl import RecordingGRPOTrainer

    problems = [MathProblem(f"q{i}", f"{10 + i}+{i % 9 + 1}", "0") for i in range(8)]
    store = tmp_path / "store"
    args = trl_config(tmp_path, per_device_train_batch_size=8, max_steps=2, max_completion_length=6)
    trl_run(
        tiny_checkpoints["gpt2"],
        args,
        dataset_of(problems),
        None,
        inject=False,
        trainer_class=RecordingGRPOTrainer,
        reward_funcs=fraction_text_reward,
        record_store=store,
        record_source="gpt2",
    )
    reader = TrajectoryStore(store)
    assert reader.verify().ok and reader.steps() == [0, 1]
    rows = [row for step in reader.steps() for row in reader.read_step(step)]
    assert [row.reward for row in rows] == fraction_text_reward([row.response for row in rows])
    assert any(0 < row.reward < 1 for row in rows)


# ----- refusals --------------------------------------------------------------------------------


def refusal(
    tiny_checkpoints,
    tmp_path,
    peer_store,
    order,
    *,
    dataset=None,
    tokenizer_hook=None,
    peer_stores=None,
    **overrides,
) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftrl.integrations.trl import GraftGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"])
    if tokenizer_hook:
        tokenizer_hook(tokenizer, model)
    with pytest.raises((TRLIntegrationError, StoreError)) as caught:
        GraftGRPOTrainer(
            model=model,
            reward_funcs=lookup_reward,
            args=trl_config(tmp_path, **overrides),
            train_dataset=dataset or dataset_of(order),
            processing_class=tokenizer,
            peers=[StoredPeer(peer_store, "gpt2")],
            **({"peer_stores": peer_stores} if peer_stores else {}),
        )
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"loss_type": "grpo"}, "loss_type"),
        ({"beta": 0.04}, "beta"),
        ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),
        ({"graft_delta": 1.5}, "graft_delta"),
        ({"graft_peer_match": "closest"}, "graft_peer_match"),
        ({"graft_transfer": "some"}, "graft_transfer"),
        ({"graft_success_threshold": float("nan")}, "graft_success_threshold"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(
    tiny_checkpoints, tmp_path, peer_store, order, overrides, field
):
    assert field in refusal(tiny_checkpoints, tmp_path, peer_store, order, **overrides)


def test_data_and_tokenizer_problems_are_refused_in_one_line(tiny_checkpoints, tmp_path, peer_store, order):
    other = [MathProblem(f"other{i}", p.problem, p.answer) for i, p in enumerate(order)]
    assert "none of the dataset's 4 prompt ids" in refusal(
        tiny_checkpoints, tmp_path, peer_store, order, dataset=dataset_of(other)
    )
    assert "num_generations" in refusal(
        tiny_checkpoints, tmp_path, peer_store, order, num_generations=2, per_device_train_batch_size=8
    )

    def no_eos(tokenizer, model):
        tokenizer.eos_token = None
        model.generation_config.eos_token_id = None

    assert "eos_token" in refusal(tiny_checkpoints, tmp_path, peer_store, order, tokenizer_hook=no_eos)


def test_peer_stores_is_a_deprecated_alias_of_peers(tiny_checkpoints, tmp_path, peer_store, order):
    """``peer_stores=`` (kept for one release) warns, and its stores join ``peers``' as one list: the
    same source in both is refused as given twice."""
    with pytest.warns(DeprecationWarning, match=r"peer_stores=\.\.\.\) is deprecated.*peers=\[\.\.\.\]"):
        message = refusal(
            tiny_checkpoints, tmp_path, peer_store, order, peer_stores=[StoredPeer(peer_store, "gpt2")]
        )
    assert "'gpt2' appears twice" in message


def test_untested_trl_version_is_refused(monkeypatch):
    import trl

    from graftrl.integrations.trl._compat import UNTESTED_ENV, require_trl

    monkeypatch.setattr(trl, "__version__", "99.0.0")
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    with pytest.raises(
        TRLIntegrationError,
        match=r"TRL 99.0.0 is outside .*bash scripts/setup_trl.sh .*pip install -e '\.\[trl\]'",
    ):
        require_trl()
    monkeypatch.setenv(UNTESTED_ENV, "1")
    assert require_trl() is trl


@pytest.mark.parametrize("model_type", ["gpt_neox", "mixtral"])
def test_a_resumed_trl_run_equals_the_straight_one(model_type, tmp_path):
    """``train(resume_from_checkpoint=...)`` of a recording trainer loads the checkpoint through
    transformers' loading (transformers' Trainer reads raw keys and leaves GPT-NeoX's head and a
    mixture's experts as they were): 2 steps + resume to 4 equal 4 straight steps, weights and the
    recorded store alike."""
    from architectures import build_architecture
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftrl.integrations.trl import RecordingGRPOTrainer

    model_dir = build_architecture(model_type, tmp_path / model_type)
    dataset = dataset_of([MathProblem(f"q{i}", f"{i}+{i}", str(2 * i)) for i in range(8)])

    def run(out: Path, steps: int, resume: str | None = None) -> dict[str, torch.Tensor]:
        args = trl_config(
            out, per_device_train_batch_size=8, max_steps=steps, max_completion_length=4,
            learning_rate=1e-2, save_strategy="steps", save_steps=2,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = RecordingGRPOTrainer(
            model=model, reward_funcs=text_reward, args=args, train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_dir), record_store=out / "store",
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    full = run(tmp_path / "full", 4)
    first = run(tmp_path / "cut", 2)
    resumed = run(tmp_path / "cut", 4, resume=str(tmp_path / "cut" / "trl" / "checkpoint-2"))
    assert [k for k in full if not torch.equal(full[k], resumed[k])] == []
    assert any(not torch.equal(full[k], first[k]) for k in full), "nothing trained after step 2"
    stores = [TrajectoryStore(tmp_path / run / "store") for run in ("full", "cut")]
    assert stores[0].steps() == stores[1].steps() == [0, 1, 2, 3]
    for step in stores[0].steps():
        assert [r.to_dict() for r in stores[0].read_step(step)] == [
            r.to_dict() for r in stores[1].read_step(step)
        ]


def test_a_peer_kind_registered_for_graftrl_train_trains_in_trl(tiny_checkpoints, tmp_path, monkeypatch, order):
    """tests/test_peer_sources.py's toy kind (one settings class, one source class), registered and
    given in ``peers=``, and nothing else: GraftGRPOTrainer builds and asks it as ``graftrl train``
    does (``integrations.trl.sources``), and GRAFT transfers its groups."""
    from test_peer_sources import ToyPeerConfig, ToySource

    from graftrl.config import peers as peer_config
    from graftrl.training import peer_sources
    from graftrl.training.peer_sources import PeerSource

    monkeypatch.setattr(peer_config, "PEER_SETTINGS", dict(peer_config.PEER_SETTINGS))
    monkeypatch.setattr(peer_sources, "SOURCES", dict(peer_sources.SOURCES))
    peer_config.register_peer_settings("toy", ToyPeerConfig)
    peer_sources.register_source("toy")(ToySource)
    monkeypatch.setattr(ToySource, "opened", [])

    def reward(completions, **kwargs):  # the toy's first response of each group is right
        return [REWARD_OF_TEXT.get(c, float(c.endswith(" 0"))) for c in completions]

    run = trl_run(
        tiny_checkpoints["llama"],
        trl_config(tmp_path),
        dataset_of(order),
        [ToyPeerConfig(name="toy")],
        reward_funcs=reward,
    )
    assert ToySource.opened == ["toy"] and isinstance(run.trainer.graft_sources[0], PeerSource)
    logged = run.trainer.state.log_history[0]
    assert logged["graft/peer_prompts_found/toy"] == len(order) and logged["graft/candidates/toy"] > 0
    assert set(run.trainer.graft_last_exchange.sources) == {"toy"}
