"""Served peers for ``GraftGRPOTrainer``: an OpenAI-compatible endpoint answers the all-fail prompts.

No TRL import. ``GraftGRPOTrainer(..., peers=[ServedPeer(endpoint=..., model=..., name=...)])`` sends
the generation batch's prompts on which the receiver failed all n (and only those) to the endpoint
(``graftrl.models.served``: concurrent, bounded, retried, a per-batch timeout), asking for
``num_generations`` completions at the trainer's temperature and top-p, at most
``max_completion_length`` tokens, with token log-probs. The answers become stored rows
(``models.served_groups.served_rows``, as ``graftrl train``), verified with the trainer's own
reward functions and given eq. 1's advantages within their group (``peer_groups`` with the
rewards), then the same exchange as a stored peer. ``ServedPeerSource`` is the ``served`` kind's
peer source (``sources``). With ``record_store`` they are recorded beside the receiver's own rows,
so the run can be replayed as a stored peer.

``ServedPeer`` is ``config.peers.ServedPeerConfig``, the settings of ``graftrl train``'s served peers.
The prompt sent is ``template.format(problem=...)`` of the dataset's prompt: the string itself, or
for a conversation the content of its last user message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from graftrl.config.peers import ServedPeerConfig
from graftrl.integrations.trl.sources import PROMPT, all_failed, graft_seed, prompt_of
from graftrl.models.served import RequestStats
from graftrl.models.served_groups import COST_KEYS, client_of, dense_records, served_rows
from graftrl.storage.problems import Problem
from graftrl.storage.store import StoredTrajectory
from graftrl.training.peer_sources import Receivers, SourceBase, SourceGroups
from graftrl.training.trajectories import peer_groups

SERVED_STREAM = 3
"""The seed stream of the served requests (``sources.graft_seed``; the trainer's ``_graft_generator``)."""

ServedPeer = ServedPeerConfig
"""A model behind an OpenAI-compatible ``/v1/completions`` endpoint (docs/served-peer.md): the very
settings class of ``graftrl train``'s served ``peers[]`` entries, so every default is written once.
Built with keywords: ``ServedPeer(endpoint=..., model=..., name=...)``; ``template`` holds
``{problem}`` (``{prompt}``, its former placeholder, is read as ``{problem}`` for one release,
with a DeprecationWarning)."""


class ServedPeerSource(SourceBase):
    """A ``ServedPeer`` in a trainer, the ``served`` peer source (``sources``): its client, the
    probe, each generation batch's groups."""

    records = True  # its verified groups go to record_store

    def __init__(self, settings: ServedPeerConfig, run: Any) -> None:
        super().__init__(settings, run)
        self.sampling = run.sampling
        self.client = client_of(settings)
        self.totals = RequestStats()

    def open(self) -> None:
        """ServedPeerError (one line) unless the endpoint answers the dataset's first prompt as the
        training will need."""
        prompt = prompt_of(self.run.problems[0].extra[PROMPT])
        self.client.probe(
            self.settings.template.format(problem=prompt), self.sampling, f"ServedPeer {self.name}"
        )

    def groups(
        self, step: int, problems: Sequence[Problem], receivers: Receivers, verifier: Any
    ) -> SourceGroups:
        """The peer's groups on the prompts the receiver failed entirely that it answered, verified
        with the trainer's reward functions (``verifier``), and the batch's cost metrics."""
        n, name = self.sampling.n, self.name
        asked = all_failed(receivers)
        prompts = [prompt_of(problem.extra[PROMPT]) for problem in problems]
        seed = graft_seed(self.run.config.seed, step, SERVED_STREAM) % 2**31  # the requests' seeds
        texts = [self.settings.template.format(problem=prompts[p]) for p in asked]
        answers, stats = self.client.complete(texts, self.sampling, [seed + p for p in asked])
        self.totals.merge(stats)
        got = [(p, a) for p, a in zip(asked, answers, strict=True) if a is not None]
        rows = served_rows(
            step=step,
            source=name,
            prompt_ids=[problem.id for problem in problems],
            prompt_texts=prompts,
            indices=[p for p, _ in got],
            answers=[a for _, a in got],
            rewards=[[0.0] * n for _ in got],  # placeholders: verified and re-advantaged below
            n=n,
            tokenizer_id=f"served:{self.settings.model}",
            adv_eps=0.0,
            adv_std_unbiased=True,
        )
        groups: list[list[StoredTrajectory] | None] = [None] * len(problems)
        for (p, _), group in zip(got, rows, strict=True):
            groups[p] = group
        threshold = self.run.config.reward.success_threshold
        verified = peer_groups(groups, n, verifier.groups(groups, asked), success_threshold=threshold)
        recorded = [
            replace(row, reward=record.reward, advantage=record.advantage)
            for group, records in zip(groups, verified.records, strict=True)
            if group is not None and records is not None
            for row, record in zip(group, records, strict=True)
        ]
        records = dense_records(verified.records, problems, step, name, n)
        info = {f"served_{key}/{name}": float(getattr(stats, key)) for key in COST_KEYS}
        return SourceGroups(verified.outcomes, records, recorded, info, answered=[p for p, _ in got])

    def close(self) -> None:
        self.client.close()
