"""Stored peers (algorithm.md §2.3): a store's coverage of the run, checked before any model loads.

A run that replays a peer from a trajectory store needs, at every step, that peer's group for each
of the step's prompts (the rule ``peers[].match``, ``storage.peers``: ``step``, recorded at that
very step; ``nearest`` or ``prompt_id``, at any step) with ``rollout.n`` responses. The trainer
checks this when it is built, from the store's manifest and its files' prompt columns, with the
lookup it then replays with (``storage.peers.PeerStore``), so a store with fewer steps than
``train.steps`` (or another source, other prompts, another n) is refused in one line before the
first model loads, not when training reaches the step it lacks.
"""

from __future__ import annotations

from typing import Any

from graftrl.storage.data import PromptSampler
from graftrl.storage.peers import PeerStore, StoredPeer
from graftrl.storage.store import StoreError, TrajectoryStore


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
