"""The vLLM rollout engine against the trainer and the HF engine (tier ``-m vllm``).

Runs in the vLLM venv (``scripts/setup_vllm.sh``):
``PYTHONPATH=src .venv-vllm/bin/python -m pytest -m vllm -p no:cacheprovider tests/test_vllm.py``.
Engines run in-process (seconds to start); most tests share one per architecture (``shared``).
"""

from __future__ import annotations

import gc
import math
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, RolloutBatch, SamplingParams
from graftrl.models.rollout_vllm import (  # imports vLLM only when an engine starts
    VLLMOptions,
    VLLMRolloutEngine,
)

# Deselected by default (pyproject addopts); `-m vllm` runs it where vLLM is installed.
pytestmark = pytest.mark.vllm

TEMPLATES = {"llama": "{problem}=", "gpt2": "Q: {problem}\nA: "}
TEMPERATURE = 0.7
TOP_P = 0.9
OPTIONS = VLLMOptions(kv_cache_space_gib=0.125)
ARCHS = ["llama", "gpt2"]


def _addition(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = [(rng.randrange(50), rng.randrange(50)) for _ in range(count)]
    return [(f"What is {a} + {b}?", f"\\boxed{{{a + b}}}") for a, b in pairs]


PROBLEMS = _addition(64, seed=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A char-level Llama and a BPE GPT-2 (random init) as in conftest, with head_dim 32.

    conftest's models have head_dim 16, which vLLM's CPU attention kernel does not support
    (its smallest head size is 32).
    """
    from graftrl.embedded.models import build_bpe_tokenizer, build_char_tokenizer, build_model
    from graftrl.storage.data import load_problems

    root = tmp_path_factory.mktemp("vllm-checkpoints")
    corpus = [p.problem + " " + p.answer for p in load_problems(FIXTURES / "math_small.jsonl")]
    corpus += [f"{q} {a}" for q, a in PROBLEMS]
    specs = {"llama": build_char_tokenizer(), "gpt2": build_bpe_tokenizer(corpus, vocab_size=300)}
    paths = {}
    for arch, tokenizer in specs.items():
        model = build_model(arch, tokenizer, hidden=64, layers=2, heads=2, max_positions=512, seed=1)
        model.save_pretrained(root / arch)
        tokenizer.save_pretrained(root / arch)
        paths[arch] = root / arch
    return paths


def _load(checkpoints: dict[str, Path], arch: str) -> Policy:
    return Policy.from_pretrained(
        arch, str(checkpoints[arch]), device="cpu", template=TEMPLATES[arch], temperature=TEMPERATURE
    )


def _nll_steps(
    policy: Policy, prompts: list[list[int]], responses: list[list[int]], steps: int, lr: float
) -> None:
    """Supervised steps on (prompt, response) pairs: moves the policy's distribution visibly."""
    policy.configure_optimizer(lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    assert policy.optimizer is not None
    policy.model.train()
    batch = policy.pad(prompts, responses)
    for _ in range(steps):
        logprobs = policy.response_logprobs(batch)
        loss = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
        policy.optimizer.zero_grad()
        loss.backward()
        policy.optimizer.step()
    policy.model.eval()


def _warm_start(policy: Policy) -> None:
    """A few supervised steps towards ``\\boxed{answer}<eos>``: half-learnt on purpose.

    After 15 steps the first token is peaked but not fixed and ~80% of 16-token samples end with
    EOS, at lengths from 3 to 16: every statistic compared below varies.
    """
    problems = [q for q, _ in PROBLEMS]
    responses = [policy.encode_response(a, finished=True) for _, a in PROBLEMS]
    _nll_steps(policy, policy.encode_prompts(problems), responses, steps=15, lr=3e-3)


@pytest.fixture(scope="module")
def shared(checkpoints) -> Iterator[dict[str, tuple[Policy, VLLMRolloutEngine]]]:
    """Per architecture: a warm-started policy (in memory, never saved) and its engine."""
    out = {}
    for arch in ARCHS:
        policy = _load(checkpoints, arch)
        _warm_start(policy)
        out[arch] = (policy, VLLMRolloutEngine(policy, OPTIONS, seed=0))
    yield out
    for _, engine in out.values():
        engine.close()


def _row_prompts(batch: RolloutBatch) -> list[list[int]]:
    return [batch.prompt_ids[row // batch.n] for row in range(len(batch.response_ids))]


def _max_gap(policy: Policy, batch: RolloutBatch) -> float:
    """Largest |behaviour log-prob - trainer recomputation| over all response tokens."""
    rescored = policy.score(_row_prompts(batch), batch.response_ids)
    gaps = [
        (behaviour - recomputed).abs().max().item()
        for behaviour, recomputed in zip(batch.behaviour_logprobs, rescored, strict=True)
        if len(behaviour)
    ]
    return max(gaps)


PARAMS = SamplingParams(n=4, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=24)


@pytest.mark.parametrize("arch", ARCHS)
def test_behaviour_logprobs_equal_the_trainer_recomputation(shared, arch):
    """log softmax(logits / T) before top-p: vLLM's processed_logprobs would be off by ~-log(0.9)."""
    policy, engine = shared[arch]
    batch = engine.generate(policy, [q for q, _ in PROBLEMS[:16]], PARAMS, seed=0)
    assert len(batch.response_ids) == 16 * PARAMS.n and batch.n == PARAMS.n
    for ids, logprobs in zip(batch.response_ids, batch.behaviour_logprobs, strict=True):
        assert logprobs.dtype == torch.float32 and logprobs.shape == (len(ids),)
        assert (logprobs <= 0).all()
    assert _max_gap(policy, batch) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_sync_weights_makes_the_engine_sample_the_new_weights(checkpoints, arch):
    policy = _load(checkpoints, arch)
    rng_state = torch.get_rng_state()
    set_num_threads = torch.set_num_threads
    with VLLMRolloutEngine(policy, OPTIONS, seed=1) as engine:
        # Starting an in-process engine leaves the trainer's RNG and thread settings alone.
        assert torch.equal(torch.get_rng_state(), rng_state)
        assert torch.set_num_threads is set_num_threads
        problems = [q for q, _ in PROBLEMS[:16]]
        first = engine.generate(policy, problems, PARAMS, seed=1)
        assert _max_gap(policy, first) < 1e-4

        old = policy.frozen_copy()
        _nll_steps(policy, _row_prompts(first), first.response_ids, steps=5, lr=1e-2)

        stale = engine.generate(policy, problems, PARAMS, seed=2)
        assert _max_gap(old, stale) < 1e-4  # still the old weights ...
        assert _max_gap(policy, stale) > 0.05  # ... which the trainer no longer has

        engine.sync_weights(policy)
        fresh = engine.generate(policy, problems, PARAMS, seed=2)
        assert _max_gap(policy, fresh) < 1e-4
        assert _max_gap(old, fresh) > 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_samples_and_eos(shared, arch):
    policy, engine = shared[arch]
    problems = [q for q, _ in PROBLEMS[:16]]
    params = SamplingParams(n=4, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=8)
    first = engine.generate(policy, problems, params, seed=7)
    again = engine.generate(policy, problems, params, seed=7)
    other = engine.generate(policy, problems, params, seed=8)
    assert first.response_ids == again.response_ids
    assert all(
        torch.equal(a, b) for a, b in zip(first.behaviour_logprobs, again.behaviour_logprobs, strict=True)
    )
    assert first.response_ids != other.response_ids
    # Unseeded calls draw from the engine's own stream: new samples each time, trainer RNG untouched.
    rng_state = torch.get_rng_state()
    unseeded = [engine.generate(policy, problems, params).response_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]
    assert torch.equal(torch.get_rng_state(), rng_state)

    assert first.prompt_ids == policy.encode_prompts(problems)
    eos = policy.eos_token_id
    assert any(first.finished) and not all(first.finished)  # both cases are exercised
    for ids, done, text in zip(first.response_ids, first.finished, first.texts, strict=True):
        assert eos not in ids[:-1]
        assert done == (ids[-1:] == [eos])
        assert done or len(ids) == params.max_new_tokens
        assert text == policy.decode_response(ids[:-1] if done else ids)
        assert "<eos>" not in text

    with pytest.raises(ValueError, match="serves policy"):
        engine.generate(policy.frozen_copy(), problems, params)


class _RecordingRewards:
    """Scores by length parity and keeps every text it was asked to score."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def score(self, responses: list[str], answers: list[str]) -> list[float]:
        self.texts += responses
        return [float(len(r) % 2) for r in responses]


def test_evaluation_samples_with_the_engine_on_a_reseeded_stream(shared):
    """Evaluation and validation take any RolloutEngine: chunks of ``max_batch_size`` rows, and
    ``reseed(seed)`` makes a seeded evaluation repeatable, without touching the trainer's RNG."""
    from graftrl.evaluation.evaluate import EvalProtocol, sample_correctness
    from graftrl.storage.data import MathProblem

    policy, engine = shared["llama"]
    problems = [MathProblem(str(i), q, a) for i, (q, a) in enumerate(PROBLEMS[:10])]
    protocol = EvalProtocol(samples=4, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=8, runs=1)
    default_size = engine.max_batch_size
    engine.max_batch_size = 12  # 3 prompts of 4 samples per call
    try:
        rng_state = torch.get_rng_state()
        chunks: list[int] = []
        runs = {name: _RecordingRewards() for name in ("first", "again", "other")}
        correct = sample_correctness(policy, problems, runs["first"], protocol, 5, engine, chunks.append)
        sample_correctness(policy, problems, runs["again"], protocol, 5, engine)
        sample_correctness(policy, problems, runs["other"], protocol, 6, engine)
    finally:
        engine.max_batch_size = default_size
    assert chunks == [3, 3, 3, 1]
    assert len(correct) == 10 and all(len(row) == 4 for row in correct)
    assert len(runs["first"].texts) == 40
    assert runs["first"].texts == runs["again"].texts
    assert runs["first"].texts != runs["other"].texts
    assert torch.equal(torch.get_rng_state(), rng_state)


def _z(a: list[float], b: list[float]) -> float:
    """Two-sample z statistic for a difference of means (unpooled variances)."""
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    var_a = sum((x - mean_a) ** 2 for x in a) / (len(a) - 1)
    var_b = sum((x - mean_b) ** 2 for x in b) / (len(b) - 1)
    return (mean_a - mean_b) / math.sqrt(var_a / len(a) + var_b / len(b) + 1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_samples_agree_with_the_hf_engine(shared, arch):
    """Same policy, 64 prompts x 8 samples from each engine: the response-level statistics agree.

    Each statistic is a mean over 512 responses, compared with a two-sample z test. Variances
    are taken over all responses, prompts pooled, which overstates the variance of the difference
    (both engines see the same prompts), so |z| < 4.5 is conservative: a false alarm has
    probability < 1e-5 per statistic. A real mismatch is large: sampling at T = 1 instead of 0.7,
    or without top-p, moves the mean response log-prob by > 10 standard errors.
    """
    policy, engine = shared[arch]
    problems = [q for q, _ in PROBLEMS]
    params = SamplingParams(n=8, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=16)
    ours = engine.generate(policy, problems, params, seed=11)
    reference = HFRolloutEngine().generate(policy, problems, params, seed=12)

    # The reference's three most frequent first tokens: their frequencies are compared too.
    common = [token for token, _ in Counter(ids[0] for ids in reference.response_ids).most_common(3)]

    def statistics(batch: RolloutBatch) -> dict[str, list[float]]:
        rows = range(len(batch.response_ids))
        return {
            "response log-prob": [float(batch.behaviour_logprobs[r].sum()) for r in rows],
            "mean token log-prob": [batch.content_mean_logprob(r) for r in rows],
            "length": [float(batch.content_length(r)) for r in rows],
            "finished": [float(done) for done in batch.finished],
            **{f"first token {t}": [float(ids[0] == t) for ids in batch.response_ids] for t in common},
        }

    ours_stats, reference_stats = statistics(ours), statistics(reference)
    assert 0.05 < sum(reference_stats["finished"]) / 512 < 0.95  # EOS is part of what is compared
    for name, values in reference_stats.items():
        z = _z(ours_stats[name], values)
        assert abs(z) < 4.5, f"{name}: vLLM vs HF z = {z:.2f}"


def test_closing_or_dropping_an_engine_leaves_the_others_working(shared, checkpoints):
    """In-process engines share vLLM's distributed state; only the last one may tear it down."""
    policy, engine = shared["llama"]
    closed = VLLMRolloutEngine(_load(checkpoints, "gpt2"), OPTIONS)
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        closed.generate(policy, ["1+1"], PARAMS)
    dropped = VLLMRolloutEngine(_load(checkpoints, "gpt2"), OPTIONS)
    del dropped
    gc.collect()
    batch = engine.generate(policy, [q for q, _ in PROBLEMS[:4]], PARAMS, seed=3)
    assert _max_gap(policy, batch) < 1e-4


def test_a_model_vllm_cannot_run_fails_at_start_with_a_hint(shared, tiny_checkpoints):
    """conftest's models have head_dim 16, below what vLLM's CPU attention supports."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size limit is the CPU backend's")
    small = Policy.from_pretrained("small", str(tiny_checkpoints["llama"]), device="cpu")
    with pytest.raises(RuntimeError, match="head size"):
        VLLMRolloutEngine(small, OPTIONS)
    policy, engine = shared["llama"]  # the failed start closed itself without harming the others
    assert _max_gap(policy, engine.generate(policy, [q for q, _ in PROBLEMS[:4]], PARAMS, seed=4)) < 1e-4


def test_sleep_mode_is_refused_without_a_gpu(shared):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("sleep mode exists on this platform")
    policy, engine = shared["llama"]
    assert not engine.sleep_enabled
    with pytest.raises(ValueError, match="sleep mode"):
        VLLMRolloutEngine(policy, VLLMOptions(sleep=True))
