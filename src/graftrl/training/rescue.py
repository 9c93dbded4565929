"""The rescue round of a method that ``rescues`` (``method: hint``, CoRe; algorithm.md §3.1).

Between a step's rollout and its plan: the driver asks the method which of each receiver's
all-fail prompts a peer solved and builds each hinted problem text from the peer's successful
response (``rescue_requests``; a stored peer's response is its stored text), every receiver's
worker fits the hint to its context, samples n responses, verifies them and puts them in place of
the all-fail group in the rollout batch it will train on (``sample_rescue``), and the driver gives
the rescued groups their advantages (``run_rescue``). The round's rollouts count in the step's
``time_rollout``/``time_reward`` and in ``rescue_attempted`` (compare's rollouts per model).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from graftrl.core.hint import rescue_counts
from graftrl.methods import GroupOutcomes, Method
from graftrl.methods.hint import hinted_problem
from graftrl.models.prompts import fit_hint
from graftrl.models.rollout import RolloutBatch
from graftrl.storage.data import MathProblem
from graftrl.storage.records import TrajectoryRecord
from graftrl.training.sampling import PolicyRollout, with_suffix
from graftrl.training.trajectories import rollout_records

if TYPE_CHECKING:
    from graftrl.models.policy import Policy


class Rescuers(Protocol):
    """What the round needs of the workers (``backends.WorkerGroup.rescue``, which imports this
    module)."""

    def rescue(self, request: RescueRoundRequest) -> list[RescueResult | None]: ...


@dataclass(frozen=True)
class RescueRequest:
    """One receiver's rescue round at a step (R prompts)."""

    prompts: list[int]
    """[R] indices of the rescued prompts in the step's batch."""
    problems: list[str]
    """[R] each problem's text as the cold round sampled it (its suffix included)."""
    hints: list[str]
    """[R] the hint of each (the peer's response as the method's ``form`` cuts it)."""
    answers: list[str]
    """[R] each problem's reference answer."""
    sources: list[str]
    """[R] the peer each hint comes from."""
    template: str
    """The method's hinted problem text, with {problem} and {hint}."""
    condition: str
    """``hinted``: the rows keep the hinted prompt; ``original``: the cold round's prompt."""


@dataclass(frozen=True)
class RescueRoundRequest:
    """The round at a step, every receiver's request in policy order (``WorkerGroup.rescue``;
    the backend's request, beside the other calls' in ``worker_calls``, which imports this module)."""

    step: int
    requests: tuple[RescueRequest | None, ...]
    """Each policy's request (None: it rescues nothing)."""


@dataclass(frozen=True)
class RescueResult:
    """What a receiver's rescue round sampled (R' <= R prompts: those whose hint fit)."""

    prompts: list[int]
    """[R'] the prompts sampled again (a request's, less those skipped)."""
    rewards: Tensor
    """[R', n] verifier rewards of the responses sampled with the hint."""
    records: list[TrajectoryRecord]
    """[R' * n] their records (advantage 0: the trained advantages are the outcomes')."""
    hinted: list[str] = field(default_factory=list)
    """[R'] each hinted problem text as sampled (its hint cut to the context)."""
    truncated: int = 0
    """Hints cut to fit the context."""
    skipped: int = 0
    """Prompts not sampled again: not even a one-character hint fit."""
    timings: dict[str, float] = field(default_factory=dict)
    """``time_rollout`` and ``time_reward`` of the round."""


def sample_rescue(
    step: int,
    name: str,
    request: RescueRequest,
    rollout: RolloutBatch,
    problems: Sequence[MathProblem],
    *,
    policy: Policy,
    max_new_tokens: int,
    generate: Callable[[list[str], int], RolloutBatch],
    score: Callable[[list[str], list[MathProblem]], list[float]],
    seed: int,
) -> RescueResult:
    """A worker's half of the round: fit each hint to the context, sample n responses per hinted
    prompt, verify them, and put them into ``rollout`` (in place) where the all-fail group was.

    With ``condition: hinted`` the group's prompt ids become the hinted prompt's; with
    ``original`` they stay the cold round's, so the update's ratio divides the policy on the
    original prompt by the hinted sampling's log-probs (off-policy)."""
    context = policy.context_length
    budget = None if context is None else context - max_new_tokens
    texts, prompts, truncated = [], [], 0
    for prompt, problem, hint in zip(request.prompts, request.problems, request.hints, strict=True):
        fitted = fit_hint(
            lambda h, p=problem: hinted_problem(request.template, p, h),
            hint,
            lambda text: len(policy.encode_prompts([text])[0]),
            budget,
        )
        if fitted is not None:
            texts.append(fitted[0])
            prompts.append(prompt)
            truncated += int(fitted[1])
    skipped = len(request.prompts) - len(prompts)
    n = rollout.n
    if not prompts:
        return RescueResult([], torch.zeros(0, n), [], [], truncated, skipped)
    start = time.perf_counter()
    batch = generate(texts, seed)
    sampled = time.perf_counter()
    # each response's problem row (the verifier's; its answer is the request's, the same prompt's)
    rewards = torch.tensor(
        score(batch.texts, [problems[p] for p in prompts for _ in range(n)]), dtype=torch.float32
    ).view(len(prompts), n)
    scored = time.perf_counter()
    for j, prompt in enumerate(prompts):
        if request.condition == "hinted":
            rollout.prompt_ids[prompt] = batch.prompt_ids[j]
        for i in range(n):
            row, new = prompt * n + i, j * n + i
            rollout.response_ids[row] = batch.response_ids[new]
            rollout.behaviour_logprobs[row] = batch.behaviour_logprobs[new]
            rollout.finished[row] = batch.finished[new]
            rollout.texts[row] = batch.texts[new]
    records = rollout_records(
        step, name, [problems[p] for p in prompts], batch, rewards, torch.zeros_like(rewards)
    )
    timings = {"time_rollout": sampled - start, "time_reward": scored - sampled}
    return RescueResult(prompts, rewards, records, texts, truncated, skipped, timings)


def rescue_requests(
    method: Method,
    receivers: Sequence[str],
    problems: Sequence[MathProblem],
    outcomes: Mapping[str, GroupOutcomes],
    records: Mapping[str, Sequence[TrajectoryRecord]],
    prompt_suffix: str | None,
) -> tuple[list[RescueRequest | None], dict[str, dict[str, float]]]:
    """Each receiver's request (None: nothing to rescue) from the cold round of every model, and
    the count of its targets per source (``rescue/<source>``)."""
    options: Any = method.options
    requests: list[RescueRequest | None] = []
    per_source: dict[str, dict[str, float]] = {}
    for receiver in receivers:
        targets = method.rescue_targets(receiver, outcomes, records)  # type: ignore[attr-defined]
        counts: dict[str, float] = {}
        for target in targets:
            counts[f"rescue/{target.source}"] = counts.get(f"rescue/{target.source}", 0.0) + 1
        per_source[receiver] = counts
        if not targets:
            requests.append(None)
            continue
        n = outcomes[receiver].n
        requests.append(
            RescueRequest(
                prompts=[t.prompt for t in targets],
                problems=[with_suffix(problems[t.prompt].problem, prompt_suffix) for t in targets],
                hints=[
                    method.hint_for(records[t.source][t.prompt * n + t.response].response)  # type: ignore[attr-defined]
                    for t in targets
                ],
                answers=[problems[t.prompt].answer for t in targets],
                sources=[t.source for t in targets],
                template=options.template,
                condition=options.condition,
            )
        )
    return requests, per_source


@dataclass(frozen=True)
class RescueRound:
    """What a step's rescue round gives the trainer (``run_rescue``)."""

    diagnostics: dict[str, dict[str, float]]
    """Receiver -> its plan diagnostics (``Hint.plan_keys``)."""
    rows: dict[str, list[dict[str, Any]]]
    """Receiver -> its rescues.jsonl rows, one per rescued response (``storage.log_keys.RESCUE_KEYS``)."""


def log_rows(
    step: int, receiver: str, request: RescueRequest, result: RescueResult, texts: bool
) -> list[dict[str, Any]]:
    """One rescues.jsonl row per response sampled with a hint; its text only with ``texts``
    (``logging.log_transfers``)."""
    source = dict(zip(request.prompts, request.sources, strict=True))
    n = result.rewards.shape[-1]
    rows = []
    for j, prompt in enumerate(result.prompts):
        for record in result.records[j * n : (j + 1) * n]:
            row = {
                "step": step,
                "receiver": receiver,
                "source": source[prompt],
                "prompt_id": record.prompt_id,
                "index": record.index,
                "reward": record.reward,
                "hinted": result.hinted[j],
            }
            if texts:
                row["response"] = record.response
            rows.append(row)
    return rows


def run_rescue(
    method: Method,
    backend: Rescuers,
    step: int,
    receivers: Sequence[str],
    problems: Sequence[MathProblem],
    sampled: dict[str, PolicyRollout],
    outcomes: dict[str, GroupOutcomes],
    records: Mapping[str, Sequence[TrajectoryRecord]],
    prompt_suffix: str | None,
    texts: bool = False,
) -> RescueRound:
    """The round for every receiver: puts the rescued groups into the receivers' ``outcomes`` (in
    place), adds the round's time to their timings, and returns each receiver's diagnostics and
    log rows (``texts``: with the responses' text). ``records`` stay the cold round's (what a peer, the store and the
    probe's samples see); the rescued responses live in the workers' rollout batches."""
    requests, per_source = rescue_requests(method, receivers, problems, outcomes, records, prompt_suffix)
    results = backend.rescue(RescueRoundRequest(step, tuple(requests)))
    diagnostics: dict[str, dict[str, float]] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    for receiver, request, result in zip(receivers, requests, results, strict=True):
        row = {"rescue_attempted": 0.0, "rescue_solved": 0.0, "rescue_truncated": 0.0, "rescue_skipped": 0.0}
        row.update(per_source[receiver])
        if request is not None and result is not None:
            attempted, solved = rescue_counts(result.rewards, outcomes[receiver].success_threshold)
            row.update(
                rescue_attempted=float(attempted),
                rescue_solved=float(solved),
                rescue_truncated=float(result.truncated),
                rescue_skipped=float(result.skipped),
            )
            if attempted:
                row["rescue_rate"] = solved / attempted
                row["rescue_reward_mean"] = float(result.rewards.mean())
            rows[receiver] = log_rows(step, receiver, request, result, texts)
            outcomes[receiver] = method.rescued_outcomes(outcomes[receiver], result.prompts, result.rewards)  # type: ignore[attr-defined]
            timings = sampled[receiver].timings
            for key, seconds in result.timings.items():
                timings[key] = timings.get(key, 0.0) + seconds
        diagnostics[receiver] = row
    return RescueRound(diagnostics, rows)
