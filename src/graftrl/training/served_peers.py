"""Served peers (docs/served-peer.md), the ``served`` peer source: an OpenAI-compatible endpoint
answers the all-fail prompts.

Each step, the prompts on which some co-trained policy failed all n responses (eq. 4's k_B = 0),
and only those, go to each served peer (``graftrl.models.served``). Its completions are verified
with the run's reward, get GRPO advantages within their group (eq. 1), and become stored rows of
source ``peers[].name``: the same ``StoredTrajectory`` rows a stored peer replays, turned into
records and outcomes by the stored peer's own ``peer_groups``. From there the method treats the
peer like any other (balancing, eq. 7 from the returned log-probs, gate and cap, token clipping,
peer-last minibatches). The rows are written to the run's trajectory store, so the run can be
replayed with the peer as ``source: stored, partial: true``.

A prompt not asked, or asked and not answered (``missing``), has no group: rewards 0, so no
candidate, and the receiver keeps its own group. What was missing is in the step's metrics
(``served_missing/<peer>``) and the run's summary; a step's first errors go to the console.

The start-up probe (``ServedSource.open``) sends one request as the run will, before any model
loads, and refuses in one line an endpoint that is down, does not serve the model, or answers
without n completions with token log-probs.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graftrl.methods import GroupOutcomes
from graftrl.models.served import RequestStats, SamplingRequest, ServedPeerError
from graftrl.models.served_groups import COST_KEYS, api_key, client_of, dense_records, served_rows
from graftrl.storage.data import MathProblem
from graftrl.storage.store import StoredTrajectory
from graftrl.training.peer_sources import PeerRun, Receivers, SourceBase, SourceGroups, register_source
from graftrl.training.randomness import step_seed
from graftrl.training.sampling import with_suffix
from graftrl.training.trajectories import peer_groups

SERVED_STREAM = 777_767
"""The seed stream of served requests (``step_seed(seed, step, SERVED_STREAM) + prompt index``)."""


def all_fail_prompts(outcomes: Mapping[str, GroupOutcomes]) -> list[int]:
    """Prompts on which at least one of ``outcomes``' models failed all n responses (k = 0: no
    reward at or above its ``success_threshold``)."""
    fails = torch.stack([o.successes == 0 for o in outcomes.values()]).any(dim=0)  # [P]
    return fails.nonzero().flatten().tolist()


@register_source("served")
class ServedSource(SourceBase):
    """A served peer: its client, the start-up probe, and each step's groups."""

    records = True  # every served group is recorded (a replayable run)

    def __init__(self, settings: Any, run: PeerRun) -> None:
        super().__init__(settings, run)
        self.client = client_of(settings)
        self.totals = RequestStats()
        """Run totals (the run's summary)."""
        rollout = run.config.rollout
        self.sampling = SamplingRequest(rollout.n, rollout.max_new_tokens, rollout.temperature, rollout.top_p)

    def prompt_text(self, problem: MathProblem) -> str:
        return with_suffix(problem.problem, self.run.config.data.prompt_suffix)

    def open(self) -> None:
        """One request as the run sends them (the first problem); ServedPeerError (one line) when
        the peer cannot serve the run. Before any model loads."""
        prompt = self.settings.template.format(problem=self.prompt_text(self.run.problems[0]))
        self.client.probe(prompt, self.sampling, f"peers[{self.name}]")

    def groups(
        self, step: int, problems: Sequence[MathProblem], receivers: Receivers, verifier: Any
    ) -> SourceGroups:
        """Its groups on the prompts some policy of ``receivers`` failed entirely."""
        config, n, name = self.run.config, self.sampling.n, self.name
        asked = all_fail_prompts(receivers)
        texts = [self.prompt_text(p) for p in problems]
        seeds = [step_seed(config.seed, step, SERVED_STREAM) % 2**31 + p for p in asked]
        prompts = [self.settings.template.format(problem=texts[p]) for p in asked]
        answers, stats = self.client.complete(prompts, self.sampling, seeds)
        got = [(p, a) for p, a in zip(asked, answers, strict=True) if a is not None]
        flat = [c.text for _, a in got for c in a]
        scores = verifier.rewards(flat, [problems[p] for p, _ in got for _ in range(n)]) if flat else []
        rewards = [scores[g * n : (g + 1) * n] for g in range(len(got))]
        groups = served_rows(
            step=step,
            source=name,
            prompt_ids=[str(problem.id) for problem in problems],
            prompt_texts=texts,
            indices=[p for p, _ in got],
            answers=[a for _, a in got],
            rewards=rewards,
            n=n,
            tokenizer_id=f"served:{self.settings.model}",
            adv_eps=config.train.adv_eps,
            adv_std_unbiased=config.train.adv_std_unbiased,
        )
        by_prompt: list[list[StoredTrajectory] | None] = [None] * len(problems)
        for (p, _), group in zip(got, groups, strict=True):
            by_prompt[p] = group
        replayed = peer_groups(by_prompt, n, success_threshold=config.reward.success_threshold)
        records = dense_records(replayed.records, problems, step, name, n)
        self.totals.merge(stats)
        info = {f"served_{key}/{name}": float(getattr(stats, key)) for key in COST_KEYS}
        if stats.missing:
            print(
                f"graftrl: step {step}: served peer {name!r} left {stats.missing} of {stats.prompts} "
                f"prompts unanswered ({stats.why()}); their groups stay on the receiver",
                file=sys.stderr,
            )
        rows = [row for g in groups for row in g]
        answered = sorted({row.group_index for row in rows})
        return SourceGroups(replayed.outcomes, records, rows, info, answered=answered)

    def report(self) -> None:
        """Its line in the run's summary on the console (`graftrl analyze` has the same from
        metrics.jsonl, resumed runs included)."""
        t = self.totals
        print(
            f"graftrl: served peer {self.name!r}: {t.prompts} prompts asked, {t.missing} missing, {t.requests} "
            f"requests ({t.retries} retries), {t.prompt_tokens} tokens requested, {t.completion_tokens} "
            f"received, {t.latency_s:.1f} s of requests",
            file=sys.stderr,
        )

    def close(self) -> None:
        self.client.close()


__all__ = [
    "COST_KEYS",
    "ServedPeerError",
    "ServedSource",
    "all_fail_prompts",
    "api_key",
    "client_of",
    "dense_records",
    "served_rows",
]
