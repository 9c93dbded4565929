"""What crosses the backend boundary: each call's request, its results, and ``Worker``.

Every call that carries something takes one frozen request and returns one result type. A
request is the whole group's (``plans``, ``folders``, ... in policy order): a backend sends the
same object to every worker (Ray: through the object store once) and each worker takes its own
part by its policy index. Both kinds of worker satisfy ``Worker``: a ``PolicyWorker``
(graftrl.training.worker, one process) and a ``DataParallelWorker`` (graftrl.training.ranks, N
rank processes in lockstep); the backends (graftrl.training.backends) host either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from graftrl.core.contrast import GroupContrast
from graftrl.methods import ExchangePlan, Method
from graftrl.models.policy import Policy
from graftrl.storage.data import MathProblem
from graftrl.storage.records import TrajectoryRecord
from graftrl.training.rescue import RescueResult, RescueRoundRequest
from graftrl.training.rows import CompatibilityScores
from graftrl.training.sampling import PolicyRollout

Records = dict[str, list[TrajectoryRecord]]
"""Every model's tokenizer-neutral records of a step, by model name."""


# ----- requests -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutRequest:
    """Every policy samples and scores the step's prompts (``rollout``)."""

    step: int
    problems: list[MathProblem]
    """The step's prompt batch (the same for every policy)."""


@dataclass(frozen=True)
class UpdateRequest:
    """Every policy trains on its plan given every model's records (``update``)."""

    step: int
    plans: tuple[ExchangePlan, ...]
    """Each policy's plan, in policy order."""
    records: Records
    method_state: dict[str, Any] | None = None
    """Set by the backend: the driver's method state after planning, for workers that hold their
    own copy of the method (e.g. HACPO's capability tracker); None where they share the driver's."""


@dataclass(frozen=True)
class PeerScoringRequest(UpdateRequest):
    """``update`` without the optimizer (``score_peers``, ``graftrl probe``)."""

    scoring: Method | None = None
    """Score with this method's rule instead of the worker's own."""
    contrast: bool = True
    """Measure each peer group's contrast."""


@dataclass(frozen=True)
class CheckpointRequest:
    """Each policy's weights and optimizer state, to or from its folder (``save``, ``load``)."""

    folders: tuple[str | Path, ...]
    """Each policy's checkpoint part, in policy order."""


@dataclass(frozen=True)
class SavePolicyRequest:
    """One policy's weights and tokenizer as a plain save_pretrained folder (``save_policy``)."""

    index: int
    """The policy's position in ``config.policies``: only its worker is called."""
    folder: str | Path


# ----- results ------------------------------------------------------------------------------
@dataclass(frozen=True)
class UpdateResult:
    """What a policy's update returns to the driver."""

    metrics: dict[str, Any]
    """The policy's metrics row for this step (the driver adds the step-level ones)."""
    compatibility: CompatibilityScores | None = None
    """Scores of the transferred responses (None when nothing was scored)."""


@dataclass(frozen=True)
class PeerScores:
    """A receiver's peer rows at a step, built but not trained on (``PolicyWorker.score_peers``)."""

    metrics: dict[str, Any]
    """What building the rows measured (peer responses, admissions, s and w, contrast, timings)."""
    compatibility: CompatibilityScores | None = None
    """Each scored peer response's s, w and reward (None when the method scores no peers)."""
    group_contrasts: dict[int, GroupContrast] = field(default_factory=dict)
    """The contrast of each peer group, by its index in the plan (when measured)."""
    row_tokens: int = 0
    """Prompt + response tokens of every row built: what the update would run forward and backward."""
    scored_tokens: int = 0
    """Prompt + response tokens of the peer rows of the no-grad scoring pass (``time_peer_logprob``)."""


class Worker(Protocol):
    """One policy's worker as a backend drives it: ``PolicyWorker`` (one process) or
    ``DataParallelWorker`` (N rank processes in lockstep)."""

    verifier: Any

    def reset_peak_memory(self) -> None: ...

    def rollout(self, request: RolloutRequest) -> PolicyRollout: ...

    def rescue(self, request: RescueRoundRequest) -> RescueResult | None: ...

    def update(self, request: UpdateRequest) -> UpdateResult: ...

    def score_peers(self, request: PeerScoringRequest) -> PeerScores: ...

    def save(self, request: CheckpointRequest) -> None: ...

    def save_policy(self, request: SavePolicyRequest) -> None: ...

    def load(self, request: CheckpointRequest) -> None: ...

    def validation_scores(self) -> dict[str, float]: ...

    def nonfinite_state(self, limit: int = 3) -> list[str]: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def close(self) -> None: ...

    @property
    def policy(self) -> Policy: ...
