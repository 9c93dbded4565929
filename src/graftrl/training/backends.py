"""Where the policy workers run: in the trainer's process, or one Ray actor each.

The trainer drives its policies through one typed interface, ``WorkerGroup``: each call runs on
every policy's worker and returns the results in policy order. ``LocalBackend`` runs the workers
one after another in the trainer's process; ``RayBackend`` runs them concurrently (each policy on
its own CPUs/GPUs, one actor each) and ships large shared arguments once through the object
store. A worker is a ``PolicyWorker`` (graftrl.training.worker), or for a policy with
``parallel.data: N > 1`` a ``DataParallelWorker`` (graftrl.training.ranks) with the same calls
(``Worker``).
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from graftrl.config import Config
from graftrl.methods import ExchangePlan, Method
from graftrl.models.policy import Policy
from graftrl.storage.data import MathProblem
from graftrl.training.failures import ray_cause, worker_failure
from graftrl.training.ranks import DataParallelWorker, RayDataParallelWorker
from graftrl.training.rescue import RescueRequest, RescueResult
from graftrl.training.sampling import PolicyRollout
from graftrl.training.worker import PeerScores, PolicyWorker, UpdateResult
from graftrl.training.worker_calls import Records, Worker


class WorkerGroup(abc.ABC):
    """Every policy's worker, driven together; results come back in policy order (``config.policies``).

    What the trainer calls, and all it knows of where the workers run."""

    name: str
    """The ``backend`` config value."""

    @abc.abstractmethod
    def reset_peak_memory(self) -> None:
        """Start every worker's ``memory_peak_mb`` window (the start of a step)."""

    @abc.abstractmethod
    def rollout(self, step: int, problems: list[MathProblem]) -> list[PolicyRollout]:
        """Every policy samples and scores the step's prompts."""

    @abc.abstractmethod
    def rescue(self, step: int, requests: Sequence[RescueRequest | None]) -> list[RescueResult | None]:
        """Every policy with a request samples its rescue round (``training.rescue``; None: none)."""

    @abc.abstractmethod
    def update(
        self, step: int, plans: Sequence[ExchangePlan], records: Records, method: Method
    ) -> list[UpdateResult]:
        """Every policy trains on its plan (``plans`` in policy order) given every model's records;
        returns each policy's ``UpdateResult`` (its metrics row, the compatibility scores of what it
        received). ``method`` is the driver's, after planning: workers that hold their own copy of
        it receive its state."""

    @abc.abstractmethod
    def score_peers(
        self,
        step: int,
        plans: Sequence[ExchangePlan],
        records: Records,
        method: Method,
        scoring: Method | None = None,
        contrast: bool = True,
    ) -> list[PeerScores]:
        """``update`` without the optimizer (``graftrl probe``): each policy builds and scores the
        rows of its plan's peer groups and returns them. ``method`` is the driver's, as in
        ``update``; ``scoring``: score with this method's rule instead; ``contrast``: measure
        each group's contrast."""

    @abc.abstractmethod
    def validation_scores(self) -> list[dict[str, float]]:
        """pass@1 per validation benchmark of each policy, sampled by its own rollout engine."""

    @abc.abstractmethod
    def save_policy(self, index: int, folder: str | Path) -> None:
        """Policy ``index``'s weights and tokenizer (a plain save_pretrained folder)."""

    @abc.abstractmethod
    def save(self, folders: Sequence[str | Path]) -> None:
        """Each policy's weights and optimizer state into its folder (a checkpoint's part)."""

    @abc.abstractmethod
    def load(self, folders: Sequence[str | Path]) -> None:
        """Each policy's weights and optimizer state from its ``save`` folder."""

    @abc.abstractmethod
    def nonfinite_state(self) -> list[list[str]]:
        """Per policy, the weight or optimizer-state tensors holding NaN or inf (up to 3 names)."""

    @abc.abstractmethod
    def state_dicts(self) -> list[dict[str, Tensor]]:
        """Each policy's full weights on CPU (tests comparing backends and rank counts)."""

    @abc.abstractmethod
    def driver_verifier(self) -> Any:
        """A verifier for the driver's own scoring (stored peers' rewards), closed by ``close``."""

    @property
    @abc.abstractmethod
    def policies(self) -> list[Policy]:
        """The policies, where they live in the trainer's process (else AttributeError)."""

    @property
    @abc.abstractmethod
    def workers(self) -> list[Worker]:
        """The workers, where they are plain objects of the trainer's process (else AttributeError)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free engines, verifier pools and processes (local policies stay usable for evaluation)."""


class LocalBackend(WorkerGroup):
    """Every policy in this process; workers are plain objects (tests can reach into them).

    A policy with ``parallel.data: N > 1`` is a ``DataParallelWorker``: N spawned rank processes
    driven in lockstep (graftrl.training.ranks)."""

    name = "local"

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        problems: Sequence[MathProblem],
        *,
        policies: Sequence[Policy] | None,
        verifier: Any,
        method: Method,
    ) -> None:
        # One verifier (and its worker pool) for every policy in this process.
        self._owned_verifier = None
        if verifier is None:
            from graftrl.models.rewards import MathVerifier

            verifier = self._owned_verifier = MathVerifier.from_config(config.reward)
        self._workers: list[Worker] = []
        for index, spec in enumerate(config.policies):
            if spec.parallel.data > 1:
                if policies is not None:
                    raise ValueError(
                        f"policies[{spec.name}].parallel.data > 1 loads the policy inside each rank "
                        "from `policies[].path`, not from an in-memory policy"
                    )
                # N rank processes; rank 0 builds its own verifier unless one was given (pickled).
                given = None if verifier is self._owned_verifier else verifier
                ranks = DataParallelWorker(config, index, run_dir, problems, given)
                ranks.verifier = verifier  # the driver's (stored peers' re-verification)
                self._workers.append(ranks)
                continue
            self._workers.append(
                PolicyWorker(
                    config,
                    index,
                    run_dir,
                    problems,
                    policy=policies[index] if policies is not None else None,
                    verifier=verifier,
                    method=method,  # shared: the driver's plan state is the workers' state
                )
            )
        # Rank processes hold their own copies of the method: send its state with each update.
        self._shares_method = not any(isinstance(w, DataParallelWorker) for w in self._workers)

    def reset_peak_memory(self) -> None:
        for worker in self._workers:
            worker.reset_peak_memory()

    def rollout(self, step: int, problems: list[MathProblem]) -> list[PolicyRollout]:
        return [worker.rollout(step, problems) for worker in self._workers]

    def rescue(self, step: int, requests: Sequence[RescueRequest | None]) -> list[RescueResult | None]:
        return [worker.rescue(step, r) for worker, r in zip(self._workers, requests, strict=True)]

    def update(
        self, step: int, plans: Sequence[ExchangePlan], records: Records, method: Method
    ) -> list[UpdateResult]:
        method_state = None if self._shares_method else method.state_dict()
        return [
            worker.update(step, plan, records, method_state)
            for worker, plan in zip(self._workers, plans, strict=True)
        ]

    def score_peers(
        self,
        step: int,
        plans: Sequence[ExchangePlan],
        records: Records,
        method: Method,
        scoring: Method | None = None,
        contrast: bool = True,
    ) -> list[PeerScores]:
        method_state = None if self._shares_method else method.state_dict()
        return [
            worker.score_peers(step, plan, records, method_state, scoring, contrast)
            for worker, plan in zip(self._workers, plans, strict=True)
        ]

    def validation_scores(self) -> list[dict[str, float]]:
        return [worker.validation_scores() for worker in self._workers]

    def save_policy(self, index: int, folder: str | Path) -> None:
        self._workers[index].save_policy(folder)

    def save(self, folders: Sequence[str | Path]) -> None:
        for worker, folder in zip(self._workers, folders, strict=True):
            worker.save(folder)

    def load(self, folders: Sequence[str | Path]) -> None:
        for worker, folder in zip(self._workers, folders, strict=True):
            worker.load(folder)

    def nonfinite_state(self) -> list[list[str]]:
        return [worker.nonfinite_state() for worker in self._workers]

    def state_dicts(self) -> list[dict[str, Tensor]]:
        return [worker.state_dict() for worker in self._workers]

    def driver_verifier(self) -> Any:
        return self._workers[0].verifier  # the one every worker of this process shares

    @property
    def policies(self) -> list[Policy]:
        return [worker.policy for worker in self._workers]

    @property
    def workers(self) -> list[Worker]:
        return self._workers

    def close(self) -> None:
        """Engines and the verifier pool; the policies stay usable (evaluation after training)."""
        for worker in self._workers:
            worker.close()
        if self._owned_verifier is not None:
            self._owned_verifier.close()


class RayPolicyWorker(PolicyWorker):
    """A ``PolicyWorker`` as a Ray actor, built by ``start`` (a method, as ``RayDataParallelWorker``
    is): an error while building it (a damaged model folder, a prompt that does not fit) then
    reaches the driver as itself, one line, rather than as a dead actor whose traceback Ray prints."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._arguments = (args, kwargs)

    def start(self) -> None:
        args, kwargs = self._arguments
        PolicyWorker.__init__(self, *args, **kwargs)


class RayBackend(WorkerGroup):
    """One Ray actor per policy (``policies[].resources``); joins a cluster or starts a local Ray.

    A policy with ``parallel.data: N > 1`` is one actor hosting a ``RayDataParallelWorker``: its N
    ranks are actors of a placement group (``parallel.placement``), each with ``resources`` / N,
    on one node or several (then the run folder must be on a filesystem every node mounts: the
    ranks write their checkpoint shards there)."""

    name = "ray"

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        problems: Sequence[MathProblem],
        *,
        policies: Sequence[Policy] | None,
        verifier: Any,
        method: Method,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError(
                "backend: ray needs Ray; install it with `pip install -e '.[ray]'` or set backend: local"
            ) from None
        if policies is not None:
            raise ValueError("backend: ray loads every policy inside its actor from `policies[].path`")
        self.ray = ray
        self.config = config
        self.run_dir = Path(run_dir)
        self._started = False
        self._driver_verifier: Any = None
        if not ray.is_initialized():
            settings = config.ray
            # Ray >= 2.5x turns on token auth for clusters it starts; a private local one needs none.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(
                address=settings.address,
                num_cpus=settings.num_cpus if settings.address is None else None,
                num_gpus=settings.num_gpus if settings.address is None else None,
                include_dashboard=False,
            )
            self._started = True
        actor_class = ray.remote(RayPolicyWorker)
        ranks_class = ray.remote(RayDataParallelWorker)
        shared_problems = ray.put(list(problems))
        self.actors: list[Any] = []
        for index, spec in enumerate(config.policies):
            resources = spec.resources
            options = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus, "name": None}
            if spec.parallel.data > 1:
                # A coordinating actor without resources of its own: the policy's resources go to
                # its N rank actors, one placement-group bundle each (possibly on several nodes).
                self.actors.append(
                    ranks_class.options(num_cpus=0, num_gpus=0, name=None).remote(
                        config, index, str(run_dir), shared_problems, verifier
                    )
                )
                continue
            self.actors.append(
                actor_class.options(**options).remote(
                    config,
                    index,
                    str(run_dir),
                    shared_problems,
                    verifier=verifier,
                    threads=int(resources.num_cpus),
                )
            )
        # Fail here, not at the first step, when an actor cannot start (bad path, no GPU, ranks
        # that cannot be placed, ...), and leave no actor or private Ray behind.
        try:
            self._gather(
                "start",
                [actor.start.remote() for actor in self.actors],
            )
        except BaseException:
            self.close()
            raise

    def _gather(self, during: str, refs: list[Any], indices: Sequence[int] | None = None) -> list[Any]:
        """Every actor's reply to the call ``during``, in policy order. The first actor that fails
        stops the run: an anticipated error as its own one line, anything else (a dead actor, a bug,
        out of memory) as one paragraph naming the policy, with the report in the run's error log.
        ``indices``: the policies of ``refs`` when not all of them, in order."""
        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            try:
                self.ray.get(done[0])
            except Exception as error:
                cause, details, anticipated = ray_cause(error)
                if anticipated is not None:
                    raise anticipated from None
                position = refs.index(done[0])
                name = self.config.policies[indices[position] if indices is not None else position].name
                raise worker_failure(
                    self.run_dir, f"policy {name!r} (Ray actor)", during, cause, details
                ) from None
        return self.ray.get(refs)

    # Each call starts on every actor before waiting on any: the policies run concurrently.
    def reset_peak_memory(self) -> None:
        self._gather("reset_peak_memory", [actor.reset_peak_memory.remote() for actor in self.actors])

    def rollout(self, step: int, problems: list[MathProblem]) -> list[PolicyRollout]:
        return self._gather("rollout", [actor.rollout.remote(step, problems) for actor in self.actors])

    def rescue(self, step: int, requests: Sequence[RescueRequest | None]) -> list[RescueResult | None]:
        refs = [actor.rescue.remote(step, r) for actor, r in zip(self.actors, requests, strict=True)]
        return self._gather("rescue", refs)

    def update(
        self, step: int, plans: Sequence[ExchangePlan], records: Records, method: Method
    ) -> list[UpdateResult]:
        # Every actor holds its own copy of the method; the records go into the object store once.
        method_state = method.state_dict()
        shared = self.ray.put(records)
        return self._gather(
            "update",
            [
                actor.update.remote(step, plan, shared, method_state)
                for actor, plan in zip(self.actors, plans, strict=True)
            ],
        )

    def score_peers(
        self,
        step: int,
        plans: Sequence[ExchangePlan],
        records: Records,
        method: Method,
        scoring: Method | None = None,
        contrast: bool = True,
    ) -> list[PeerScores]:
        method_state = method.state_dict()
        shared = self.ray.put(records)
        return self._gather(
            "score_peers",
            [
                actor.score_peers.remote(step, plan, shared, method_state, scoring, contrast)
                for actor, plan in zip(self.actors, plans, strict=True)
            ],
        )

    def validation_scores(self) -> list[dict[str, float]]:
        return self._gather("validation_scores", [actor.validation_scores.remote() for actor in self.actors])

    def save_policy(self, index: int, folder: str | Path) -> None:
        self._gather("save_policy", [self.actors[index].save_policy.remote(folder)], [index])

    def save(self, folders: Sequence[str | Path]) -> None:
        self._gather(
            "save", [actor.save.remote(folder) for actor, folder in zip(self.actors, folders, strict=True)]
        )

    def load(self, folders: Sequence[str | Path]) -> None:
        self._gather(
            "load", [actor.load.remote(folder) for actor, folder in zip(self.actors, folders, strict=True)]
        )

    def nonfinite_state(self) -> list[list[str]]:
        return self._gather("nonfinite_state", [actor.nonfinite_state.remote() for actor in self.actors])

    def state_dicts(self) -> list[dict[str, Tensor]]:
        return self._gather("state_dict", [actor.state_dict.remote() for actor in self.actors])

    def driver_verifier(self) -> Any:
        """The workers' verifiers live in their actors: the driver gets its own, on first use."""
        if self._driver_verifier is None:
            from graftrl.models.rewards import MathVerifier

            self._driver_verifier = MathVerifier.from_config(self.config.reward)
        return self._driver_verifier

    @property
    def policies(self) -> list[Policy]:
        raise AttributeError(
            "backend: ray keeps the policies inside their actors; load them from the run's checkpoints"
        )

    @property
    def workers(self) -> list[Worker]:
        raise AttributeError("backend: ray keeps the workers inside their actors")

    def close(self) -> None:
        if self._driver_verifier is not None:
            self._driver_verifier.close()
            self._driver_verifier = None
        if not self.actors:
            return
        try:
            # A dead actor's close fails again: the failure that stopped the run was already raised.
            for ref in [actor.close.remote() for actor in self.actors]:
                with contextlib.suppress(Exception):
                    self.ray.get(ref)
        finally:
            for actor in self.actors:
                self.ray.kill(actor)
            self.actors = []
            if self._started:
                self.ray.shutdown()


def make_backend(
    config: Config,
    run_dir: Path,
    problems: Sequence[MathProblem],
    *,
    policies: Sequence[Policy] | None,
    verifier: Any,
    method: Method,
) -> WorkerGroup:
    backend = RayBackend if config.backend == "ray" else LocalBackend
    return backend(config, run_dir, problems, policies=policies, verifier=verifier, method=method)
