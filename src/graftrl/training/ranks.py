"""Data parallelism inside one policy: the N rank processes and the proxy the trainer holds.

A policy with ``parallel.data: N > 1`` runs as N processes (ranks) that each hold a
``PolicyWorker`` and execute every call in lockstep (SPMD): the trainer talks to one
``DataParallelWorker`` proxy (``RayDataParallelWorker`` under ``backend: ray``), which sends
each call to all ranks and returns rank 0's answer, so the Trainer and the backends see an
ordinary worker. What happens inside a rank (sharding, collectives) is
``graftrl.training.parallel``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graftrl.config import Config
from graftrl.training import worker_calls as calls
from graftrl.training.failures import WorkerFailure, exception_cause, exit_cause, ray_cause, worker_failure
from graftrl.training.parallel import rank_device
from graftrl.training.rescue import RescueResult, RescueRoundRequest
from graftrl.training.sampling import PolicyRollout
from graftrl.training.worker import PolicyWorker


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _join_group(rank: int, world: int, init_method: str, config: Config, index: int) -> None:
    """Join the policy's process group: NCCL on its GPU, else gloo; the collectives' timeout."""
    spec = config.policies[index]
    backend = "nccl" if torch.cuda.is_available() and spec.device != "cpu" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank_device(spec.device, rank))
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=spec.parallel.timeout_s),
    )


def _rank_main(
    rank: int,
    world: int,
    port: int,
    connection: Connection,
    config: Config,
    index: int,
    run_dir: str,
    problems: Sequence[Any],
    verifier: Any,
) -> None:
    """One rank: join the group, build the worker, run calls until told to stop."""
    torch.set_num_threads(1)  # ranks share the CPUs (PITFALLS: spinning OpenMP threads)
    os.environ["LOCAL_RANK"] = str(rank)  # the ranks of a local run share the node's GPUs
    try:
        _join_group(rank, world, f"tcp://127.0.0.1:{port}", config, index)
        worker = PolicyWorker(config, index, run_dir, problems, verifier=verifier if rank == 0 else None)
        connection.send(("ok", None))
    except BaseException as error:
        connection.send(("error", _describe(error)))
        return
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the driver is gone
            break
        if message is None:
            break
        name, args = message
        try:
            result = getattr(worker, name)(*args)
            connection.send(("ok", result if rank == 0 else None))
        except BaseException as error:
            connection.send(("error", _describe(error)))
            break
    with contextlib.suppress(Exception):
        worker.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _describe(error: BaseException) -> tuple[str, str]:
    """(``Type: message (at file:line in function)`` of the innermost frame, the full traceback)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{exception_cause(error)}{where}", "".join(traceback.format_exception(error))


def _has_reply(connection: Connection) -> bool:
    """A reply is waiting (a closed pipe with nothing in it is no reply)."""
    try:
        return connection.poll()
    except (EOFError, OSError):
        return False


class RankFailure(WorkerFailure):
    """A rank of a data-parallel policy raised or died; every rank of it has been stopped. One
    paragraph naming the policy, the rank, the cause and how to resume (``training.failures``)."""


class _RankCalls:
    """The PolicyWorker calls the trainer makes, each sent to every rank (``_call``): explicit
    methods, so Ray can host the proxies as actors."""

    def __init__(self, config: Config, index: int) -> None:
        spec = config.policies[index]
        self.name = spec.name
        self.world = spec.parallel.data

    def _call(self, name: str, *args: Any) -> Any:
        raise NotImplementedError

    def reset_peak_memory(self) -> None:
        self._call("reset_peak_memory")

    def rollout(self, request: calls.RolloutRequest) -> PolicyRollout:
        return self._call("rollout", request)

    def rescue(self, request: RescueRoundRequest) -> RescueResult | None:
        # every rank samples (method: hint refuses parallel.data > 1 until this is tested)
        return self._call("rescue", request)

    def update(self, request: calls.UpdateRequest) -> calls.UpdateResult:
        return self._call("update", request)

    def score_peers(self, request: calls.PeerScoringRequest) -> calls.PeerScores:
        return self._call("score_peers", request)

    def save(self, request: calls.CheckpointRequest) -> None:
        self._call("save", request)

    def save_policy(self, request: calls.SavePolicyRequest) -> None:
        self._call("save_policy", request)

    def load(self, request: calls.CheckpointRequest) -> None:
        self._call("load", request)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._call("state_dict")

    def validation_scores(self) -> dict[str, float]:
        return self._call("validation_scores")

    def nonfinite_state(self, limit: int = 3) -> list[str]:
        return self._call("nonfinite_state", limit)

    @property
    def policy(self) -> Any:
        raise AttributeError(
            f"policy {self.name!r} runs in {self.world} data-parallel ranks (parallel.data); load it "
            "from the run's checkpoints (each holds a plain save_pretrained folder)"
        )


class DataParallelWorker(_RankCalls):
    """The trainer's handle on a policy trained by N ranks (``policies[].parallel.data``).

    Calls go to every rank; rank 0's result comes back. When any rank raises or dies, the others
    (possibly waiting in a collective) are terminated at once and the call raises ``RankFailure``
    naming the rank and its error: no hang until the collective's timeout.
    """

    def __init__(
        self, config: Config, index: int, run_dir: str | Path, problems: Sequence[Any], verifier: Any = None
    ) -> None:
        import multiprocessing

        super().__init__(config, index)
        self.verifier = verifier
        self.run_dir = Path(run_dir)
        context = multiprocessing.get_context("spawn")
        port = _free_port()
        self.connections: list[Connection] = []
        self.processes: list[Any] = []
        for rank in range(self.world):
            parent, child = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank, self.world, port, child, config, index, str(run_dir), list(problems), verifier),
                name=f"graftrl-{self.name}-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)
        self._collect("start")

    def _call(self, name: str, *args: Any) -> Any:
        if not self.processes:
            raise RankFailure(f"policy {self.name!r}: its ranks were stopped after an earlier failure")
        for connection in self.connections:
            # A dead rank's pipe refuses the call; _collect names the rank from its exit code.
            with contextlib.suppress(OSError):
                connection.send((name, args))
        return self._collect(name)

    def _collect(self, name: str) -> Any:
        """Rank 0's reply to the call ``name``; fail fast on any rank's error or death."""
        pending = dict(enumerate(self.connections))
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        result = None
        while pending:
            ready = wait([*pending.values(), *sentinels])
            for item in ready:
                if item in sentinels:
                    rank = sentinels[item]
                    if rank in pending and not _has_reply(pending[rank]):
                        self._rank_exited(rank, name)
                    continue
                rank = next(r for r, c in pending.items() if c is item)
                try:
                    status, value = item.recv()
                except (EOFError, OSError):  # the rank died before it answered
                    self._rank_exited(rank, name)
                del pending[rank]
                if status == "error":
                    self._stop()
                    summary, details = value
                    raise self._failure(rank, name, summary, details)
                if rank == 0:
                    result = value
        return result

    def _rank_exited(self, rank: int, name: str) -> None:
        process = self.processes[rank]
        process.join(timeout=5)
        code = process.exitcode
        self._stop()
        cause = f"{exit_cause(code)} (exit code {code}; all its ranks were stopped)"
        raise self._failure(rank, name, cause, f"rank {rank} (pid {process.pid}) exited with code {code}")

    def _failure(self, rank: int, name: str, cause: str, details: str) -> RankFailure:
        return worker_failure(
            self.run_dir, f"policy {self.name!r}, rank {rank}", name, cause, details, kind=RankFailure
        )

    def _stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []

    def close(self) -> None:
        """Close every rank's worker, then end the processes."""
        if not self.processes:
            return
        try:
            self._call("close")
        finally:
            for connection in self.connections:
                with contextlib.suppress(OSError):
                    connection.send(None)
            for process in self.processes:
                process.join(timeout=30)
            self._stop()


# ----- Ray: one actor per rank, in a placement group per policy ---------------------------------
class RankActor:
    """One rank of a data-parallel policy as a Ray actor, in a bundle of the policy's placement
    group (``RayDataParallelWorker``); the same worker and replies as a spawned rank."""

    def address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there: the process group's rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, _free_port("")

    def start(
        self,
        rank: int,
        world: int,
        init_method: str,
        config: Config,
        index: int,
        run_dir: str,
        problems: Sequence[Any],
        verifier: Any,
        threads: int,
    ) -> None:
        torch.set_num_threads(threads)
        os.environ["LOCAL_RANK"] = "0"  # Ray shows the rank only its bundle's GPU
        self.rank = rank
        _join_group(rank, world, init_method, config, index)
        self.worker = PolicyWorker(config, index, run_dir, problems, verifier=verifier if rank == 0 else None)

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        result = getattr(self.worker, name)(*args)
        return result if self.rank == 0 else None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.worker.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def rank_bundles(spec: Any) -> list[dict[str, float]]:
    """The placement group of a policy: one bundle per rank, the policy's ``resources`` shared
    equally (``num_gpus: 4`` over 4 ranks: one GPU each)."""
    world = spec.parallel.data
    bundle = {"CPU": spec.resources.num_cpus / world}
    if spec.resources.num_gpus:
        bundle["GPU"] = spec.resources.num_gpus / world
    return [dict(bundle) for _ in range(world)]


class RayDataParallelWorker(_RankCalls):
    """``backend: ray``'s handle on a policy trained by N ranks: a placement group with one bundle
    per rank (``parallel.placement``: PACK keeps the ranks on as few nodes as possible, SPREAD
    across nodes), a ``RankActor`` in each, joined in one process group at rank 0's node.

    Hosted by a Ray actor itself (the backend's per-policy actor, no resources of its own); its
    rank actors and placement group go with it. As with spawned ranks, a rank that raises or dies
    stops them all and the call raises ``RankFailure`` naming it.
    """

    def __init__(
        self, config: Config, index: int, run_dir: str | Path, problems: Sequence[Any], verifier: Any = None
    ) -> None:
        super().__init__(config, index)
        self.ranks: list[Any] = []
        self._start_args = (config, index, str(run_dir), list(problems), verifier)

    def start(self) -> None:
        """Place the ranks and join them in one group (a method, not ``__init__``, so that its
        ``RankFailure`` reaches the driver as itself, not as a dead actor)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config, index, run_dir, problems, verifier = self._start_args
        spec = config.policies[index]
        bundles = rank_bundles(spec)
        self.group = placement_group(bundles, strategy=spec.parallel.placement, name=f"graftrl-{spec.name}")
        ready, _ = ray.wait([self.group.ready()], timeout=spec.parallel.timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise RankFailure(
                f"policy {self.name!r}: Ray could not place its {self.world} ranks ({bundles[0]} each, "
                f"strategy {spec.parallel.placement}) within parallel.timeout_s = {spec.parallel.timeout_s:g} s; "
                f"the cluster has {ray.available_resources()} free: lower resources or parallel.data, or add nodes"
            )
        actor = ray.remote(RankActor)
        threads = max(1, int(bundles[0]["CPU"]))
        self.ranks = [
            actor.options(
                num_cpus=bundles[rank]["CPU"],
                num_gpus=bundles[rank].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(self.world)
        ]
        host, port = self._gather("address", [self.ranks[0].address.remote()])
        self._gather(
            "start",
            [
                rank_actor.start.remote(
                    rank,
                    self.world,
                    f"tcp://{host}:{port}",
                    config,
                    index,
                    run_dir,
                    problems,
                    verifier,
                    threads,
                )
                for rank, rank_actor in enumerate(self.ranks)
            ],
        )

    def _call(self, name: str, *args: Any) -> Any:
        if not self.ranks:
            raise RankFailure(f"policy {self.name!r}: its ranks were stopped after an earlier failure")
        return self._gather(name, [rank_actor.call.remote(name, args) for rank_actor in self.ranks])

    def _gather(self, name: str, refs: list[Any]) -> Any:
        """Rank 0's reply; on the first rank that raises or dies, stop every rank and raise."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as error:  # the rank's own error, or RayActorError when it died
                rank = refs.index(done[0])
                self._stop()
                cause, details, _ = ray_cause(error)
                raise worker_failure(
                    self._start_args[2],
                    f"policy {self.name!r}, rank {rank}",
                    name,
                    cause,
                    details,
                    kind=RankFailure,
                ) from None
        return ray.get(refs[0])

    def _stop(self) -> None:
        import ray

        for rank_actor in self.ranks:
            with contextlib.suppress(Exception):
                ray.kill(rank_actor)
        self.ranks = []
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)

    def close(self) -> None:
        """Close every rank's worker, then end the actors and free the placement group."""
        if not self.ranks:
            return
        import ray

        try:
            ray.get([rank_actor.close.remote() for rank_actor in self.ranks])
        finally:
            self._stop()
