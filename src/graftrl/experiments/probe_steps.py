"""The model work of `graftrl probe`: training steps up to the update, on the config's own prompts.

A probe step is a training step without an optimizer step, run by the trainer's own phases:
``Trainer.exchange`` (every policy samples and verifies the step's prompts with the configured
engine and backend, stored peers join, the method plans), then the update's row building
(``WorkerGroup.score_peers`` -> ``rows.build_rows``: re-tokenization, the no-grad scoring pass,
s, w, the moved groups' contrast), per receiver:

- on the method's own plan, exactly as the update at that step would build it: what the
  method would move, admit and teach;
- on every candidate peer group (eq. 4: a peer's mixed group on a prompt where the receiver
  failed all n), scored with GRAFT's rule (``graft:`` section, whatever the method): the
  distribution of s over everything the receiver could receive. Under GRAFT the groups its plan
  moves as they stand are candidate groups already scored by the first pass: only the others
  are scored again.

Prompts are the trainer's: step s takes ``PromptSampler.batch(s)`` of ``train.batch_prompts``
training prompts, so step 0 is the first training step (same prompts, same seeds, same numbers)
and the cost of a probe step is the cost of a training step's rollout and peer scoring.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graftrl.config import Config
from graftrl.core import transfer_candidates
from graftrl.methods import ExchangePlan, GroupOutcomes, TrainGroup, build_method
from graftrl.models.policy import Policy
from graftrl.reporting.probe_stats import ProbeError
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.training.rows import CompatibilityScores
from graftrl.training.trainer import StepExchange, Trainer
from graftrl.training.worker_calls import PeerScores

CANDIDATE_RULE = "graft"
"""The method whose compatibility score and weight (eq. 7-8, its ``graft:`` section) every
candidate peer group is scored with."""


def probe_config(config: Config) -> tuple[Config, list[str]]:
    """The config a probe runs: the user's, less what a probe does not do (records, validation,
    dynamic sampling), with a note for each change that alters what is measured."""
    notes = []
    rollout = config.rollout
    if rollout.dynamic_sampling:
        notes.append(
            "rollout.dynamic_sampling is off in the probe: it measures each policy on the shared "
            "prompts once (a training step may draw more prompts, and cost more)"
        )
        rollout = rollout.model_copy(update={"dynamic_sampling": False})
    update = {
        "rollout": rollout,
        "store": config.store.model_copy(update={"record": False}),
        "validation": config.validation.model_copy(update={"files": {}}),
    }
    return config.model_copy(update=update), notes


def probe_batches(problems: Sequence[MathProblem], config: Config, prompts: int) -> list[list[MathProblem]]:
    """The trainer's first ``ceil(prompts / batch_prompts)`` batches, the last one cut to make
    ``prompts`` in all: distinct training prompts (one epoch's permutation), in training order."""
    if not 1 <= prompts <= len(problems):
        raise ProbeError(
            f"--prompts {prompts}: data.train ({config.data.train}) holds {len(problems)} prompts; "
            f"probe between 1 and {len(problems)}"
        )
    size = config.train.batch_prompts
    sampler = PromptSampler(problems, size, config.seed)
    return [sampler.batch(step)[: prompts - step * size] for step in range(math.ceil(prompts / size))]


def candidate_plans(
    outcomes: Mapping[str, GroupOutcomes], receivers: Sequence[str]
) -> dict[str, ExchangePlan]:
    """Each receiver's every candidate peer group (eq. 4, each source's, in source then prompt
    order), every response with its source advantage: all that any transfer rule could move."""
    plans = {}
    for receiver in receivers:
        mine = outcomes[receiver]
        groups = []
        for source, theirs in outcomes.items():
            if source == receiver:
                continue
            chosen = transfer_candidates(mine.successes, theirs.successes, theirs.n)  # [P]
            groups += [
                TrainGroup(prompt=p, source=source, peer=True, advantages=theirs.advantages[p])
                for p in chosen.nonzero().flatten().tolist()
            ]
        plans[receiver] = ExchangePlan(groups=groups)
    return plans


def reusable_groups(plan: ExchangePlan, outcomes: Mapping[str, GroupOutcomes]) -> set[tuple[str, int]]:
    """(source, prompt) of the plan's peer groups that are candidate groups as they stand (every
    response, the source's advantages): their rows scored for the method are the candidates'."""
    return {
        (g.source, g.prompt)
        for g in plan.peer_groups
        if not g.nll and g.keep is None and torch.equal(g.advantages, outcomes[g.source].advantages[g.prompt])
    }


def merged_scores(
    plan: ExchangePlan, parts: Sequence[tuple[ExchangePlan, PeerScores, set[tuple[str, int]] | None]], n: int
) -> CompatibilityScores | None:
    """The scores of ``plan``'s peer groups in its order, taken from the passes that scored them:
    each part a (plan, its scores, the (source, prompt) groups to take from it; None: all)."""
    found: dict[tuple[str, int], tuple[CompatibilityScores, range]] = {}
    for part_plan, scores, take in parts:
        start = 0
        for group in part_plan.groups:
            if not group.peer or group.nll:
                continue
            count = n if group.keep is None else int(group.keep.sum())
            key = (group.source, group.prompt)
            if scores.compatibility is not None and (take is None or key in take):
                found[key] = (scores.compatibility, range(start, start + count))
            start += count
    keys = [(g.source, g.prompt) for g in plan.groups if g.peer and not g.nll]
    if not keys:
        return None
    pieces = [found[key] for key in keys]
    first = pieces[0][0]

    def joined(name: str) -> list[Any]:
        return [getattr(c, name)[k] for c, rows in pieces for k in rows]

    return CompatibilityScores(
        step=first.step,
        receiver=first.receiver,
        source=joined("source"),
        s=joined("s"),
        reward=joined("reward"),
        w=joined("w"),
        admitted=joined("admitted"),
        advantage=joined("advantage"),
        prompt_id=joined("prompt_id"),
    )


@dataclass(frozen=True)
class ProbeStep:
    """One probe step: what a training step at ``step`` would sample, plan and score."""

    step: int
    exchange: StepExchange
    candidate_plans: dict[str, ExchangePlan]
    candidates: dict[str, CompatibilityScores | None]
    """Per receiver: every candidate peer group's responses scored with GRAFT's rule, in
    ``candidate_plans`` order (None: no candidate)."""
    candidate_pass: dict[str, PeerScores]
    """Per receiver: the scoring pass over the candidate groups the method's rows did not hold
    as they stand (no contrast)."""
    moved: dict[str, PeerScores]
    """Per receiver: the method's plan, built as the update would (contrast included)."""
    metrics: dict[str, dict[str, Any]]
    """Per policy: the metrics ``Trainer.step`` logs, less the update's."""
    seconds: dict[str, float]
    """Wall-clock of the step's phases: ``rollout`` (sampling, verifying, planning; all policies),
    ``moved`` and ``candidates`` (the two scoring passes)."""


class Probe:
    """The trainer of a config, driven up to the update and no further."""

    def __init__(
        self,
        config: Config,
        out_dir: str | Path,
        *,
        problems: Sequence[MathProblem],
        policies: Sequence[Policy] | None = None,
        verifier: Any = None,
    ) -> None:
        self.config = config
        self.trainer = Trainer(config, out_dir, problems=problems, policies=policies, verifier=verifier)
        self.names = self.trainer.names
        method = self.trainer.method
        self.rule = method if method.name == CANDIDATE_RULE else build_method(CANDIDATE_RULE, config)
        """The rule candidates are scored with: the method itself when it is GRAFT (then the
        groups its plan moves as they stand are scored once, for both)."""

    def step(self, step: int, problems: list[MathProblem]) -> ProbeStep:
        """The trainer's step up to the update: its exchange, its scoring of the method's plan and
        of every other candidate group, and its metrics row less the update's."""
        trainer, names, n = self.trainer, self.names, self.config.rollout.n
        start = time.perf_counter()
        planned = trainer.exchange(step, problems)
        sampled = time.perf_counter()
        moved = trainer.score_peers(step, planned)
        built = time.perf_counter()
        # the cold round's groups (a rescue round, method: hint, changes what the receiver trains on)
        plans = candidate_plans(planned.shared, names)
        reused = {
            r: reusable_groups(planned.plans[r], planned.outcomes) if self.rule is trainer.method else set()
            for r in names
        }
        rest = {
            r: ExchangePlan(groups=[g for g in plans[r].groups if (g.source, g.prompt) not in reused[r]])
            for r in names
        }
        candidate_pass = trainer.score_peers(step, planned, rest, self.rule, contrast=False)
        done = time.perf_counter()
        candidates = {
            r: merged_scores(
                plans[r], [(planned.plans[r], moved[r], reused[r]), (rest[r], candidate_pass[r], None)], n
            )
            for r in names
        }
        metrics = {name: trainer.metrics_row(name, planned, dict(moved[name].metrics)) for name in names}
        return ProbeStep(
            step,
            planned,
            plans,
            candidates,
            candidate_pass,
            moved,
            metrics,
            {"rollout": sampled - start, "moved": built - sampled, "candidates": done - built},
        )

    def close(self) -> None:
        self.trainer.close()
