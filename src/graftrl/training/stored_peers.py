"""Stored peers (algorithm.md §2.3): a store's coverage of the run, checked before any model loads.

A run that replays a peer from a trajectory store needs, at every step, that peer's group for each
of the step's prompts (``peers[].match: step``: recorded at that very step; ``prompt_id``: at any
step) with ``rollout.n`` responses. The trainer checks this when it is built, from the store's
manifest and its files' prompt columns, so a store with fewer steps than ``train.steps`` (or
another source, other prompts, another n) is refused in one line before the first model loads,
not when training reaches the step it lacks. The trainer repeats the per-step checks as it replays
(``Trainer._stored_peer_groups``).
"""

from __future__ import annotations

from typing import Any

from graftrl.storage.data import PromptSampler
from graftrl.storage.store import StoreError, TrajectoryStore


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def check_coverage(peer: Any, store: TrajectoryStore, sampler: PromptSampler, steps: int, n: int) -> None:
    """Refuse (StoreError, one line) a stored peer whose store cannot serve ``steps`` training steps
    of prompts drawn by ``sampler`` with groups of ``n`` responses (``peer``: a ``peers[]`` entry)."""
    name, where = peer.name, f"peers[{peer.name}]: store {peer.path}"
    by_step = store.sources_by_step()
    held = sorted(step for step, sources in by_step.items() if name in sources)
    if not held:
        raise StoreError(
            f"{where} holds no trajectories of source {name!r} (its sources: {', '.join(store.sources()) or 'none'}); "
            "set peers[].name to the source recorded there"
        )
    if peer.partial:  # a served peer's record: groups for the prompts that were asked only
        _check_group_size(store, name, where, n)
        return
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
    stored = store.occurrences(source=name)
    for step in range(steps):
        ids = [problem.id for problem in sampler.batch(step)]
        places = [stored.get((prompt_id, name), []) for prompt_id in ids]
        if peer.match == "step":
            places = [[p for p in found if p[0] == step] for found in places]
        lacking = [prompt_id for prompt_id, found in zip(ids, places, strict=True) if not found]
        if lacking:
            at = f"step {step}" if peer.match == "step" else "any step"
            raise StoreError(
                f"{where} has no group of source {name!r} at {at} for {len(lacking)} of step {step}'s {len(ids)} "
                f"prompts (e.g. {lacking[:3]}); record the peer with the same data, seed and batch size, or set "
                "`match: prompt_id`"
            )
    first = [problem.id for problem in sampler.batch(0)]
    groups = store.find_groups(first, source=name, step=0 if peer.match == "step" else None)
    sizes = sorted({len(rows) for rows in groups.values()})
    if sizes != [n]:
        raise StoreError(
            f"{where}: stored groups of source {name!r} hold {sizes} responses, the run's rollout.n is {n}; "
            f"set rollout.n: {sizes[0]} to match, or re-record the peer"
        )


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
