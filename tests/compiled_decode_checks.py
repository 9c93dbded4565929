"""The checks of the compiled decode path (``graftrl.models.compiled_decode``), shared by its CPU
tests (tests/test_compiled_decode.py) and the CUDA tier (tests/test_cuda.py).

Reference: an eager re-score. Each sampled response goes back through the model in one plain
forward pass over prompt + response (no cache, no compile), which gives, at every sampled position,
the eager model's behaviour distribution (``models.behaviour``: log softmax(logits / T), the nucleus
for the draw). Against it:

- **log-probs**: the recorded behaviour log-prob of every sampled token equals the re-score's
  log-prob of that token, within float tolerance;
- **distribution** (``pit_values``, ``distribution_verdict``): the randomised probability integral
  transform. Order the V tokens from most to least likely under p; for a token x drawn from p,
  u = P(X before x) + U * p(x), U uniform on [0, 1), is uniform on [0, 1); drawn step by step, each u is uniform given everything
  before it, so the u of all sampled tokens of all rows are independent uniforms exactly when the
  sampler draws each token from the eager model's conditional distribution. The test is
  Kolmogorov-Smirnov of the pooled u against U(0, 1) at ``ALPHA``. A sampler that read a wrong
  cache slot, a wrong position or the previous step's logits, used another temperature or nucleus,
  or drew from the padding row of another prompt, gives u that are not uniform. Power is shown, not
  assumed: the same test on samples drawn (by the eager sampler) at a wrong temperature must reject
  on the same model, prompts and sample size (``WRONG_TEMPERATURE``). A second test compares the two
  samplers directly: two-sample Kolmogorov-Smirnov of the per-response total log-probs (a sequence
  outcome) of the compiled and the eager sampler, at ``ALPHA``.

Seeds are fixed, so each check gives the same verdict on every run on one machine; under the null
a check rejects with probability ``ALPHA``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from graftrl.models.behaviour import behaviour_distribution
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, RolloutBatch, SamplingParams

ALPHA = 1e-3
"""Significance level of every distribution test here."""
WRONG_TEMPERATURE = 1.25
"""The negative control samples at this multiple of the checked temperature."""


@dataclass(frozen=True)
class Rescore:
    """The eager re-score of a batch's sampled tokens, flattened over rows and positions."""

    logprob_errors: np.ndarray
    """|recorded behaviour log-prob - re-scored log-prob| per sampled token."""
    pit: np.ndarray
    """The randomised PIT value u of each sampled token under the eager distribution."""


@torch.no_grad()
def rescore(
    policy: Policy,
    batch: RolloutBatch,
    temperature: float,
    top_p: float,
    seed: int = 0,
    rows_per_pass: int = 16,
) -> Rescore:
    """Re-score ``batch`` with plain eager forward passes (``rows_per_pass`` rows at a time)."""
    generator = torch.Generator().manual_seed(seed)
    errors, pits = [], []
    prompts = [batch.prompt_ids[row // batch.n] for row in range(len(batch.response_ids))]
    with policy.eval_mode():
        for start in range(0, len(prompts), rows_per_pass):
            rows = range(start, min(start + rows_per_pass, len(prompts)))
            padded = policy.pad([prompts[r] for r in rows], [batch.response_ids[r] for r in rows])
            width, length = padded.prompt_width, padded.response_ids.shape[1]
            with policy.autocast():
                logits = policy.model(
                    input_ids=padded.input_ids,
                    attention_mask=padded.attention_mask,
                    position_ids=padded.position_ids,
                    use_cache=False,
                ).logits[:, width - 1 : width - 1 + length]  # [B, Lr, V]
            vocab = logits.shape[-1]
            logprobs, truncated = behaviour_distribution(logits.reshape(-1, vocab), temperature, top_p)
            probs = torch.softmax(truncated, dim=-1)  # the draw's distribution
            ids = padded.response_ids.reshape(-1, 1)
            chosen = probs.gather(-1, ids).squeeze(-1)
            # Tokens ordered from most to least likely (not by id): then a sampler that is too
            # peaked, too flat or conditioned on the wrong context moves u to one side.
            ordered, order = torch.sort(probs, dim=-1, descending=True)
            rank = order.argsort(dim=-1).gather(-1, ids)
            below = ordered.cumsum(-1).gather(-1, rank).squeeze(-1) - chosen  # P(X before x)
            real = padded.response_mask.reshape(-1).bool()
            uniform = torch.rand(int(real.sum()), generator=generator, dtype=torch.float64)
            pits.append((below[real].double().cpu() + uniform * chosen[real].double().cpu()).numpy())
            rescored = logprobs.gather(-1, ids).squeeze(-1)[real].cpu()
            recorded = torch.cat([batch.behaviour_logprobs[r] for r in rows])
            errors.append((recorded - rescored.float()).abs().numpy())
    return Rescore(np.concatenate(errors), np.clip(np.concatenate(pits), 0.0, 1.0))


def sample(
    policy: Policy,
    engine: HFRolloutEngine,
    prompts: Sequence[str],
    params: SamplingParams,
    seeds: Sequence[int],
) -> list[RolloutBatch]:
    return [engine.generate(policy, prompts, params, seed=seed) for seed in seeds]


def pooled_rescore(policy: Policy, batches: Sequence[RolloutBatch], params: SamplingParams) -> Rescore:
    parts = [rescore(policy, b, params.temperature, params.top_p, seed=i) for i, b in enumerate(batches)]
    return Rescore(np.concatenate([p.logprob_errors for p in parts]), np.concatenate([p.pit for p in parts]))


def sequence_logprobs(batches: Sequence[RolloutBatch]) -> np.ndarray:
    """Each response's total behaviour log-prob (a sequence outcome of the sampler)."""
    return np.array([float(lp.sum()) for b in batches for lp in b.behaviour_logprobs])


@dataclass(frozen=True)
class DistributionVerdict:
    tokens: int
    """Sampled tokens the PIT test pooled."""
    pit_p: float
    """Kolmogorov-Smirnov p-value of the compiled sampler's u against U(0, 1)."""
    control_pit_p: float
    """The same test on the wrong-temperature samples (must reject: the test has power here)."""
    control_statistic: float
    """Its KS distance (the critical distance at ALPHA is about 1.95 / sqrt(tokens))."""
    two_sample_p: float
    """Two-sample KS p-value, compiled against eager, of the per-response total log-probs."""
    eager_pit_p: float
    """The PIT test on the eager sampler's own samples (the reference must pass its own test)."""

    def figures(self) -> dict[str, float]:
        return {k: round(float(v), 6) for k, v in self.__dict__.items()}


def distribution_verdict(
    policy: Policy,
    compiled: Sequence[RolloutBatch],
    eager: Sequence[RolloutBatch],
    control: Sequence[RolloutBatch],
    params: SamplingParams,
) -> DistributionVerdict:
    """The PIT test of the compiled samples, of the eager ones and of the wrong-temperature control,
    and the two-sample test of compiled against eager (``control`` drawn at
    WRONG_TEMPERATURE x ``params.temperature``, scored at ``params.temperature``)."""
    ours = pooled_rescore(policy, compiled, params)
    reference = pooled_rescore(policy, eager, params)
    wrong = pooled_rescore(policy, control, params)
    control_test = stats.kstest(wrong.pit, "uniform")
    return DistributionVerdict(
        tokens=len(ours.pit),
        pit_p=float(stats.kstest(ours.pit, "uniform").pvalue),
        control_pit_p=float(control_test.pvalue),
        control_statistic=float(control_test.statistic),
        two_sample_p=float(stats.ks_2samp(sequence_logprobs(compiled), sequence_logprobs(eager)).pvalue),
        eager_pit_p=float(stats.kstest(reference.pit, "uniform").pvalue),
    )


def assert_same_distribution(verdict: DistributionVerdict) -> None:
    assert verdict.control_pit_p < ALPHA, f"the test has no power here: {verdict}"
    assert verdict.eager_pit_p >= ALPHA, f"the eager reference fails its own test: {verdict}"
    assert verdict.pit_p >= ALPHA, f"compiled samples do not follow the eager distribution: {verdict}"
    assert verdict.two_sample_p >= ALPHA, f"compiled and eager samples differ: {verdict}"


def wrong_temperature(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        n=params.n,
        temperature=params.temperature * WRONG_TEMPERATURE,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
    )


@torch.no_grad()
def temperature_for_spread(policy: Policy, prompts: Sequence[str], spread: float = 2.0) -> float:
    """The temperature at which the model's next-token logits after ``prompts`` have a standard
    deviation of ``spread`` (median over the prompts): peaked enough for the distribution tests to
    have power on any model (a random-init model's logits are nearly flat), the same relative
    sharpness whatever the model's size."""
    batch = policy.pad(policy.encode_prompts(prompts), [[] for _ in prompts])
    width = batch.prompt_width
    with policy.eval_mode(), policy.autocast():
        logits = policy.model(
            input_ids=batch.input_ids[:, :width],
            attention_mask=batch.attention_mask[:, :width],
            position_ids=batch.position_ids[:, :width],
        ).logits[:, -1]
    return float(logits.float().std(dim=-1).median()) / spread
