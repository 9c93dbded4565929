"""The HF sampler with its preallocated KV cache and its shared prompt prefill gives exactly the
samples of plain ``generate`` with its own DynamicCache (the reference: the sampler before either,
with which every committed cell was made): the same response ids, behaviour log-probs
(``torch.equal``), finished flags and texts, and the same random stream afterwards, for both
embedded architectures."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList

from graftrl.embedded.models import build_spec
from graftrl.embedded.task import make_problems, supervised_text
from graftrl.models import kv_cache
from graftrl.models.policy import Policy
from graftrl.models.rollout import (
    PREALLOCATE_FROM_TOKENS,
    HFRolloutEngine,
    RolloutBatch,
    SamplingParams,
    _BehaviourLogprobRecorder,
    preallocation_pays,
)
from graftrl.models.shared_prefill import SHARE_FROM_PROMPTS, generate_sharing_prompts

TEMPLATE = "{problem}="


@pytest.fixture(autouse=True)
def one_thread():
    """Bit-identity is a property of the kernels, which depend on the thread count: the tests
    below fix it (1, as the committed cells ran; the 2-thread case sets its own)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


PROMPTS = [p.problem for p in make_problems(None, 40, seed=11, task="worked")]


def assert_identical(reference: RolloutBatch, fast: RolloutBatch) -> None:
    assert fast.prompt_ids == reference.prompt_ids
    assert fast.response_ids == reference.response_ids
    assert fast.finished == reference.finished
    assert fast.texts == reference.texts
    assert len(fast.behaviour_logprobs) == len(reference.behaviour_logprobs)
    for ours, theirs in zip(fast.behaviour_logprobs, reference.behaviour_logprobs, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def plain_engine(max_batch_size: int = 512) -> HFRolloutEngine:
    """The reference sampler: ``generate`` as it comes, prompts repeated n times, its own cache."""
    return HFRolloutEngine(max_batch_size, preallocate_cache=False, share_prompts=False)


FAST_ENGINES = {
    "preallocated": {"preallocate_cache": True, "share_prompts": False},
    "shared prompts": {"preallocate_cache": False, "share_prompts": True},
    "both": {"preallocate_cache": True, "share_prompts": True},
}


@pytest.mark.parametrize("name", ["llama-char", "gpt2-bpe"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.95), (1.3, 0.8)])
@pytest.mark.parametrize("fast_path", sorted(FAST_ENGINES))
def test_fast_paths_sample_exactly_as_generate(policies, name, temperature, top_p, fast_path, monkeypatch):
    policy = policies[name]
    assert kv_cache.preallocated_cache(policy.model, 8) is not None, "the fast path must be taken"
    writes, shares = [], []
    update = kv_cache.PreallocatedLayer.update
    monkeypatch.setattr(
        kv_cache.PreallocatedLayer, "update", lambda self, *a, **k: writes.append(1) or update(self, *a, **k)
    )
    monkeypatch.setattr(
        "graftrl.models.rollout.generate_sharing_prompts",
        lambda *a, **k: shares.append(1) or generate_sharing_prompts(*a, **k),
    )
    options = FAST_ENGINES[fast_path]
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=24)
    # 72 rows per generate call: the 40 prompts x 4 samples take chunks of 18, 18 and 4 prompts of
    # different widths (the last one under SHARE_FROM_PROMPTS: generate's own prefill)
    reference_engine = plain_engine(max_batch_size=72)
    fast_engine = HFRolloutEngine(max_batch_size=72, **options)

    reference = reference_engine.generate(policy, PROMPTS, params, seed=5)
    assert not writes and not shares
    fast = fast_engine.generate(policy, PROMPTS, params, seed=5)
    assert bool(writes) == options["preallocate_cache"] and bool(shares) == options["share_prompts"]
    assert_identical(reference, fast)
    assert any(reference.finished) and not all(reference.finished)  # both kinds of rows covered

    # unseeded calls draw from the global stream: the same draws, and the stream left the same
    streams = []
    for engine in (reference_engine, fast_engine):
        engine.reseed(9)
        batches = [engine.generate(policy, PROMPTS[:20], params) for _ in range(2)]
        streams.append((batches, torch.rand(3)))
    for ours, theirs in zip(streams[1][0], streams[0][0], strict=True):
        assert_identical(theirs, ours)
    assert torch.equal(streams[0][1], streams[1][1])


def sample_first_tokens(policy, ids, mask, top_p, max_new_tokens, eos, shared):
    """(sequences, recorded log-probs, the random stream after) of 6 samples per prompt, seed 3."""
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=6,
        eos_token_id=eos,
        pad_token_id=int(policy.tokenizer.pad_token_id),
    )
    recorder = _BehaviourLogprobRecorder(1.0, top_p)
    torch.manual_seed(3)
    with torch.no_grad():
        if shared:
            cache, key = kv_cache.dynamic_cache(policy.model), kv_cache.cache_argument(policy.model)
            sequences = generate_sharing_prompts(policy.model, ids, mask, config, recorder, cache, key)
        else:
            processors = LogitsProcessorList([recorder])
            sequences = policy.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors
            )
    return sequences, recorder.finish(sequences[:, -1]), torch.rand(2)


@pytest.mark.parametrize("name", ["llama-char", "gpt2-bpe"])
@pytest.mark.parametrize(
    ("case", "top_p", "max_new_tokens"),
    [
        ("some rows end at the first token", 1.0, 10),
        ("every row ends at the first token", 1e-6, 10),  # top-1: generate is not called
        ("a single token", 1.0, 1),
    ],
)
def test_shared_prefill_returns_generates_sequences(policies, name, case, top_p, max_new_tokens):
    """``generate_sharing_prompts`` against ``generate`` itself, with the EOS set to the token that
    row 0 draws first: the same sequences (pads included), the same log-probs up to each row's EOS
    (after it, ``generate`` feeds a pad) and the same random stream afterwards."""
    policy = policies[name]
    prompts = PROMPTS[:SHARE_FROM_PROMPTS]
    batch = policy.pad(policy.encode_prompts(prompts), [[] for _ in prompts])
    width = batch.prompt_width
    ids, mask = batch.input_ids[:, :width], batch.attention_mask[:, :width]
    if case.startswith("every"):  # one prompt throughout, so that every row draws the same top token
        ids, mask = ids[:1].expand_as(ids), mask[:1].expand_as(mask)
    probe, _, _ = sample_first_tokens(policy, ids, mask, top_p, 1, None, shared=False)
    eos = int(probe[0, width])  # the first draw does not depend on the EOS
    reference, reference_logprobs, reference_stream = sample_first_tokens(
        policy, ids, mask, top_p, max_new_tokens, eos, shared=False
    )
    ours, logprobs, stream = sample_first_tokens(policy, ids, mask, top_p, max_new_tokens, eos, shared=True)

    ended = reference[:, width] == eos
    assert ended[0] and (ended.all() == case.startswith("every"))
    if case.startswith("every"):
        assert reference.shape[1] == width + 1
    assert torch.equal(ours, reference)
    assert torch.equal(stream, reference_stream)
    for row, tokens in enumerate(reference[:, width:].tolist()):
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert torch.equal(logprobs[row, :length], reference_logprobs[row, :length])


def test_preallocated_cache_under_bf16_autocast(policies):
    base = policies["llama-char"]
    policy = Policy(base.name, base.model, base.tokenizer, template=TEMPLATE, compute_dtype=torch.bfloat16)
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=12)
    prompts = PROMPTS[:SHARE_FROM_PROMPTS]
    reference = plain_engine().generate(policy, prompts, params, seed=2)
    for options in FAST_ENGINES.values():
        assert_identical(reference, HFRolloutEngine(**options).generate(policy, prompts, params, seed=2))


@pytest.mark.parametrize("name", ["llama-char", "gpt2-bpe"])
def test_shared_prefill_at_two_threads(policies, name, monkeypatch):
    """At 2 threads a product of up to 11 rows rounds differently from a long one; from
    SHARE_FROM_PROMPTS prompts up the shared prefill still samples exactly as generate."""
    shares = []
    monkeypatch.setattr(
        "graftrl.models.rollout.generate_sharing_prompts",
        lambda *a, **k: shares.append(1) or generate_sharing_prompts(*a, **k),
    )
    torch.set_num_threads(2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)
    prompts = PROMPTS[:SHARE_FROM_PROMPTS]
    reference = plain_engine().generate(policies[name], prompts, params, seed=4)
    assert_identical(reference, HFRolloutEngine().generate(policies[name], prompts, params, seed=4))
    assert shares


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


@pytest.mark.parametrize("share", [True, False])
def test_rollout_share_prompts_reaches_the_hf_engines(tiny_checkpoints, tmp_path, share):
    """``rollout.share_prompts`` sets the training and validation engines alike."""
    from conftest import FIXTURES, make_config

    from graftrl.config import config_from_dict
    from graftrl.training.validation import Validator
    from graftrl.training.worker import make_engine

    raw = make_config(tiny_checkpoints)
    raw["rollout"]["share_prompts"] = share
    raw["validation"] = {"files": [str(FIXTURES / "math_small.jsonl")]}
    config = config_from_dict(raw)
    assert make_engine(config, policy=None).share_prompts is share
    assert Validator(config, tmp_path, verifier=None).engine.share_prompts is share


@pytest.mark.parametrize("share", [True, False])
def test_the_checkpoints_sampling_defaults_do_not_reach_the_sampler(policies, share, monkeypatch):
    """A checkpoint whose generation_config.json asks for a repetition penalty and n-gram blocking
    samples as one without: the behaviour log-probs stay log softmax(logits / T)."""
    policy = policies["llama-char"]
    params = SamplingParams(n=4, temperature=0.9, max_new_tokens=12)
    prompts = PROMPTS[:SHARE_FROM_PROMPTS]
    engine = HFRolloutEngine(share_prompts=share)
    clean = engine.generate(policy, prompts, params, seed=1)
    monkeypatch.setattr(policy.model.generation_config, "repetition_penalty", 3.0)
    monkeypatch.setattr(policy.model.generation_config, "no_repeat_ngram_size", 1)
    assert_identical(clean, engine.generate(policy, prompts, params, seed=1))
    assert policy.model.generation_config.repetition_penalty == 3.0  # the checkpoint's own is kept
