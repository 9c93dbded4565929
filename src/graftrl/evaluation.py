"""pass@1 on held-out problems with the paper's sampling protocol (SPEC section 4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graftrl.data import MathProblem
from graftrl.policy import Policy
from graftrl.rewards import MathVerifier
from graftrl.rollout import HFRolloutEngine, SamplingParams


@dataclass(frozen=True)
class EvalProtocol:
    samples: int = 8
    """Samples per problem."""
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    prompt_suffix: str | None = None
    """Same suffix as training."""


def evaluate_pass_at_1(
    policy: Policy,
    problems: Sequence[MathProblem],
    verifier: MathVerifier,
    protocol: EvalProtocol = EvalProtocol(),
    seed: int = 0,
    engine: HFRolloutEngine | None = None,
) -> dict[str, float | list[float]]:
    """Mean correctness over samples, then over problems. Returns pass_at_1 and per-problem rates."""
    engine = engine or HFRolloutEngine()
    params = SamplingParams(protocol.samples, protocol.temperature, protocol.top_p, protocol.max_new_tokens)
    prompts = [
        f"{p.problem} {protocol.prompt_suffix}" if protocol.prompt_suffix else p.problem for p in problems
    ]
    torch.manual_seed(seed)
    batch = engine.generate(policy, prompts, params)
    answers = [p.answer for p in problems for _ in range(protocol.samples)]
    rewards = torch.tensor(verifier.score(batch.texts, answers), dtype=torch.float32).view(
        len(problems), protocol.samples
    )
    per_problem = rewards.mean(dim=-1)
    return {"pass_at_1": float(per_problem.mean()), "per_problem": per_problem.tolist()}
