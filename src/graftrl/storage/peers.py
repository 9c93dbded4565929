"""Stored peers: which stored group serves a prompt at a step, the one lookup of graftrl.

``PeerStore`` is what ``graftrl train`` checks a store's coverage with before any model loads
(``training.stored_peers``), what its trainer replays each step from (``Trainer.exchange``) and
what ``GraftGRPOTrainer`` replays from inside TRL (``integrations.trl``). It reads graftrl's
trajectory store (``storage.store``) and imports nothing from TRL.

**Matching rule** (``peers[].match`` of a run config, ``graft_peer_match`` in TRL), for a
receiver's prompt at step ``t`` (TRL: generation batch ``t``):

- ``step`` (the default, ``DEFAULT_PEER_MATCH``, everywhere): the group stored at step ``t`` for
  that prompt id, else none;
- ``nearest``: the group of that prompt id stored at the step nearest to ``t`` (the same step when
  it was recorded; a tie between ``t - d`` and ``t + d`` takes ``t - d``): a peer recorded with
  other batch sizes or fewer steps still serves every prompt it ever saw, from its closest moment;
- ``prompt_id``: the latest stored group of that prompt id, whatever its step.

Within one step a prompt stored twice resolves to its later group (the store's rule). A prompt
with no stored group has no candidate at that step.

**Prompt id** (TRL datasets). A dataset row's prompt id is the value of its ``prompt_id`` column
(the column is ``GraftGRPOConfig.graft_prompt_id_column``), as a string. A dataset without that
column gets ``sha256:<16 hex>`` of its ``prompt`` (the string; a conversation as JSON with sorted
keys), so two runs on the same prompts agree without any id. To replay a store written by
``graftrl train`` or ``graftrl import-trajectories``, give the TRL dataset a column holding the
ids that run used (its data's ``id`` field). A store that matches none of the dataset's prompts is
refused before training.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from graftrl.storage.store import StoredTrajectory, StoreError, TrajectoryStore

PROMPT_ID_COLUMN = "prompt_id"
"""The dataset column holding each row's prompt id (``graft_prompt_id_column``'s default)."""

PeerMatch = Literal["step", "nearest", "prompt_id"]
PEER_MATCHES: tuple[PeerMatch, ...] = ("step", "nearest", "prompt_id")
DEFAULT_PEER_MATCH: PeerMatch = "step"
"""The one default matching rule, of ``graftrl train`` and of the TRL integration alike."""


def prompt_text(prompt: Any) -> str:
    """A dataset prompt as one string: itself, or a conversation as JSON with sorted keys."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def prompt_hash(prompt: Any) -> str:
    """``sha256:<first 16 hex>`` of ``prompt_text(prompt)``: the id of a prompt without one."""
    return "sha256:" + hashlib.sha256(prompt_text(prompt).encode("utf-8")).hexdigest()[:16]


def prompt_id_of(example: Mapping[str, Any], column: str = PROMPT_ID_COLUMN) -> str:
    """The prompt id of a dataset row (see the module docstring)."""
    value = example.get(column)
    if value is not None:
        return str(value)
    if "prompt" not in example:
        raise StoreError(
            f"dataset row has neither a {column!r} column nor a 'prompt': give each row a prompt id "
            "(graft_prompt_id_column) or a prompt"
        )
    return prompt_hash(example["prompt"])


def dataset_prompt_ids(dataset: Any, column: str = PROMPT_ID_COLUMN) -> list[str] | None:
    """Every row's prompt id of a sized dataset (a ``datasets.Dataset`` or a list of rows), or
    None for a dataset that cannot be listed up front (an iterable dataset)."""
    names = getattr(dataset, "column_names", None)
    if names is not None and not hasattr(dataset, "__len__"):
        return None
    if names is not None:
        if column in names:
            return [str(value) for value in dataset[column]]
        return [prompt_hash(prompt) for prompt in dataset["prompt"]]
    if isinstance(dataset, Sequence):
        return [prompt_id_of(row, column) for row in dataset]
    return None


@dataclass(frozen=True)
class StoredPeer:
    """A stored peer: a trajectory store and the source (model) in it whose groups are replayed."""

    path: str | Path
    """Store folder (written by ``RecordingGRPOTrainer``, ``graftrl train`` with ``store.record``, or
    ``graftrl import-trajectories``)."""
    source: str | None = None
    """The store's ``source`` to replay; None: the store's only source."""


class PeerStore:
    """One stored peer opened for replay: its index of groups, the matching rule, cached reads.

    The index is built when the store is opened: steps written to the store afterwards are not seen.
    """

    def __init__(
        self, peer: StoredPeer | str | Path, cache_steps: int = 4, store: TrajectoryStore | None = None
    ) -> None:
        """``store``: the peer's store already open (its index of groups is read once)."""
        if not isinstance(peer, StoredPeer):
            peer = StoredPeer(peer)
        self.path = Path(peer.path)
        self.store = store if store is not None else TrajectoryStore(self.path)
        sources = self.store.sources()
        if peer.source is None:
            if len(sources) != 1:
                raise StoreError(
                    f"peer store {self.path}: holds sources {sources}; name the one to replay with "
                    "StoredPeer(path, source=...)"
                )
            source = sources[0]
        elif peer.source not in sources:
            raise StoreError(
                f"peer store {self.path}: no source {peer.source!r} (it holds {sources}); fix StoredPeer.source"
            )
        else:
            source = peer.source
        self.source = source
        self.places: dict[str, list[tuple[int, int]]] = {
            prompt_id: places for (prompt_id, _), places in self.store.occurrences(source).items()
        }
        self._cache: OrderedDict[int, dict[int, list[StoredTrajectory]]] = OrderedDict()
        self._cache_steps = cache_steps

    def locate(self, prompt_id: str, step: int, match: PeerMatch) -> tuple[int, int] | None:
        """(stored step, group_index) of the group serving ``prompt_id`` at ``step``, or None."""
        places = self.places.get(prompt_id)
        if not places:
            return None
        if match == "prompt_id":
            return places[-1]  # highest step, then highest group_index
        if match == "step":
            same = [place for place in places if place[0] == step]
            return same[-1] if same else None
        if match == "nearest":
            nearest = min((abs(s - step), s) for s, _ in places)[1]
            return [place for place in places if place[0] == nearest][-1]
        raise ValueError(f"graft_peer_match must be one of {PEER_MATCHES}, got {match!r}")

    def groups(
        self, prompt_ids: Sequence[str], step: int, match: PeerMatch
    ) -> list[list[StoredTrajectory] | None]:
        """The stored group (rows ordered by index) for each prompt id at ``step``, None where none."""
        places = [self.locate(prompt_id, step, match) for prompt_id in prompt_ids]
        return [None if place is None else self._group(*place) for place in places]

    def serve(
        self, prompt_ids: Sequence[str], step: int, match: PeerMatch, where: str, n: int | None = None
    ) -> list[list[StoredTrajectory]]:
        """The group serving each prompt at ``step``; ``n``: the responses each must hold (None: its
        rows are not read, the coverage alone is checked and [] returned). Refuses (StoreError,
        one line naming ``where``, e.g. ``peers[NAME]: store PATH``) a prompt without a group."""
        places = [self.locate(prompt_id, step, match) for prompt_id in prompt_ids]
        lacking = [prompt_id for prompt_id, place in zip(prompt_ids, places, strict=True) if place is None]
        if lacking:
            at = f"step {step}" if match == "step" else "any step"
            raise StoreError(
                f"{where} has no group of source {self.source!r} at {at} for {len(lacking)} of step {step}'s "
                f"{len(prompt_ids)} prompts (e.g. {lacking[:3]}); record the peer with the same data, seed and "
                "batch size, or set `match: prompt_id`"
            )
        if n is None:
            return []
        groups = [
            list(self._group(*place)) for place in places if place is not None
        ]  # copies: the cache's stay
        sizes = sorted({len(group) for group in groups})
        if sizes != [n]:
            raise StoreError(
                f"{where}: stored groups of source {self.source!r} hold {sizes} responses, the run's rollout.n "
                f"is {n}; set rollout.n: {sizes[0]} to match, or re-record the peer"
            )
        return groups

    def _group(self, step: int, group_index: int) -> list[StoredTrajectory]:
        groups = self._cache.get(step)
        if groups is None:
            groups = {}
            for row in self.store.read_step(step, token_logprobs=False):
                if row.source == self.source:
                    groups.setdefault(row.group_index, []).append(row)
            for rows in groups.values():
                rows.sort(key=lambda row: row.index)
            self._cache[step] = groups
            while len(self._cache) > self._cache_steps:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(step)
        return groups[group_index]

    def check_covers(self, prompt_ids: Iterable[str] | None, n: int) -> int:
        """Refuse (one line) a store that matches none of ``prompt_ids`` or whose groups hold
        another number of responses than ``n``; returns how many distinct ids it matches
        (``prompt_ids`` None: not checked, returns -1)."""
        if not self.places:
            raise StoreError(
                f"peer store {self.path}: source {self.source!r} has no groups; record the peer first"
            )
        first = next(iter(self.places.values()))[0]
        size = len(self._group(*first))
        if size != n:
            raise StoreError(
                f"peer store {self.path}: groups of source {self.source!r} hold {size} responses, but "
                f"num_generations is {n}; set num_generations={size} or re-record the peer with {n}"
            )
        if prompt_ids is None:
            return -1
        wanted = set(prompt_ids)
        matched = wanted & self.places.keys()
        if not matched:
            ours = sorted(wanted)[:3]
            theirs = sorted(self.places)[:3]
            raise StoreError(
                f"peer store {self.path}: none of the dataset's {len(wanted)} prompt ids is stored for source "
                f"{self.source!r} (dataset ids e.g. {ours}, store ids e.g. {theirs}); give the dataset a column "
                "with the ids the store was recorded with (graft_prompt_id_column), or record the peer on "
                "this dataset"
            )
        return len(matched)
