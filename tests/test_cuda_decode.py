"""The CUDA tier's checks of the compiled decode path (``rollout.compile``): on the tier's Qwen2 with
Qwen2.5-0.5B's shape, in bf16, the static cache, the compiled step and its CUDA graph give the eager
model's behaviour log-probs and the eager sampler's distribution (the checks and their statistics:
tests/compiled_decode_checks.py; on CPU, tests/test_compiled_decode.py). Run with the tier
(``bash scripts/gpu_check.sh``, or its dry run on CPU at tiny size); sizes and environment:
tests/cuda_tier.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compiled_decode_checks import (
    assert_same_distribution,
    distribution_verdict,
    rescore,
    sample,
    temperature_for_spread,
    wrong_temperature,
)
from cuda_tier import CUDA, DEVICE, DTYPE, FIGURES, LOGP_ATOL, SIZE, build_model, models_root

from graftrl.embedded.task import make_problems
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE is None,
        reason="no CUDA device (GRAFTRL_CUDA_TIER_ON_CPU=1 runs this tier on CPU at tiny size)",
    ),
]

PROMPTS = [p.problem for p in make_problems(None, 32, seed=11, task="worked")]
NEW_TOKENS = 32 if SIZE.name == "full" else 16
"""32 prompts x n = 4 x NEW_TOKENS: ~4,000 sampled tokens per sampler on the GPU, in one call."""


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Policy:
    """The tier's Qwen2 (built by tests/test_cuda.py's fixtures when the tier runs, else here)."""
    path = build_model(models_root(tmp_path_factory) / f"{SIZE.name}-qwen", "qwen2", SIZE.qwen)
    return Policy.from_pretrained("qwen", str(path), dtype=DTYPE, device=DEVICE, template="{problem}=")


def test_compiled_decode_logprobs_equal_an_eager_rescore(qwen):
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=NEW_TOKENS)
    engine = HFRolloutEngine(compile=True)
    engine.generate(qwen, PROMPTS, params, seed=1)  # compiles (timed apart)
    first = engine.timings[0]
    batch = engine.generate(qwen, PROMPTS, params, seed=2)
    [timing] = engine.timings
    errors = rescore(qwen, batch, params.temperature, params.top_p).logprob_errors
    # New weights in place (as an optimizer step writes them): the next call samples from them.
    with torch.no_grad():
        for parameter in qwen.model.parameters():
            parameter.mul_(1.02)
    after = engine.generate(qwen, PROMPTS, params, seed=3)
    errors_after = rescore(qwen, after, params.temperature, params.top_p).logprob_errors
    with torch.no_grad():
        for parameter in qwen.model.parameters():
            parameter.div_(1.02)
    FIGURES.record(
        "compiled_decode_logprobs",
        first_call=dataclasses.asdict(first),
        timing=dataclasses.asdict(timing),
        ms_per_step=1000 * timing.decode_s / max(1, timing.steps - 1),
        tokens=len(errors),
        max_error=float(errors.max()),
        mean_error=float(errors.mean()),
        max_error_after_update=float(errors_after.max()),
    )
    assert timing.compile_s == 0.0 and timing.graph == CUDA  # CUDA: the steps replay a CUDA graph
    assert errors.max() < LOGP_ATOL and errors_after.max() < LOGP_ATOL


def test_compiled_decode_follows_the_eager_distribution(qwen):
    temperature = temperature_for_spread(qwen, PROMPTS)
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=NEW_TOKENS)
    compiled = sample(qwen, HFRolloutEngine(compile=True), PROMPTS, params, [0])
    eager = sample(qwen, HFRolloutEngine(compile=False), PROMPTS, params, [100])
    control = sample(qwen, HFRolloutEngine(compile=False), PROMPTS, wrong_temperature(params), [100])
    verdict = distribution_verdict(qwen, compiled, eager, control, params)
    FIGURES.record("compiled_decode_distribution", temperature=temperature, **verdict.figures())
    assert verdict.tokens >= 1000
    assert_same_distribution(verdict)
