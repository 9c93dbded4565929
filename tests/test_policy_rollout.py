"""Policies loaded by path, the HF rollout engine, and receiver-side scoring across tokenizers."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_MIXED, ScriptedRewards, make_config
from torch import Tensor

from graftrl.config import config_from_dict
from graftrl.errors import UserError
from graftrl.evaluation.evaluate import resolve_targets
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, SamplingParams, content_mean_logprob
from graftrl.training.trainer import Trainer


@pytest.fixture(scope="module")
def policies(tiny_checkpoints) -> dict[str, Policy]:
    return {
        "llama": Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]), template="{problem}="),
        "gpt2": Policy.from_pretrained("gpt2", str(tiny_checkpoints["gpt2"]), template="Q: {problem}\nA: "),
    }


def test_tokenizers_differ(policies):
    text = "\\boxed{128}"
    ids = {name: p.encode_response(text, finished=False) for name, p in policies.items()}
    assert len(ids["llama"]) == len(text)  # one token per character
    assert len(ids["gpt2"]) < len(text)  # BPE merges
    for p in policies.values():
        assert p.decode_response(p.encode_response(text, finished=False)) == text


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_behaviour_logprobs_match_the_trainer_recomputation(policies, name):
    policy = policies[name]
    torch.manual_seed(0)
    batch = HFRolloutEngine().generate(
        policy, ["12+3", "4+56", "7"], SamplingParams(n=3, temperature=0.7, max_new_tokens=10)
    )
    assert len(batch.response_ids) == 9 and batch.n == 3
    prompts = [batch.prompt_ids[row // 3] for row in range(9)]
    policy.temperature = 0.7
    rescored = policy.score(prompts, batch.response_ids)
    for behaviour, recomputed in zip(batch.behaviour_logprobs, rescored, strict=True):
        assert behaviour.shape == recomputed.shape
        assert torch.allclose(behaviour, recomputed, atol=1e-4)


def test_sampling_is_seeded_and_stops_at_eos(policies):
    policy = policies["llama"]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    torch.manual_seed(5)
    first = HFRolloutEngine().generate(policy, ["1+1", "2+2"], params)
    torch.manual_seed(5)
    second = HFRolloutEngine().generate(policy, ["1+1", "2+2"], params)
    assert first.response_ids == second.response_ids
    eos = policy.eos_token_id
    for ids, finished in zip(first.response_ids, first.finished, strict=True):
        assert eos not in ids[:-1]
        assert finished == (ids[-1:] == [eos])
        assert finished or len(ids) == 6
    # the texts are each row's own decode, without its EOS (decoded in one batch call)
    for policy_ in policies.values():
        batch = HFRolloutEngine().generate(policy_, ["1+1", "2+2", "10+7"], params, seed=3)
        assert batch.texts == [
            policy_.decode_response(ids[:-1] if done else ids)
            for ids, done in zip(batch.response_ids, batch.finished, strict=True)
        ]


def test_top_p_keeps_behaviour_logprobs_of_the_full_distribution(policies):
    """Recorded log-probs are log softmax(logits / T) before nucleus truncation (as vLLM/verl)."""
    policy = policies["gpt2"]
    torch.manual_seed(1)
    batch = HFRolloutEngine().generate(
        policy, ["9+9"], SamplingParams(n=6, temperature=1.0, top_p=0.5, max_new_tokens=5)
    )
    policy.temperature = 1.0
    rescored = policy.score([batch.prompt_ids[0]] * 6, batch.response_ids)
    for behaviour, recomputed in zip(batch.behaviour_logprobs, rescored, strict=True):
        assert torch.allclose(behaviour, recomputed, atol=1e-4)


def test_eos_is_trained_but_excluded_from_compatibility(policies):
    """A finished peer response gets the receiver's own EOS; lbar excludes it on both sides."""
    text = "\\boxed{42}"
    for receiver in policies.values():
        finished_ids = receiver.encode_response(text, finished=True)
        open_ids = receiver.encode_response(text, finished=False)
        assert finished_ids == [*open_ids, receiver.eos_token_id]
        prompt = receiver.encode_prompts(["40+2"])[0]
        logprobs = receiver.score([prompt], [finished_ids])[0]
        content = receiver.score([prompt], [open_ids])[0]
        assert torch.allclose(logprobs[:-1], content, atol=1e-5)
        assert content_mean_logprob(logprobs, finished=True) == pytest.approx(float(content.mean()), abs=1e-5)
        assert content_mean_logprob(content, finished=False) == pytest.approx(float(content.mean()), abs=1e-5)


def test_policy_requires_eos(tiny_checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoints["llama"]))
    tokenizer.eos_token = None
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]))
    with pytest.raises(ValueError, match="eos_token"):
        Policy("x", model, tokenizer)


def test_bf16_compute_keeps_float32_master_weights(tiny_checkpoints):
    """dtype: bfloat16 autocasts the forward pass; parameters and updates stay float32."""
    policy = Policy.from_pretrained(
        "llama", str(tiny_checkpoints["llama"]), dtype="bfloat16", template="{problem}="
    )
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    assert policy.compute_dtype == torch.bfloat16
    prompt = policy.encode_prompts(["1+2"])[0]
    response = policy.encode_response("\\boxed{3}", finished=True)
    mixed = policy.score([prompt], [response])[0]
    policy.compute_dtype = None
    full = policy.score([prompt], [response])[0]
    assert not torch.equal(mixed, full) and torch.allclose(mixed, full, atol=0.1)
    # an lr-1e-6 AdamW step moves float32 master weights (it would round away in pure bf16)
    policy.configure_optimizer(1e-6, (0.9, 0.999), 0.0)
    before = [p.detach().clone() for p in policy.model.parameters()]
    policy.compute_dtype = torch.bfloat16
    batch = policy.pad([prompt], [response])
    (-policy.response_logprobs(batch).sum()).backward()
    policy.optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.model.parameters(), strict=True))


def test_content_mean_logprob_is_core_eq6_and_the_old_value_to_the_bit():
    """rollout's lbar goes through ``core.mean_token_logprob``; stored records and resumed runs
    need it to equal the former ``float(content.mean())`` exactly, for every response length."""
    from graftrl.core import mean_token_logprob

    generator = torch.Generator().manual_seed(0)
    for length in [*range(0, 70), 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 4097]:
        logprobs = -torch.rand(length, generator=generator) * 12  # [L] float32, as the recorder gives
        for finished in (True, False):
            content = logprobs[:-1] if finished else logprobs
            old = float(content.mean()) if content.numel() else 0.0
            assert content_mean_logprob(logprobs, finished) == old, (length, finished)
    # and it is eq. 6 of core: the mean over the masked (content) tokens, EOS left out
    logprobs = torch.tensor([-1.0, -2.0, -6.0])
    mask = torch.tensor([[True, True, False]])
    assert content_mean_logprob(logprobs, finished=True) == float(mean_token_logprob(logprobs[None], mask)[0])


def test_attn_implementation_picks_the_kernel_and_a_bad_one_is_one_line(tiny_checkpoints, tmp_path):
    """`policies[].attn_implementation` reaches transformers for training and evaluation; the
    kernels compute the same log-probs up to rounding; an unknown one is a ModelError naming it."""
    path = str(tiny_checkpoints["llama"])
    default = Policy.from_pretrained("llama", path, template="{problem}=")
    eager = Policy.from_pretrained("llama", path, attn_implementation="eager", template="{problem}=")
    assert default.model.config._attn_implementation == "sdpa"
    assert eager.model.config._attn_implementation == "eager"
    prompts = default.encode_prompts(["12+7", "3+4"])
    responses = [default.encode_response(t, finished=True) for t in ("\\boxed{19}", "7")]
    for a, b in zip(default.score(prompts, responses), eager.score(prompts, responses), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(UserError, match=r"attn_implementation 'no-such-kernel' does not load"):
        Policy.from_pretrained("llama", path, attn_implementation="no-such-kernel")

    raw = make_config(tiny_checkpoints, steps=1)
    raw["policies"][0]["attn_implementation"] = "eager"
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=ScriptedRewards(ALL_MIXED))
    kernels = {w.name: w.policy.model.config._attn_implementation for w in trainer.workers}
    assert kernels == {"llama": "eager", "gpt2": "sdpa"}
    trainer.train()  # its checkpoints are evaluated with the run's kernels
    plan = resolve_targets(tmp_path / "run")
    loaded = {t.policy: t.load().model.config._attn_implementation for t in plan.targets}
    assert loaded == {"llama": "eager", "gpt2": "sdpa"}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dropout_is_off_in_training_mode_unless_kept(tiny_checkpoints, tmp_path, arch):
    """A checkpoint with dropout 0.1 (GPT-2's nn.Dropout modules; Llama's attention probability,
    applied by the attention function): loaded for RL, the trainer's log-probs in training mode are
    the sampler's (eval mode); `disable_dropout=False` keeps the checkpoint's dropout."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(tiny_checkpoints[arch])
    model = AutoModelForCausalLM.from_pretrained(source)
    dropout = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"), "llama": ("attention_dropout",)}[arch]
    for key in dropout:
        setattr(model.config, key, 0.1)
    model = AutoModelForCausalLM.from_config(model.config)  # built with the dropout
    model.save_pretrained(tmp_path / arch)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path / arch)

    def logprobs(policy: Policy, training: bool) -> Tensor:
        policy.model.train(training)
        prompts = policy.encode_prompts(["12+7", "3+4"])
        responses = [policy.encode_response(t, finished=True) for t in ("\\boxed{19}", "so 7")]
        with torch.no_grad():
            return policy.response_logprobs(policy.pad(prompts, responses))

    rl = Policy.from_pretrained(arch, str(tmp_path / arch), attn_implementation="eager")
    assert torch.equal(logprobs(rl, training=True), logprobs(rl, training=False))
    assert rl.model.config.to_dict()[dropout[0]] == 0.1  # the config, hence a saved checkpoint, keeps it
    kept = Policy.from_pretrained(
        arch, str(tmp_path / arch), attn_implementation="eager", disable_dropout=False
    )
    torch.manual_seed(0)
    assert not torch.equal(logprobs(kept, training=True), logprobs(kept, training=False))
