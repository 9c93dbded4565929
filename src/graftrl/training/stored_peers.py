"""Stored peers (algorithm.md §2.3), the ``stored`` peer source: a store's coverage of the run,
checked before any model loads (``check_coverage``), and each step's replayed groups (``StoredSource``).

A run that replays a peer from a trajectory store needs, at every step, that peer's group for each
of the step's prompts (the rule ``peers[].match``, ``storage.peers``: ``step``, recorded at that
very step; ``nearest`` or ``prompt_id``, at any step) with ``rollout.n`` responses. The trainer
checks this when it is built, from the store's manifest and its files' prompt columns, with the
lookup it then replays with (``storage.peers.PeerStore``), so a store with fewer steps than
``train.steps`` (or another source, other prompts, another n) is refused in one line before the
first model loads, not when training reaches the step it lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graftrl.models.served_groups import dense_records
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.storage.peers import PeerStore, StoredPeer
from graftrl.storage.store import StoreError, TrajectoryStore
from graftrl.training.peer_sources import Receivers, SourceBase, SourceGroups, register_source
from graftrl.training.trajectories import peer_groups


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def check_coverage(
    peer: Any, store: TrajectoryStore, sampler: PromptSampler, steps: int, n: int
) -> PeerStore:
    """Refuse (StoreError, one line) a stored peer whose store cannot serve ``steps`` training steps
    of prompts drawn by ``sampler`` with groups of ``n`` responses (``peer``: a ``peers[]`` entry);
    returns the lookup the trainer replays it with."""
    name, where = peer.name, f"peers[{peer.name}]: store {peer.path}"
    by_step = store.sources_by_step()
    held = sorted(step for step, sources in by_step.items() if name in sources)
    if not held:
        raise StoreError(
            f"{where} holds no trajectories of source {name!r} (its sources: {', '.join(store.sources()) or 'none'}); "
            "set peers[].name to the source recorded there"
        )
    peers = PeerStore(StoredPeer(peer.path, source=name), store=store)
    if peer.partial:  # a served peer's record: groups for the prompts that were asked only
        _check_group_size(store, name, where, n)
        return peers
    if peer.match == "step":
        missing = [step for step in range(steps) if step not in held]
        if missing:
            raise StoreError(
                f"{where} holds source {name!r} at steps {_span(held)} ({len(held)} steps), the run needs steps "
                f"0..{steps - 1} (train.steps {steps}) with match: step and lacks {len(missing)} of them "
                f"(first: {missing[0]}); train for at most as many steps as were recorded "
                f"(--set train.steps={_recorded_prefix(held)}), or set `match: prompt_id` to match prompts "
                "regardless of step"
            )
    for step in range(steps):
        peers.serve([problem.id for problem in sampler.batch(step)], step, peer.match, where)
    peers.serve([problem.id for problem in sampler.batch(0)], 0, peer.match, where, n)  # the group size
    return peers


def _check_group_size(store: TrajectoryStore, name: str, where: str, n: int) -> None:
    """Refuse a store whose groups of ``name`` (at its first step holding it) are not of ``n``."""
    first = min(step for step, sources in store.sources_by_step().items() if name in sources)
    sizes = sorted({row.n for row in store.read_step(first, token_logprobs=False) if row.source == name})
    if sizes != [n]:
        raise StoreError(
            f"{where}: stored groups of source {name!r} hold {sizes} responses, the run's rollout.n is {n}; "
            f"set rollout.n: {sizes[0]} to match, or re-record the peer"
        )


def _recorded_prefix(held: list[int]) -> int:
    """How many steps from 0 the store covers without a gap."""
    count = 0
    while count in held:
        count += 1
    return count


@register_source("stored")
class StoredSource(SourceBase):
    """A stored peer (algorithm.md §2.3): its groups on the step's prompts, rewards re-verified.

    A group whose re-verified rewards equal the stored ones keeps its stored (source-computed)
    advantages; one whose rewards changed gets advantages recomputed on its full group. A
    ``partial`` peer (a served peer's record) gives the groups it holds, None for the others (no
    candidate there).
    """

    def open(self) -> None:
        """The store's coverage of the run (``check_coverage``), and the lookup it replays with."""
        config = self.run.config
        self.store = TrajectoryStore(self.settings.path)
        self.lookup = check_coverage(
            self.settings, self.store, self.run.sampler, config.train.steps, config.rollout.n
        )

    def inputs(self) -> dict[str, dict[str, str]]:
        return {f"peers.{self.name}": {"path": str(self.settings.path), "sha256": self.store.fingerprint()}}

    def groups(
        self, step: int, problems: Sequence[MathProblem], receivers: Receivers, verifier: Any
    ) -> SourceGroups:
        peer, train = self.settings, self.run.config.train
        n, ids = self.run.config.rollout.n, [p.id for p in problems]
        if peer.partial:
            held = self.lookup.groups(ids, step, peer.match)
            groups = [None if group is None else list(group) for group in held]  # copies: the cache's stay
        else:
            groups = self.lookup.serve(ids, step, peer.match, f"peers[{self.name}]: store {peer.path}", n)
        present = [p for p, group in enumerate(groups) if group is not None]
        texts = [row.response for p in present for row in groups[p]]
        each = [problems[p] for p in present for _ in range(n)]  # each response's problem row
        rewards = verifier.rewards(texts, each) if texts else []
        replayed = peer_groups(
            groups,
            n,
            {p: rewards[g * n : (g + 1) * n] for g, p in enumerate(present)},
            train.adv_eps,
            train.adv_std_unbiased,
            self.run.config.reward.success_threshold,
        )
        if peer.partial:
            records = dense_records(replayed.records, problems, step, self.name, n)
        else:
            records = [record for group in replayed.records for record in group or ()]
        info = {f"stored_reward_changes/{self.name}": float(replayed.reward_changes)}
        return SourceGroups(replayed.outcomes, records, info=info, shared=True)
