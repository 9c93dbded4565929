"""What a backend calls on one policy's worker (``Worker``), and what the step's calls carry.

Both kinds of worker satisfy ``Worker``: a ``PolicyWorker`` (graftrl.training.worker, one
process) and a ``DataParallelWorker`` (graftrl.training.ranks, N rank processes in lockstep); the
backends (graftrl.training.backends) host either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from graftrl.methods import ExchangePlan, Method
from graftrl.models.policy import Policy
from graftrl.storage.data import MathProblem
from graftrl.storage.records import TrajectoryRecord
from graftrl.training.rescue import RescueRequest, RescueResult
from graftrl.training.sampling import PolicyRollout
from graftrl.training.worker import PeerScores, UpdateResult

Records = dict[str, list[TrajectoryRecord]]
"""Every model's tokenizer-neutral records of a step, by model name."""


class Worker(Protocol):
    """One policy's worker as a backend drives it: ``PolicyWorker`` (one process) or
    ``DataParallelWorker`` (N rank processes in lockstep)."""

    verifier: Any

    def reset_peak_memory(self) -> None: ...

    def rollout(self, step: int, problems: list[MathProblem]) -> PolicyRollout: ...

    def rescue(self, step: int, request: RescueRequest | None) -> RescueResult | None: ...

    def update(
        self, step: int, plan: ExchangePlan, records: Records, method_state: dict[str, Any] | None = None
    ) -> UpdateResult: ...

    def score_peers(
        self,
        step: int,
        plan: ExchangePlan,
        records: Records,
        method_state: dict[str, Any] | None = None,
        method: Method | None = None,
        contrast: bool = True,
    ) -> PeerScores: ...

    def save(self, folder: str | Path) -> None: ...

    def save_policy(self, folder: str | Path) -> None: ...

    def load(self, folder: str | Path) -> None: ...

    def validation_scores(self) -> dict[str, float]: ...

    def nonfinite_state(self, limit: int = 3) -> list[str]: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def close(self) -> None: ...

    @property
    def policy(self) -> Policy: ...
