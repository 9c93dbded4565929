"""Algorithm 1: co-train K policies on a shared prompt stream with GRPO or GRAFT.

Each step: every policy samples n responses per prompt, the verifier scores them, each policy
computes its own GRPO advantages; the method plans which groups each receiver trains on; each
receiver scores the grafted responses on its own tokenization, weighs them, and updates with
peer groups ordered last. The loop knows nothing of two models in particular.

The trainer is the driver: it samples the prompt batch, plans the exchange, logs, checkpoints and
replays stored peers. Everything that touches a policy's weights is a ``PolicyWorker``
(graftrl.worker), placed by the backend (graftrl.backends): in this process or in Ray actors.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from graftrl.backends import LocalBackend, RayBackend, make_backend
from graftrl.config import Config, dump_config
from graftrl.core import complementarity, group_outcome_fractions, grpo_advantages
from graftrl.data import MathProblem, PromptSampler, load_problems
from graftrl.methods import GroupOutcomes, build_method
from graftrl.metrics import MetricsLogger
from graftrl.policy import Policy
from graftrl.records import TrajectoryRecord
from graftrl.store import StoreError, TrajectoryStore, TrajectoryWriter
from graftrl.worker import PolicyRollout, step_seed, with_suffix, write_jsonl

__all__ = ["Trainer", "step_seed", "with_suffix"]


class Trainer:
    """Runs Algorithm 1 for a config and writes everything into ``run_dir``."""

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        *,
        problems: Sequence[MathProblem] | None = None,
        policies: Sequence[Policy] | None = None,
        verifier: Any = None,
        step_callback: Callable[[int, dict[str, dict[str, Any]]], None] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.problems = list(problems) if problems is not None else load_problems(config.data.train)
        self.method = build_method(config.method, config)
        self.sampler = PromptSampler(self.problems, config.train.batch_prompts, config.seed)
        self.n = config.rollout.n
        self.names = [p.name for p in config.policies]
        if policies is None:  # before any weights load: a clear error when the run cannot fit
            from graftrl.memory import check_before_loading

            check_before_loading(config)
        self.backend: LocalBackend | RayBackend = make_backend(
            config, self.run_dir, self.problems, policies=policies, verifier=verifier, method=self.method
        )
        self.step_callback = step_callback
        self.start_step = 0
        self.logger: MetricsLogger | None = None
        self.validator = None
        if config.validation.files:  # validation and best-checkpoint selection (graftrl.validation)
            from graftrl.validation import Validator

            local = self.backend.workers[0] if isinstance(self.backend, LocalBackend) else None
            self.validator = Validator(
                config, self.run_dir, local.verifier if local else None, local.engine if local else None
            )
        # Trajectory recording (graftrl.store) and stored peers replayed from earlier runs (SPEC 2.3).
        self.recorder = None
        if config.store.record:
            self.recorder = TrajectoryWriter(Path(config.store.path or self.run_dir / "store"))
        self.stored_peers = {peer.name: (peer, TrajectoryStore(peer.path)) for peer in config.peers}
        self._peer_verifier = verifier
        self._owns_peer_verifier = False

    @property
    def policies(self) -> list[Policy]:
        """The policies (``backend: local``; Ray keeps them in their actors)."""
        return self.backend.policies

    @property
    def workers(self):
        """The in-process workers (``backend: local``)."""
        return self.backend.workers  # type: ignore[union-attr]

    @property
    def peer_verifier(self) -> Any:
        """The driver's verifier, for re-verifying stored peers' rewards."""
        if self._peer_verifier is None:
            if isinstance(self.backend, LocalBackend):
                self._peer_verifier = self.backend.workers[0].verifier
            else:
                from graftrl.rewards import MathVerifier

                reward = self.config.reward
                self._peer_verifier = MathVerifier(timeout_s=reward.timeout_s, workers=reward.workers)
                self._owns_peer_verifier = True
        return self._peer_verifier

    # ----- the loop -----------------------------------------------------------------------
    def train(self, resume: bool = False) -> None:
        (self.run_dir / "config.yaml").write_text(dump_config(self.config))
        logging = self.config.logging
        self.logger = MetricsLogger(
            self.run_dir,
            logging.tensorboard,
            logging.wandb,
            logging.wandb_project,
            self.config.model_dump(mode="json"),
        )
        if resume:
            self.resume()
        total = self.config.train.steps
        every = self.config.checkpoint.every
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            with Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                disable=not logging.progress,
            ) as progress:
                task = progress.add_task(
                    f"{self.config.method} train", total=total, completed=self.start_step, status=""
                )
                for step in range(self.start_step, total):
                    metrics = self.step(step)
                    status = "  ".join(f"{name} r={m['reward_mean']:.2f}" for name, m in metrics.items())
                    progress.update(task, advance=1, status=status)
                    if self.step_callback is not None:
                        self.step_callback(step, metrics)
                    if self.validator is not None and self.validator.due(step):
                        self.validate(step)  # after the step: not part of its timings
                    if (every and (step + 1) % every == 0) or step + 1 == total:
                        self.save_checkpoint(step)
        finally:
            self.logger.close()
            self.close()

    def close(self) -> None:
        """Free engines, verifier pools and Ray actors (local policies stay usable for evaluation)."""
        self.backend.close()
        if self._owns_peer_verifier:
            self._peer_verifier.close()
            self._owns_peer_verifier = False

    def step(self, step: int) -> dict[str, dict[str, Any]]:
        """One rollout batch and one update of every policy; returns metrics per model."""
        problems = self.sampler.batch(step)
        self.backend.call("reset_peak_memory")
        # Every policy samples and scores the step's prompts (concurrently under Ray).
        sampled: dict[str, PolicyRollout] = dict(
            zip(self.names, self.backend.call("rollout", [(step, problems)] * len(self.names)), strict=True)
        )
        outcomes = {name: s.outcomes for name, s in sampled.items()}
        records = {name: s.records for name, s in sampled.items()}
        shared = {name: s.shared for name, s in sampled.items()}
        if self.recorder is not None:
            self.recorder.write_step(step, [row for s in sampled.values() for row in s.store_rows])
        stored_info: dict[str, float] = {}
        for name, (stored_outcomes, stored_records, changed) in self._stored_peer_groups(
            step, problems
        ).items():
            outcomes[name], records[name], shared[name] = stored_outcomes, stored_records, stored_outcomes
            stored_info[f"stored_reward_changes/{name}"] = changed

        generator = torch.Generator().manual_seed(step_seed(self.config.seed, step, 0))
        plans = self.method.plan(outcomes, generator)
        method_state = None if self.backend.shares_method else self.method.state_dict()
        shared_records = self.backend.share(records)
        updates = self.backend.call(
            "update", [(step, plans[name], shared_records, method_state) for name in self.names]
        )
        metrics: dict[str, dict[str, Any]] = {}
        for name, row in zip(self.names, updates, strict=True):
            compatibility = row.pop("_compatibility", None)
            if compatibility is not None:
                write_jsonl(self.run_dir / "compatibility.jsonl", compatibility)
            row.update(self._outcome_metrics(name, outcomes, shared))
            row.update(sampled[name].info)
            row.update(stored_info)
            row.update(plans[name].diagnostics)
            row.update(sampled[name].timings)
            timings = {k: v for k, v in row.items() if k.startswith("time_") and k != "time_step"}
            row["time_step"] = sum(timings.values())
            metrics[name] = row
        for name, row in metrics.items():
            assert self.logger is not None
            self.logger.log({"step": step, "model": name, "method": self.method.name, **row})
        self._log_samples(step, sampled, outcomes)
        return metrics

    def _stored_peer_groups(
        self, step: int, problems: Sequence[MathProblem]
    ) -> dict[str, tuple[GroupOutcomes, list[TrajectoryRecord], float]]:
        """Each stored peer's groups on this step's prompts, rewards re-verified (SPEC 2.3).

        A group whose re-verified rewards equal the stored ones keeps its stored (source-computed)
        advantages; one whose rewards changed gets advantages recomputed on its full group.
        """
        out = {}
        n = self.n
        for name, (peer, store) in self.stored_peers.items():
            ids = [p.id for p in problems]
            if peer.match == "step" and step not in store.steps():
                held = store.steps()
                raise StoreError(
                    f"peers[{name}]: store {peer.path} has no step {step} (it holds steps "
                    f"{held[0] if held else '-'}..{held[-1] if held else '-'}); train for at most as many "
                    "steps as were recorded, or set `match: prompt_id` to match prompts regardless of step"
                )
            found = store.find_groups(ids, source=name, step=step if peer.match == "step" else None)
            missing = [i for i in ids if i not in found]
            if missing:
                where = f"step {step}" if peer.match == "step" else "any step"
                raise StoreError(
                    f"peers[{name}]: store {peer.path} has no group of source {name!r} at {where} for "
                    f"{len(missing)} of the step's {len(ids)} prompts (e.g. {missing[:3]}); record the peer "
                    "with the same data, seed and batch size, or set `match: prompt_id`"
                )
            groups = [sorted(found[i], key=lambda row: row.index) for i in ids]
            sizes = {len(g) for g in groups}
            if sizes != {n}:
                raise StoreError(
                    f"peers[{name}]: stored groups hold {sorted(sizes)} responses; set rollout.n: {n} to match or re-record"
                )
            texts = [row.response for group in groups for row in group]
            answers = [p.answer for p in problems for _ in range(n)]
            rewards = torch.tensor(self.peer_verifier.score(texts, answers), dtype=torch.float32).view(
                len(ids), n
            )
            stored_rewards = torch.tensor([[row.reward for row in g] for g in groups], dtype=torch.float32)
            stored_advantages = torch.tensor(
                [[row.advantage for row in g] for g in groups], dtype=torch.float32
            )
            changed = (rewards != stored_rewards).any(dim=-1)  # [P]
            recomputed = grpo_advantages(
                rewards, self.config.train.adv_eps, self.config.train.adv_std_unbiased
            )
            advantages = torch.where(changed.unsqueeze(-1), recomputed, stored_advantages)
            records = [
                dataclasses.replace(
                    row.to_record(), reward=float(rewards[p, i]), advantage=float(advantages[p, i])
                )
                for p, group in enumerate(groups)
                for i, row in enumerate(group)
            ]
            out[name] = (GroupOutcomes(rewards, advantages), records, float(changed.sum()))
        return out

    def _outcome_metrics(
        self, name: str, outcomes: dict[str, GroupOutcomes], shared: dict[str, GroupOutcomes]
    ) -> dict[str, Any]:
        """Reward of what the policy trains on; complementarity on the shared batch."""
        own = outcomes[name]
        all_fail, all_pass = group_outcome_fractions(own.rewards)
        row: dict[str, Any] = {
            "reward_mean": float(own.rewards.mean()),
            "all_fail_frac": float(all_fail),
            "all_pass_frac": float(all_pass),
        }
        for peer, other in shared.items():
            if peer != name:
                row[f"complementarity/{peer}"] = float(
                    complementarity(shared[name].successes, other.successes)
                )
        return row

    def _log_samples(
        self, step: int, sampled: dict[str, PolicyRollout], outcomes: dict[str, GroupOutcomes]
    ) -> None:
        count = self.config.logging.log_samples
        if not count:
            return
        n = self.n
        with (self.run_dir / "samples.jsonl").open("a") as handle:
            for name, part in sampled.items():
                for row in range(0, min(count * n, len(part.records)), n):
                    handle.write(
                        json.dumps(
                            {
                                "step": step,
                                "model": name,
                                "prompt_id": part.problems[row // n].id,
                                "answer": part.problems[row // n].answer,
                                "response": part.records[row].response,
                                "reward": float(outcomes[name].rewards.view(-1)[row]),
                            }
                        )
                        + "\n"
                    )

    # ----- validation ---------------------------------------------------------------------
    def validate(self, step: int) -> list[dict[str, Any]]:
        """Validate every policy now (each in its worker), keep the best checkpoints."""
        assert self.validator is not None
        if isinstance(self.backend, LocalBackend):
            return self.validator.validate(step, self.backend.policies)
        rows = []
        start = time.perf_counter()
        scores = self.backend.call("validation_scores")
        seconds = time.perf_counter() - start
        for index, (name, score) in enumerate(zip(self.names, scores, strict=True)):
            rows.append(
                self.validator.record(
                    step,
                    name,
                    score,
                    lambda folder, i=index: self.backend.call_one(i, "save_policy", folder),
                    seconds,
                )
            )
        self.validator.report(step, rows)
        return rows

    # ----- checkpoints --------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self, step: int) -> Path:
        """Weights (safetensors), optimizer state and step; written to a temp folder then renamed."""
        final = self.checkpoint_root / f"step_{step + 1:06d}"
        staging = final.with_name(final.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        self.backend.call("save", [(str(staging / name),) for name in self.names])
        (staging / "method_state.json").write_text(json.dumps(self.method.state_dict()))
        (staging / "trainer_state.json").write_text(
            json.dumps({"completed_steps": step + 1, "method": self.method.name})
        )
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        existing = sorted(p for p in self.checkpoint_root.glob("step_*") if not p.name.endswith(".tmp"))
        for old in existing[: -self.config.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoint_root.glob("step_*") if not p.name.endswith(".tmp"))
        return done[-1] if done else None

    def resume(self) -> None:
        """Load the latest checkpoint: weights, optimizer, step. Randomness is derived per step."""
        checkpoint = self.latest_checkpoint()
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.checkpoint_root}")
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        self.backend.call("load", [(str(checkpoint / name),) for name in self.names])
        method_state = checkpoint / "method_state.json"
        self.method.load_state_dict(json.loads(method_state.read_text()) if method_state.exists() else {})
        self.start_step = int(state["completed_steps"])
        if self.recorder is not None:
            self.recorder.truncate_after(self.start_step - 1)
        assert self.logger is not None
        self.logger.truncate_after(self.start_step - 1)
