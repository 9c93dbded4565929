"""Served peers (docs/served-peer.md): an OpenAI-compatible endpoint answers the all-fail prompts.

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

The start-up probe (``ServedPeers.probe``) sends one request as the run will, before any model
loads, and refuses in one line an endpoint that is down, does not serve the model, or answers
without n completions with token log-probs.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graftrl.methods import GroupOutcomes
from graftrl.models.served import RequestStats, SamplingRequest, ServedPeerError
from graftrl.models.served_groups import COST_KEYS, api_key, client_of, dense_records, served_rows
from graftrl.storage.data import MathProblem
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.store import StoredTrajectory
from graftrl.training.randomness import step_seed
from graftrl.training.sampling import with_suffix
from graftrl.training.trajectories import peer_groups

SERVED_STREAM = 777_767
"""The seed stream of served requests (``step_seed(seed, step, SERVED_STREAM) + prompt index``)."""


@dataclass
class ServedStep:
    """One served peer's part of a step."""

    outcomes: GroupOutcomes
    """[P, n]; prompts without a group (not asked, or missing) have rewards 0 (no candidate)."""
    records: list[TrajectoryRecord]
    rows: list[StoredTrajectory]
    """What the run's trajectory store records."""
    stats: RequestStats
    info: dict[str, float] = field(default_factory=dict)
    """``served_<key>/<peer>`` (COST_KEYS)."""


def all_fail_prompts(outcomes: Mapping[str, GroupOutcomes]) -> list[int]:
    """Prompts on which at least one of ``outcomes``' models failed all n responses (k = 0: no
    reward at or above its ``success_threshold``)."""
    fails = torch.stack([o.successes == 0 for o in outcomes.values()]).any(dim=0)  # [P]
    return fails.nonzero().flatten().tolist()


class ServedPeers:
    """The run's served peers: clients, the start-up probe, and each step's groups."""

    def __init__(self, config: Any, peers: Sequence[Any]) -> None:
        self.config = config
        self.peers = {peer.name: peer for peer in peers}
        self.clients = {name: client_of(peer) for name, peer in self.peers.items()}
        self.totals = {name: RequestStats() for name in self.peers}
        """Run totals (the run's summary)."""
        rollout = config.rollout
        self.sampling = SamplingRequest(rollout.n, rollout.max_new_tokens, rollout.temperature, rollout.top_p)

    def __bool__(self) -> bool:
        return bool(self.peers)

    def prompt_text(self, problem: MathProblem) -> str:
        return with_suffix(problem.problem, self.config.data.prompt_suffix)

    def probe(self, problems: Sequence[MathProblem]) -> dict[str, RequestStats]:
        """One request per peer as the run sends them (the first problem); ServedPeerError (one line)
        when a peer cannot serve the run. Before any model loads."""
        out = {}
        for name, peer in self.peers.items():
            prompt = peer.template.format(problem=self.prompt_text(problems[0]))
            _, stats = self.clients[name].probe(prompt, self.sampling, f"peers[{name}]")
            out[name] = stats
        return out

    def step(
        self,
        step: int,
        problems: Sequence[MathProblem],
        outcomes: Mapping[str, GroupOutcomes],
        verifier: Any,
    ) -> dict[str, ServedStep]:
        """Each served peer's groups on the prompts some policy of ``outcomes`` failed entirely."""
        n = self.sampling.n
        asked = all_fail_prompts(outcomes)
        texts = [self.prompt_text(p) for p in problems]
        seeds = [step_seed(self.config.seed, step, SERVED_STREAM) % 2**31 + p for p in asked]
        out = {}
        for name, peer in self.peers.items():
            prompts = [peer.template.format(problem=texts[p]) for p in asked]
            answers, stats = self.clients[name].complete(prompts, self.sampling, seeds)
            got = [(p, a) for p, a in zip(asked, answers, strict=True) if a is not None]
            flat = [c.text for _, a in got for c in a]
            scores = verifier.rewards(flat, [problems[p] for p, _ in got for _ in range(n)]) if flat else []
            rewards = [scores[g * n : (g + 1) * n] for g in range(len(got))]
            groups = served_rows(
                step,
                name,
                problems,
                texts,
                [p for p, _ in got],
                [a for _, a in got],
                rewards,
                n,
                f"served:{peer.model}",
                self.config.train.adv_eps,
                self.config.train.adv_std_unbiased,
            )
            by_prompt: list[list[StoredTrajectory] | None] = [None] * len(problems)
            for (p, _), group in zip(got, groups, strict=True):
                by_prompt[p] = group
            replayed = peer_groups(by_prompt, n, success_threshold=self.config.reward.success_threshold)
            records = dense_records(replayed.records, problems, step, name, n)
            self.totals[name].merge(stats)
            info = {f"served_{key}/{name}": float(getattr(stats, key)) for key in COST_KEYS}
            if stats.missing:
                print(
                    f"graftrl: step {step}: served peer {name!r} left {stats.missing} of {stats.prompts} "
                    f"prompts unanswered ({stats.why()}); their groups stay on the receiver",
                    file=sys.stderr,
                )
            out[name] = ServedStep(
                replayed.outcomes, records, [row for g in groups for row in g], stats, info
            )
        return out

    def report(self) -> None:
        """The run's summary on the console, one line per peer (`graftrl analyze` has the same from
        metrics.jsonl, resumed runs included)."""
        for name, t in self.totals.items():
            print(
                f"graftrl: served peer {name!r}: {t.prompts} prompts asked, {t.missing} missing, {t.requests} "
                f"requests ({t.retries} retries), {t.prompt_tokens} tokens requested, {t.completion_tokens} "
                f"received, {t.latency_s:.1f} s of requests",
                file=sys.stderr,
            )

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


__all__ = [
    "COST_KEYS",
    "ServedPeerError",
    "ServedPeers",
    "ServedStep",
    "all_fail_prompts",
    "api_key",
    "client_of",
    "dense_records",
    "served_rows",
]
