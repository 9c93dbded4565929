"""The HF sampler with its preallocated KV cache gives exactly the samples of ``generate``'s own
DynamicCache (the reference: the sampler before the cache, with which every committed cell was
made): the same response ids, behaviour log-probs (``torch.equal``), finished flags and texts, and
the same random stream afterwards, for both embedded architectures."""

from __future__ import annotations

import pytest
import torch

from graftrl.embedded.models import build_spec
from graftrl.embedded.task import make_problems, supervised_text
from graftrl.models import kv_cache
from graftrl.models.policy import Policy
from graftrl.models.rollout import (
    PREALLOCATE_FROM_TOKENS,
    HFRolloutEngine,
    RolloutBatch,
    SamplingParams,
    preallocation_pays,
)

TEMPLATE = "{problem}="


@pytest.fixture(scope="module")
def policies() -> dict[str, Policy]:
    """The two embedded specs at their real sizes, random init (EOS then has probability ~1/V
    per step, so within 24 tokens some rows finish and most run to the limit)."""
    problems = make_problems(None, 200, seed=3, task="worked")
    corpus = [TEMPLATE.format(problem=p.problem) for p in problems] + [
        supervised_text(p, "worked") for p in problems
    ]
    out = {}
    for name in ("llama-char", "gpt2-bpe"):
        model, tokenizer = build_spec(name, corpus, seed=7, max_positions=96)
        model.eval()
        out[name] = Policy(name, model, tokenizer, template=TEMPLATE)
    return out


PROMPTS = [p.problem for p in make_problems(None, 10, seed=11, task="worked")]


def assert_identical(reference: RolloutBatch, fast: RolloutBatch) -> None:
    assert fast.prompt_ids == reference.prompt_ids
    assert fast.response_ids == reference.response_ids
    assert fast.finished == reference.finished
    assert fast.texts == reference.texts
    assert len(fast.behaviour_logprobs) == len(reference.behaviour_logprobs)
    for ours, theirs in zip(fast.behaviour_logprobs, reference.behaviour_logprobs, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["llama-char", "gpt2-bpe"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.95), (1.3, 0.8)])
def test_preallocated_cache_samples_exactly_as_generate(policies, name, temperature, top_p, monkeypatch):
    policy = policies[name]
    assert kv_cache.preallocated_cache(policy.model, 8) is not None, "the fast path must be taken"
    writes = []
    update = kv_cache.PreallocatedLayer.update
    monkeypatch.setattr(
        kv_cache.PreallocatedLayer, "update", lambda self, *a, **k: writes.append(1) or update(self, *a, **k)
    )
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=24)
    # 24 rows per generate call: the 10 prompts x 4 samples take two chunks of different widths
    reference_engine = HFRolloutEngine(max_batch_size=24, preallocate_cache=False)
    fast_engine = HFRolloutEngine(max_batch_size=24, preallocate_cache=True)

    reference = reference_engine.generate(policy, PROMPTS, params, seed=5)
    assert not writes
    fast = fast_engine.generate(policy, PROMPTS, params, seed=5)
    assert writes
    assert_identical(reference, fast)
    assert any(reference.finished) and not all(reference.finished)  # both kinds of rows covered

    # unseeded calls draw from the global stream: the same draws, and the stream left the same
    streams = []
    for engine in (reference_engine, fast_engine):
        engine.reseed(9)
        batches = [engine.generate(policy, PROMPTS[:7], params) for _ in range(2)]
        streams.append((batches, torch.rand(3)))
    for ours, theirs in zip(streams[1][0], streams[0][0], strict=True):
        assert_identical(theirs, ours)
    assert torch.equal(streams[0][1], streams[1][1])


def test_preallocated_cache_under_bf16_autocast(policies):
    base = policies["llama-char"]
    policy = Policy(base.name, base.model, base.tokenizer, template=TEMPLATE, compute_dtype=torch.bfloat16)
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=12)
    reference = HFRolloutEngine(preallocate_cache=False).generate(policy, PROMPTS[:4], params, seed=2)
    assert_identical(
        reference, HFRolloutEngine(preallocate_cache=True).generate(policy, PROMPTS[:4], params, seed=2)
    )


def test_layer_grows_past_its_capacity():
    """A call writing past the planned capacity still returns the concatenation (by doubling)."""
    layer = kv_cache.PreallocatedLayer(capacity=3)
    keys = [torch.randn(2, 2, length, 4) for length in (2, 1, 1, 1, 1)]
    values = [torch.randn(2, 2, length, 4) for length in (2, 1, 1, 1, 1)]
    for step in range(len(keys)):
        got_keys, got_values = layer.update(keys[step], values[step], 0)
        assert torch.equal(got_keys, torch.cat(keys[: step + 1], dim=-2))
        assert torch.equal(got_values, torch.cat(values[: step + 1], dim=-2))
    assert layer.get_seq_length() == 6


@pytest.mark.parametrize(
    ("max_new_tokens", "kernels", "preallocated"),
    [
        (PREALLOCATE_FROM_TOKENS - 1, "AVX2", False),
        (PREALLOCATE_FROM_TOKENS, "AVX2", True),
        (PREALLOCATE_FROM_TOKENS, "DEFAULT", True),
        (PREALLOCATE_FROM_TOKENS, "AVX512", False),
    ],
)
def test_the_default_preallocates_long_calls_except_on_avx512(
    policies, max_new_tokens, kernels, preallocated, monkeypatch
):
    made = []
    real = kv_cache.preallocated_cache
    monkeypatch.setattr("graftrl.models.rollout.preallocated_cache", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=max_new_tokens)
    HFRolloutEngine().generate(policies["gpt2-bpe"], PROMPTS[:2], params, seed=0)
    assert bool(made) == preallocated
    assert preallocation_pays(max_new_tokens, torch.device("cpu")) == preallocated
    assert preallocation_pays(max_new_tokens, torch.device("cuda")) == (
        max_new_tokens >= PREALLOCATE_FROM_TOKENS
    )
