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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor

from graftrl.config import Config
from graftrl.methods import Method
from graftrl.models.policy import Policy
from graftrl.storage.data import MathProblem
from graftrl.training import worker_calls as calls
from graftrl.training.failures import ray_cause, worker_failure
from graftrl.training.ranks import DataParallelWorker, RayDataParallelWorker
from graftrl.training.rescue import RescueResult, RescueRoundRequest
from graftrl.training.sampling import PolicyRollout
from graftrl.training.worker import PolicyWorker
from graftrl.training.worker_calls import Worker

_Stateful = TypeVar("_Stateful", bound=calls.UpdateRequest)


@dataclass(frozen=True)
class BackendSetup:
    """What a backend builds its workers from (``make_backend``)."""

    config: Config
    run_dir: Path
    problems: Sequence[MathProblem]
    """The training prompts (each worker checks they fit its context; dynamic sampling's extras)."""
    method: Method
    """The driver's method: local workers share it, the others receive its state with each update."""
    policies: Sequence[Policy] | None = None
    """In-memory policies (``backend: local``; None: each worker loads ``policies[].path``)."""
    verifier: Any = None
    """The caller's verifier, used everywhere (sent to rank processes and Ray actors: a picklable
    one); None: the run's own, ``run_verifier``."""
    run_verifier: Any = None
    """The run's verifier that the trainer built from ``reward`` (and started) when the caller gave
    none: this process's workers share it and the driver re-verifies with it, while processes of
    their own (data-parallel ranks, Ray actors) build theirs from the config; the trainer closes
    it. None too: the backend builds one."""


class WorkerGroup(abc.ABC):
    """Every policy's worker, driven together; results come back in policy order (``config.policies``).

    What the trainer calls, and all it knows of where the workers run. Each call that carries
    something takes one request (``worker_calls``)."""

    name: str
    """The ``backend`` config value."""

    @abc.abstractmethod
    def reset_peak_memory(self) -> None:
        """Start every worker's ``memory_peak_mb`` window (the start of a step)."""

    @abc.abstractmethod
    def rollout(self, request: calls.RolloutRequest) -> list[PolicyRollout]:
        """Every policy samples and scores the step's prompts."""

    @abc.abstractmethod
    def rescue(self, request: RescueRoundRequest) -> list[RescueResult | None]:
        """Every policy with a request samples its rescue round (``training.rescue``; None: none)."""

    @abc.abstractmethod
    def update(self, request: calls.UpdateRequest) -> list[calls.UpdateResult]:
        """Every policy trains on its plan given every model's records; returns each policy's
        ``UpdateResult`` (its metrics row, the compatibility scores of what it received). Workers
        that hold their own copy of the method receive the driver's method state with it."""

    @abc.abstractmethod
    def score_peers(self, request: calls.PeerScoringRequest) -> list[calls.PeerScores]:
        """``update`` without the optimizer (``graftrl probe``): each policy builds and scores the
        rows of its plan's peer groups and returns them."""

    @abc.abstractmethod
    def validation_scores(self) -> list[dict[str, float]]:
        """pass@1 per validation benchmark of each policy, sampled by its own rollout engine."""

    @abc.abstractmethod
    def save_policy(self, request: calls.SavePolicyRequest) -> None:
        """One policy's weights and tokenizer (a plain save_pretrained folder)."""

    @abc.abstractmethod
    def save(self, request: calls.CheckpointRequest) -> None:
        """Each policy's weights and optimizer state into its folder (a checkpoint's part)."""

    @abc.abstractmethod
    def load(self, request: calls.CheckpointRequest) -> None:
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


class _EachWorker(WorkerGroup):
    """The calls of both backends, each sent to the workers by ``_each`` (local: one after
    another; Ray: every actor at once), which is all a backend implements of them."""

    _shares_method = False
    """The workers hold the driver's method object itself (else its state goes with each update)."""

    def __init__(self, setup: BackendSetup) -> None:
        self.config = setup.config
        self.run_dir = Path(setup.run_dir)
        self._method = setup.method  # the driver's: planning updates its state before each update
        self._place(setup)

    @abc.abstractmethod
    def _place(self, setup: BackendSetup) -> None:
        """Build every policy's worker."""

    @abc.abstractmethod
    def _each(self, call: str, request: Any = None, indices: Sequence[int] | None = None) -> list[Any]:
        """Every worker's (``indices``: those policies') reply to ``call`` with ``request`` (None:
        a call without one), in policy order."""

    def _with_method_state(self, request: _Stateful) -> _Stateful:
        if self._shares_method:
            return request
        return replace(request, method_state=self._method.state_dict())

    def reset_peak_memory(self) -> None:
        self._each("reset_peak_memory")

    def rollout(self, request: calls.RolloutRequest) -> list[PolicyRollout]:
        return self._each("rollout", request)

    def rescue(self, request: RescueRoundRequest) -> list[RescueResult | None]:
        return self._each("rescue", request)

    def update(self, request: calls.UpdateRequest) -> list[calls.UpdateResult]:
        return self._each("update", self._with_method_state(request))

    def score_peers(self, request: calls.PeerScoringRequest) -> list[calls.PeerScores]:
        return self._each("score_peers", self._with_method_state(request))

    def validation_scores(self) -> list[dict[str, float]]:
        return self._each("validation_scores")

    def save_policy(self, request: calls.SavePolicyRequest) -> None:
        self._each("save_policy", request, [request.index])

    def save(self, request: calls.CheckpointRequest) -> None:
        self._each("save", request)

    def load(self, request: calls.CheckpointRequest) -> None:
        self._each("load", request)

    def nonfinite_state(self) -> list[list[str]]:
        return self._each("nonfinite_state")

    def state_dicts(self) -> list[dict[str, Tensor]]:
        return self._each("state_dict")


class LocalBackend(_EachWorker):
    """Every policy in this process; workers are plain objects (tests can reach into them).

    A policy with ``parallel.data: N > 1`` is a ``DataParallelWorker``: N spawned rank processes
    driven in lockstep (graftrl.training.ranks)."""

    name = "local"

    def _place(self, setup: BackendSetup) -> None:
        problems, policies, given = setup.problems, setup.policies, setup.verifier
        config = self.config
        # One verifier (and its worker pool) for every policy in this process.
        self._owned_verifier = None
        verifier = given if given is not None else setup.run_verifier
        if verifier is None:
            from graftrl.verifiers.registry import build_verifier, start_verifier

            built = build_verifier(config.reward)
            verifier = self._owned_verifier = start_verifier(built, config.reward.kind)
        self._workers: list[Worker] = []
        for index, spec in enumerate(config.policies):
            if spec.parallel.data > 1:
                if policies is not None:
                    raise ValueError(
                        f"policies[{spec.name}].parallel.data > 1 loads the policy inside each rank "
                        "from `policies[].path`, not from an in-memory policy"
                    )
                # N rank processes; rank 0 builds its own verifier unless one was given (pickled).
                ranks = DataParallelWorker(config, index, self.run_dir, problems, given)
                ranks.verifier = verifier  # the driver's (stored peers' re-verification)
                self._workers.append(ranks)
                continue
            self._workers.append(
                PolicyWorker(
                    config,
                    index,
                    self.run_dir,
                    problems,
                    policy=policies[index] if policies is not None else None,
                    verifier=verifier,
                    method=self._method,  # shared: the driver's plan state is the workers' state
                )
            )
        # Rank processes hold their own copies of the method: send its state with each update.
        self._shares_method = not any(isinstance(w, DataParallelWorker) for w in self._workers)

    def _each(self, call: str, request: Any = None, indices: Sequence[int] | None = None) -> list[Any]:
        workers = self._workers if indices is None else [self._workers[i] for i in indices]
        arguments = () if request is None else (request,)
        return [getattr(worker, call)(*arguments) for worker in workers]

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


class RayBackend(_EachWorker):
    """One Ray actor per policy (``policies[].resources``); joins a cluster or starts a local Ray.

    A policy with ``parallel.data: N > 1`` is one actor hosting a ``RayDataParallelWorker``: its N
    ranks are actors of a placement group (``parallel.placement``), each with ``resources`` / N,
    on one node or several (then the run folder must be on a filesystem every node mounts: the
    ranks write their checkpoint shards there). Every actor holds its own copy of the method."""

    name = "ray"

    def _place(self, setup: BackendSetup) -> None:
        problems, policies, verifier = setup.problems, setup.policies, setup.verifier
        try:
            import ray
        except ImportError:
            raise RuntimeError(
                "backend: ray needs Ray; install it with `pip install -e '.[ray]'` or set backend: local"
            ) from None
        if policies is not None:
            raise ValueError("backend: ray loads every policy inside its actor from `policies[].path`")
        config = self.config
        self.ray = ray
        self._started = False
        self._driver_verifier: Any = None
        self._run_verifier = setup.run_verifier
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
                        config, index, str(self.run_dir), shared_problems, verifier
                    )
                )
                continue
            self.actors.append(
                actor_class.options(**options).remote(
                    config,
                    index,
                    str(self.run_dir),
                    shared_problems,
                    verifier=verifier,
                    threads=int(resources.num_cpus),
                )
            )
        # Fail here, not at the first step, when an actor cannot start (bad path, no GPU, ranks
        # that cannot be placed, ...), and leave no actor or private Ray behind.
        try:
            self._each("start")
        except BaseException:
            self.close()
            raise

    def _each(self, call: str, request: Any = None, indices: Sequence[int] | None = None) -> list[Any]:
        """Each call starts on every actor before waiting on any: the policies run concurrently.
        The request goes into the object store once (the step's records with it)."""
        indices = range(len(self.actors)) if indices is None else indices
        arguments = () if request is None else (self.ray.put(request),)
        return self._gather(
            call, [getattr(self.actors[i], call).remote(*arguments) for i in indices], indices
        )

    def _gather(self, during: str, refs: list[Any], indices: Sequence[int]) -> list[Any]:
        """Every actor's reply to the call ``during``, in policy order (``indices``: the policies
        of ``refs``). The first actor that fails stops the run: an anticipated error as its own
        one line, anything else (a dead actor, a bug, out of memory) as one paragraph naming the
        policy, with the report in the run's error log."""
        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            try:
                self.ray.get(done[0])
            except Exception as error:
                cause, details, anticipated = ray_cause(error)
                if anticipated is not None:
                    raise anticipated from None
                name = self.config.policies[indices[refs.index(done[0])]].name
                raise worker_failure(
                    self.run_dir, f"policy {name!r} (Ray actor)", during, cause, details
                ) from None
        return self.ray.get(refs)

    def driver_verifier(self) -> Any:
        """The workers' verifiers live in their actors: the driver's is the run's (the trainer's),
        else its own, built on first use."""
        if self._run_verifier is not None:
            return self._run_verifier
        if self._driver_verifier is None:
            from graftrl.verifiers.registry import build_verifier, start_verifier

            built = build_verifier(self.config.reward)
            self._driver_verifier = start_verifier(built, self.config.reward.kind)
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


def make_backend(setup: BackendSetup) -> WorkerGroup:
    """The configured backend (``backend``: local or ray), its workers built."""
    backend = RayBackend if setup.config.backend == "ray" else LocalBackend
    return backend(setup)
