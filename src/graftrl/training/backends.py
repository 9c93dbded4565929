"""Where the policy workers run: in the trainer's process, or one Ray actor each.

Both backends expose the same two calls: ``call(name, per_worker_args)`` runs a worker method on
every worker and returns the results in policy order, and ``call_one(index, name, *args)`` runs it
on one. The local backend runs them one after another; the Ray backend runs them concurrently
(each policy on its own CPUs/GPUs), and ships large shared arguments once through the object
store.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graftrl.config import Config
from graftrl.methods import Method
from graftrl.models.policy import Policy
from graftrl.storage.data import MathProblem
from graftrl.training.parallel import DataParallelWorker
from graftrl.training.worker import PolicyWorker


class LocalBackend:
    """Every policy in this process; workers are plain objects (tests can reach into them).

    A policy with ``parallel.data: N > 1`` is a ``DataParallelWorker``: N spawned rank processes
    driven in lockstep (graftrl.training.parallel)."""

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
        self.workers: list[Any] = []
        for index, spec in enumerate(config.policies):
            if spec.parallel.data > 1:
                if policies is not None:
                    raise ValueError(
                        f"policies[{spec.name}].parallel.data > 1 loads the policy inside each rank "
                        "from `policies[].path`, not from an in-memory policy"
                    )
                # N rank processes; rank 0 builds its own verifier unless one was given (pickled).
                given = None if verifier is self._owned_verifier else verifier
                self.workers.append(DataParallelWorker(config, index, run_dir, problems, given))
                self.workers[-1].verifier = verifier  # the driver's (stored peers' re-verification)
                continue
            self.workers.append(
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
        self.shares_method = not any(isinstance(w, DataParallelWorker) for w in self.workers)

    def call(self, name: str, per_worker_args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        args = per_worker_args or [()] * len(self.workers)
        return [getattr(worker, name)(*a) for worker, a in zip(self.workers, args, strict=True)]

    def call_one(self, index: int, name: str, *args: Any) -> Any:
        return getattr(self.workers[index], name)(*args)

    def share(self, value: Any) -> Any:
        return value

    @property
    def policies(self) -> list[Policy]:
        return [worker.policy for worker in self.workers]

    def close(self) -> None:
        """Engines and the verifier pool; the policies stay usable (evaluation after training)."""
        for worker in self.workers:
            worker.close()
        if self._owned_verifier is not None:
            self._owned_verifier.close()


class RayBackend:
    """One Ray actor per policy (``policies[].resources``); joins a cluster or starts a local Ray.

    A policy with ``parallel.data: N > 1`` is one actor hosting a ``DataParallelWorker``: its N
    ranks run on that actor's node and GPUs (give it ``resources.num_gpus: N``)."""

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
                "backend: ray needs Ray; install it with `pip install 'graftrl[ray]'` or set backend: local"
            ) from None
        if policies is not None:
            raise ValueError("backend: ray loads every policy inside its actor from `policies[].path`")
        self.ray = ray
        self._started = False
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
        actor_class = ray.remote(PolicyWorker)
        ranks_class = ray.remote(DataParallelWorker)
        shared_problems = ray.put(list(problems))
        self.actors = []
        for index, spec in enumerate(config.policies):
            resources = spec.resources
            options = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus, "name": None}
            if spec.parallel.data > 1:
                # The actor spawns the policy's N ranks on its node, on the GPUs it reserved.
                self.actors.append(
                    ranks_class.options(**options).remote(
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
        self.shares_method = False
        # Fail here, not at the first step, when an actor cannot start (bad path, no GPU, ...).
        ray.get([actor.__ray_ready__.remote() for actor in self.actors])

    def call(self, name: str, per_worker_args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        args = per_worker_args or [()] * len(self.actors)
        refs = [getattr(actor, name).remote(*a) for actor, a in zip(self.actors, args, strict=True)]
        return self.ray.get(refs)

    def call_one(self, index: int, name: str, *args: Any) -> Any:
        return self.ray.get(getattr(self.actors[index], name).remote(*args))

    def share(self, value: Any) -> Any:
        """Put a value sent to every actor in the object store once (actors receive the value)."""
        return self.ray.put(value)

    @property
    def policies(self) -> list[Policy]:
        raise AttributeError(
            "backend: ray keeps the policies inside their actors; load them from the run's checkpoints"
        )

    def close(self) -> None:
        if not self.actors:
            return
        try:
            self.ray.get([actor.close.remote() for actor in self.actors])
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
) -> LocalBackend | RayBackend:
    backend = RayBackend if config.backend == "ray" else LocalBackend
    return backend(config, run_dir, problems, policies=policies, verifier=verifier, method=method)
