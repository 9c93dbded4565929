"""The HF engine's compiled decode path (``rollout.compile``, ``graftrl.models.compiled_decode``) on
CPU, forced with ``compile=True``: its behaviour log-probs are the eager model's, its samples follow
the eager sampler's distribution (the checks and their statistics: tests/compiled_decode_checks.py),
and the CPU default leaves sampling to ``generate`` (so tests/test_rollout_cache.py and every
committed cell are unchanged). The CUDA tier runs the same checks on a GPU (tests/test_cuda.py).

One tiny model per module: its decode step compiles once (inductor, a C++ compiler: ~10 s, ~50 s
on a cold cache) and every test reuses it.
"""

from __future__ import annotations

import pytest
import torch
from compiled_decode_checks import (
    ALPHA,
    assert_same_distribution,
    distribution_verdict,
    rescore,
    sample,
    wrong_temperature,
)
from transformers import LlamaConfig, LlamaForCausalLM

from graftrl.embedded.models import build_char_tokenizer
from graftrl.embedded.task import make_problems
from graftrl.errors import UserError
from graftrl.models import compiled_decode
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, RolloutBatch, SamplingParams

PROMPTS = [p.problem for p in make_problems(None, 48, seed=11, task="worked")]


@pytest.fixture(scope="module")
def policy() -> Policy:
    """A 2-layer Llama over ~100 characters. initializer_range 0.15 (not 0.02) makes its next-token
    distributions peaked and context-dependent, so a sampler that conditions on the wrong thing
    shows; EOS is likely enough that within 24 tokens some rows finish and most do not."""
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.15,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return Policy("tiny", model, tokenizer, template="{problem}=")


def assert_identical(ours: RolloutBatch, theirs: RolloutBatch) -> None:
    assert ours.response_ids == theirs.response_ids and ours.finished == theirs.finished
    for a, b in zip(ours.behaviour_logprobs, theirs.behaviour_logprobs, strict=True):
        assert torch.equal(a, b)


def test_compiled_logprobs_equal_an_eager_rescore(policy):
    """45 rows (15 prompts x n = 3, padded to 48), top-p 0.9, shared prefill: every recorded
    log-prob is the eager model's log softmax(logits / T) of the sampled token; some rows end with
    EOS before the limit; the same seed gives the same samples."""
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_new_tokens=20)
    engine = HFRolloutEngine(compile=True)
    batch = engine.generate(policy, PROMPTS[:15], params, seed=4)
    [timing] = engine.timings
    assert (timing.rows, timing.padded_rows, timing.cache_length) == (45, 48, 256)
    assert not timing.graph  # CPU: compiled, no CUDA graph
    assert any(batch.finished) and not all(batch.finished)
    assert all(len(ids) <= 20 for ids in batch.response_ids)
    for ids, done in zip(batch.response_ids, batch.finished, strict=True):
        assert (ids[-1] == policy.eos_token_id) == done and policy.eos_token_id not in ids[:-1]

    checked = rescore(policy, batch, params.temperature, params.top_p)
    assert len(checked.logprob_errors) == sum(len(ids) for ids in batch.response_ids)
    assert checked.logprob_errors.max() < 1e-4

    assert_identical(engine.generate(policy, PROMPTS[:15], params, seed=4), batch)
    assert engine.generate(policy, PROMPTS[:15], params, seed=5).response_ids != batch.response_ids

    # weights changed in place, as an optimizer step changes them: the next call samples from them
    with torch.no_grad():
        policy.model.lm_head.weight.mul_(1.5)  # tied: the embeddings too
    try:
        changed = engine.generate(policy, PROMPTS[:15], params, seed=4)
        assert rescore(policy, changed, params.temperature, params.top_p).logprob_errors.max() < 1e-4
        assert changed.response_ids != batch.response_ids
    finally:
        with torch.no_grad():
            policy.model.lm_head.weight.div_(1.5)


def test_the_cpu_default_samples_with_generate(policy, monkeypatch):
    """``auto`` (the default) compiles on CUDA only: on CPU the sampler is ``generate`` as before."""
    monkeypatch.setattr("graftrl.models.rollout.sample_compiled", lambda *a, **k: pytest.fail("compiled"))
    engine = HFRolloutEngine()
    assert engine.compile == "auto"
    engine.generate(policy, PROMPTS[:4], SamplingParams(n=2, max_new_tokens=6), seed=0)
    assert engine.timings == [] and engine.compile_seconds == 0.0
    assert not compiled_decode.compile_applies("auto", policy.model)
    assert not compiled_decode.compile_applies(False, policy.model)
    assert compiled_decode.compile_applies(True, policy.model)


def test_compile_true_on_an_unsupported_model_names_the_setting(policy, monkeypatch):
    monkeypatch.setattr(policy.model, "_can_compile_fullgraph", False)
    engine = HFRolloutEngine(compile=True)
    with pytest.raises(UserError, match=r"rollout.compile: true, but LlamaForCausalLM does not declare"):
        engine.generate(policy, PROMPTS[:2], SamplingParams(n=2, max_new_tokens=4), seed=0)


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_rollout_compile_reaches_the_hf_engines(tiny_checkpoints, tmp_path, setting):
    from conftest import FIXTURES, make_config

    from graftrl.config import config_from_dict
    from graftrl.training.validation import Validator
    from graftrl.training.worker import make_engine

    raw = make_config(tiny_checkpoints)
    raw["rollout"]["compile"] = setting
    raw["validation"] = {"files": [str(FIXTURES / "math_small.jsonl")]}
    config = config_from_dict(raw)
    assert make_engine(config, policy=None).compile == setting
    assert Validator(config, tmp_path, verifier=None).engine.compile == setting


def test_shapes_are_bucketed():
    assert [compiled_decode.padded_rows(r) for r in (1, 8, 9, 64, 65)] == [8, 8, 16, 64, 72]
    assert compiled_decode.cache_length(10, 20) == 256
    assert compiled_decode.cache_length(40, 216) == 256
    assert compiled_decode.cache_length(41, 216) == 512


# ----- slow: the distribution, top-p, n = 1, both prefill layouts, bounded recompiles -------------
CASES = {
    "n=4, top-p 1, shared prefill": (SamplingParams(n=4, temperature=0.7, max_new_tokens=24), True, 16),
    "n=4, top-p 0.8, per-row prefill": (
        SamplingParams(n=4, temperature=1.0, top_p=0.8, max_new_tokens=24),
        False,
        16,
    ),
    "n=1, top-p 0.9": (SamplingParams(n=1, temperature=0.7, top_p=0.9, max_new_tokens=24), True, 48),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_samples_follow_the_eager_distribution(policy, case):
    """Seeds 0-3 of each sampler; ~1,000-4,000 sampled tokens per test (rows x tokens)."""
    params, share, prompts = CASES[case]
    seeds = range(4)
    compiled = sample(
        policy, HFRolloutEngine(share_prompts=share, compile=True), PROMPTS[:prompts], params, seeds
    )
    # other seeds for the eager sampler: on CPU it can draw exactly the compiled sampler's samples
    others = range(100, 104)
    eager = sample(policy, HFRolloutEngine(share_prompts=share), PROMPTS[:prompts], params, others)
    control = sample(policy, HFRolloutEngine(), PROMPTS[:prompts], wrong_temperature(params), others)
    verdict = distribution_verdict(policy, compiled, eager, control, params)
    assert verdict.tokens >= 1000, verdict
    assert_same_distribution(verdict)
    assert any(f for b in compiled for f in b.finished) and not all(f for b in compiled for f in b.finished)
    assert (
        max(rescore(policy, b, params.temperature, params.top_p).logprob_errors.max() for b in compiled)
        < 1e-4
    )
    assert ALPHA == 1e-3


@pytest.mark.slow
def test_row_counts_and_widths_in_a_bucket_compile_at_most_twice(policy):
    """Other row counts and prompt widths within one cache-length bucket: one compile with the rows
    symbolic at most, then none; a longer call (the next bucket) compiles once more."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    engine = HFRolloutEngine(compile=True)
    before = compiled_decode._compiled_graphs()
    for count in (3, 7, 12, 20, 33):  # rows 6 .. 66, widths differing with the problems
        engine.generate(policy, PROMPTS[count : 2 * count], params, seed=count)
    assert compiled_decode._compiled_graphs() - before <= 2
    middle = compiled_decode._compiled_graphs()
    engine.generate(policy, PROMPTS[:9], params, seed=1)
    assert compiled_decode._compiled_graphs() == middle
    longer = SamplingParams(n=2, temperature=1.0, max_new_tokens=300)  # cache 512
    engine.generate(policy, PROMPTS[:3], longer, seed=1)
    assert compiled_decode._compiled_graphs() == middle + 1
    assert engine.timings[0].cache_length == 512
