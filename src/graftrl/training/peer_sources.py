"""Peer sources: every peer that is not co-trained, behind one interface (docs/architecture.md).

A ``peers[]`` entry names its kind (``source``: ``stored``, ``served``, or a registered one); the
trainer builds one ``PeerSource`` per entry from the kind's factory (``register_source``), runs each
source's ``open`` check before any model loads, and each step calls ``groups`` once per source with
the step's problems, the co-trained receivers' outcomes and the run's verifier. What comes back
(``SourceGroups``) joins the receivers' groups for the method's plan; its rows go to the run's
trajectory store; its metrics to every receiver's metrics.jsonl row.

Built in: ``stored`` (``training.stored_peers``: a trajectory store replayed, ``partial`` for a
served peer's record) and ``served`` (``training.served_peers``: an OpenAI-compatible endpoint
asked the receivers' all-fail prompts). A new kind is one module (a source class registered with
``register_source``) and one settings class (``config.peers.register_peer_settings``).
Sources answer kind by kind (served, stored, then the registered kinds in their registration
order), each kind's in config order: every source sees the co-trained receivers' outcomes only,
and the plan's peers come in today's order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from graftrl.methods import GroupOutcomes
from graftrl.storage.data import MathProblem, PromptSampler
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.store import StoredTrajectory

__all__ = [
    "SOURCES",
    "PeerRun",
    "PeerSource",
    "Receivers",
    "SourceBase",
    "SourceGroups",
    "open_sources",
    "register_source",
]


Receivers = Mapping[str, GroupOutcomes]
"""The co-trained policies' groups on the step's prompts, by name."""


@dataclass(frozen=True)
class PeerRun:
    """What a source is built on: the run's config, its training problems and prompt stream."""

    config: Any
    problems: Sequence[MathProblem]
    sampler: PromptSampler


@dataclass
class SourceGroups:
    """One source's part of a step."""

    outcomes: GroupOutcomes
    """[P, n] on the step's prompts; a prompt without a group has rewards 0 (no candidate)."""
    records: list[TrajectoryRecord]
    """[P * n] in prompt order (placeholders where there is no group)."""
    rows: list[StoredTrajectory] = field(default_factory=list)
    """What the run's trajectory store records this step."""
    info: dict[str, float] = field(default_factory=dict)
    """Its metrics (cost, reward changes), keyed ``<what>/<peer>``, in every receiver's row."""
    shared: bool = False
    """The groups are on the whole shared batch (the peer gets complementarity figures)."""
    answered: list[int] | None = None
    """The prompts (batch positions) it answered; None: every one."""


@runtime_checkable
class PeerSource(Protocol):
    """A peer the run does not train: what ``Trainer.exchange`` asks each step."""

    name: str
    records: bool
    """Its rows go to the run's trajectory store (the store is opened for it)."""

    def open(self) -> None:
        """Refuse, in one line, a source that cannot serve the run; before any model loads."""
        ...

    def groups(
        self, step: int, problems: Sequence[MathProblem], receivers: Receivers, verifier: Any
    ) -> SourceGroups:
        """Its groups on ``problems`` at ``step`` (``receivers``: the co-trained policies' outcomes;
        ``verifier``: the run's, ``verifier.rewards(texts, problems)``)."""
        ...

    def inputs(self) -> dict[str, dict[str, str]]:
        """What it reads, ``peers.<name>`` -> {"path", "sha256"}, for a resume's identity check."""
        ...

    def report(self) -> None:
        """Its line in the run's summary, if any."""
        ...

    def close(self) -> None: ...


class SourceBase:
    """Defaults of a ``PeerSource``: nothing recorded, nothing read, no summary, nothing to close."""

    records = False

    def __init__(self, settings: Any, run: PeerRun) -> None:
        self.settings = settings
        self.name: str = settings.name
        self.run = run

    def open(self) -> None:
        return None

    def inputs(self) -> dict[str, dict[str, str]]:
        return {}

    def report(self) -> None:
        return None

    def close(self) -> None:
        return None


SOURCES: dict[str, Callable[[Any, PeerRun], PeerSource]] = {}
"""Peer kind (a ``peers[]`` entry's ``source``) -> its source's factory."""


def register_source(
    kind: str,
) -> Callable[[Callable[[Any, PeerRun], PeerSource]], Callable[[Any, PeerRun], PeerSource]]:
    """Register a source class (or factory) for ``peers[]`` entries with ``source: <kind>``."""

    def register(factory: Callable[[Any, PeerRun], PeerSource]) -> Callable[[Any, PeerRun], PeerSource]:
        SOURCES[kind] = factory
        return factory

    return register


def open_sources(run: PeerRun) -> list[PeerSource]:
    """The run's sources, each opened (its check run), in answering order."""
    kinds = [*BUILT_IN, *(kind for kind in SOURCES if kind not in BUILT_IN)]
    peers = sorted(run.config.peers, key=lambda peer: kinds.index(peer.source))
    sources = [SOURCES[peer.source](peer, run) for peer in peers]
    for source in sources:
        source.open()
    return sources


BUILT_IN = ("served", "stored")
"""The built-in kinds, in answering order (each in ``training.<kind>_peers``)."""

for _kind in BUILT_IN:
    importlib.import_module(f"graftrl.training.{_kind}_peers")
