"""Algorithm 1: co-train K policies on a shared prompt stream with GRPO or GRAFT.

Each step: every policy samples n responses per prompt, the verifier scores them, each policy
computes its own GRPO advantages; the method plans which groups each receiver trains on; each
receiver scores the grafted responses on its own tokenization, weighs them, and updates with
peer groups ordered last. The loop knows nothing of two models in particular.

The trainer is the driver: it samples the prompt batch, plans the exchange, logs, checkpoints and
replays stored peers. Everything that touches a policy's weights is a ``PolicyWorker``
(graftrl.training.worker), placed by the backend and driven through its typed ``WorkerGroup``
interface (graftrl.training.backends): in this process or in Ray actors. Checkpoints and resume
are its collaborator ``checkpoints`` (graftrl.training.trainer_checkpoints.TrainerCheckpoints).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graftrl.config import Config, dump_config
from graftrl.console import progress_bar
from graftrl.core import all_fail_signal_fraction, complementarity, group_outcome_fractions
from graftrl.files import atomic_write
from graftrl.interrupts import clear as clear_interrupt
from graftrl.interrupts import raise_if_interrupted
from graftrl.methods import ExchangePlan, GroupOutcomes, Method, RescuePhase, build_method
from graftrl.models.policy import Policy
from graftrl.storage.checkpoint import hold_run_lock
from graftrl.storage.data import MathProblem, PromptSampler, load_problems
from graftrl.storage.metrics import MetricsLogger
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.rundir import RunDir, append_jsonl
from graftrl.storage.store import TrajectoryWriter
from graftrl.training.backends import BackendSetup, Worker, WorkerGroup, make_backend
from graftrl.training.log_schema import metric_keys
from graftrl.training.peer_sources import PeerRun, open_sources
from graftrl.training.randomness import PLAN_STREAM, step_seed
from graftrl.training.rescue import run_rescue
from graftrl.training.sampling import PolicyRollout
from graftrl.training.trainer_checkpoints import TrainerCheckpoints
from graftrl.training.worker_calls import (
    PeerScores,
    PeerScoringRequest,
    RolloutRequest,
    SavePolicyRequest,
    UpdateRequest,
)
from graftrl.verifiers.registry import as_verifier, build_verifier, start_verifier

__all__ = ["StepExchange", "Trainer", "step_seed"]


@dataclass(frozen=True)
class StepExchange:
    """A step up to the update (``Trainer.exchange``): what every model sampled and each receiver's plan."""

    problems: list[MathProblem]
    sampled: dict[str, PolicyRollout]
    """Each policy's rollout (stored peers are not in it)."""
    outcomes: dict[str, GroupOutcomes]
    """Each model's groups as the method planned on them, stored peers included."""
    records: dict[str, list[TrajectoryRecord]]
    shared: dict[str, GroupOutcomes]
    """Each model's outcomes on the shared prompt batch (for complementarity)."""
    plans: dict[str, ExchangePlan]
    stored_info: dict[str, float]
    """``stored_reward_changes/<peer>`` per stored peer, ``served_<cost>/<peer>`` per served peer."""
    served_prompts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per served peer: the prompts (batch positions) it answered; its records elsewhere are
    placeholders (``served_groups.dense_records``)."""
    rescues: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    """Each receiver's rescues.jsonl rows (a method with a rescue round; else empty)."""


def check_chat_templates(config: Config, policies: Sequence[Policy] | None = None) -> None:
    """Each policy's ``chat_template`` against its tokenizer, before any weights load (the
    tokenizers only): refused in one line when asked of a tokenizer without one, one warning line
    when a tokenizer's template goes unused (``models.prompts.check_chat_template``)."""
    from graftrl.console import warn
    from graftrl.models.model_loading import load_tokenizer
    from graftrl.models.prompts import check_chat_template

    given = {p.name: p.tokenizer for p in policies or ()}
    for spec in config.policies:
        tokenizer = given[spec.name] if spec.name in given else load_tokenizer(spec.name, spec.path)
        check_chat_template(spec.name, tokenizer, spec.chat_template, warn=warn)


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
        self.files = RunDir(self.run_dir)
        """Every path of the run folder (graftrl.storage.rundir)."""
        # The run's verifier (``reward.kind``): the caller's, else built here, before anything is
        # loaded; it checks the training rows as they load, and starts before any model does.
        self.verifier = as_verifier(verifier)
        """What scores every response of the run (``graftrl.verifiers``)."""
        self._owns_verifier = self.verifier is None
        if self.verifier is None:
            self.verifier = build_verifier(config.reward)
        self.problems = (
            list(problems)
            if problems is not None
            else load_problems(config.data.train, check=self.verifier.check_problem)
        )
        self.method = build_method(config.method, config)
        self.sampler = PromptSampler(self.problems, config.train.batch_prompts, config.seed)
        self.n = config.rollout.n
        self.names = [p.name for p in config.policies]
        # Peers not co-trained (stored, served; graftrl.training.peer_sources), each checked
        # before any model loads; and trajectory recording (graftrl.storage.store).
        self.sources = open_sources(PeerRun(config, self.problems, self.sampler))
        self.recorder = None
        if config.store.record or any(source.records for source in self.sources):
            self.recorder = TrajectoryWriter(Path(config.store.path or self.files.store))
        self.validator = None
        if config.validation.files:  # validation and best-checkpoint selection (graftrl.training.validation)
            from graftrl.training.validation import Validator

            # During training each worker samples and scores its own policy (validation_scores),
            # whatever the backend or rank count; the trainer's validator records the scores and
            # keeps best/ (its verifier serves direct `validate(step, policies)` calls).
            self.validator = Validator(config, self.run_dir, self.verifier)
        check_chat_templates(config, policies)
        if policies is None:  # before any weights load: a clear error when the run cannot fit
            from graftrl.models.memory import check_before_loading

            check_before_loading(config)
        if self._owns_verifier:  # its self-check, before any weights load (closed when it fails)
            start_verifier(self.verifier, config.reward.kind)
        try:
            self.backend: WorkerGroup = make_backend(
                BackendSetup(
                    config,
                    self.run_dir,
                    self.problems,
                    self.method,
                    policies=policies,
                    verifier=verifier,
                    run_verifier=self.verifier if self._owns_verifier else None,
                )
            )
        except BaseException:
            self._close_verifier()
            raise
        self.step_callback = step_callback
        self.start_step = 0
        """The first step ``train`` runs (a resume's checkpoint step)."""
        self.resume_changed_inputs: tuple[str, ...] = ()
        """Inputs whose content changed since the checkpoint a forced resume loaded (marked in
        the first resumed step's metrics)."""
        self.logger: MetricsLogger | None = None
        self._peer_verifier = None if self._owns_verifier else self.verifier
        self.checkpoints = TrainerCheckpoints(
            self.files,
            config,
            self.backend,
            self.method,
            problems=self.problems,
            problems_in_code=problems is not None,  # the run reads them, not data.train (may not exist)
            peer_inputs=self.peer_inputs,
            recorder=self.recorder,
        )
        """Checkpoint writing and resume (graftrl.training.trainer_checkpoints)."""

    @property
    def policies(self) -> list[Policy]:
        """The policies (``backend: local``; Ray keeps them in their actors)."""
        return self.backend.policies

    @property
    def workers(self) -> list[Worker]:
        """The in-process workers (``backend: local``)."""
        return self.backend.workers

    @property
    def peer_verifier(self) -> Any:
        """The driver's verifier, for re-verifying stored peers' rewards (the given one, else the backend's)."""
        if self._peer_verifier is None:
            self._peer_verifier = as_verifier(self.backend.driver_verifier())
        return self._peer_verifier

    # ----- the loop -----------------------------------------------------------------------
    def train(
        self, resume: bool = False, force: bool = False, on_checked: Callable[[], None] | None = None
    ) -> None:
        """Run the remaining steps, holding the run folder's lock (RunLockError if another process does).

        ``resume``: continue from the newest intact checkpoint (see ``resume``); ``force``: even
        when the config changes the run's identity (seed, method, n, policies, data).
        ``on_checked``: called once a resume's identity check has passed (the CLI's notes).
        """
        with hold_run_lock(self.run_dir):
            self._train(resume, force, on_checked)

    def _train(self, resume: bool, force: bool, on_checked: Callable[[], None] | None) -> None:
        clear_interrupt()  # an interrupt from before this run (same process) is not this run's
        if resume and not force:
            self.checkpoints.check_identity()  # before config.yaml is replaced
        if on_checked is not None:
            on_checked()
        logging = self.config.logging
        self.logger = MetricsLogger(
            self.run_dir,
            logging.tensorboard,
            logging.wandb,
            logging.wandb_project,
            self.config.model_dump(mode="json"),
            keys=metric_keys(),
        )
        if resume:
            try:
                resumed = self.checkpoints.resume(force)
                self.start_step, self.resume_changed_inputs = resumed.start_step, resumed.changed_inputs
            except BaseException:
                self.logger.close()
                self.close()
                raise
        atomic_write(self.files.config, dump_config(self.config).encode())
        self.checkpoints.inputs()  # hashed now: an input that vanishes mid-run cannot fail a checkpoint
        total = self.config.train.steps
        every = self.config.checkpoint.every
        try:
            with progress_bar(logging.progress, status=True) as progress:
                task = progress.add_task(
                    f"{self.config.method} train", total=total, completed=self.start_step, status=""
                )
                for step in range(self.start_step, total):
                    raise_if_interrupted()
                    metrics = self.step(step)
                    status = "  ".join(f"{name} r={m['reward_mean']:.2f}" for name, m in metrics.items())
                    progress.update(task, advance=1, status=status)
                    if self.step_callback is not None:
                        self.step_callback(step, metrics)
                    if self.validator is not None and self.validator.due(step):
                        self.validate(step)  # after the step: not part of its timings
                    if (every and (step + 1) % every == 0) or step + 1 == total:
                        raise_if_interrupted()  # an interrupt swallowed during the step stops here
                        self.checkpoints.save(step)
            for source in self.sources:
                source.report()
        finally:
            self.logger.close()
            self.close()

    def close(self) -> None:
        """Free engines, verifier pools and Ray actors (local policies stay usable for evaluation)."""
        for source in self.sources:
            source.close()
        self.backend.close()
        self._close_verifier()

    def _close_verifier(self) -> None:
        """The run's own verifier (a caller's is the caller's to close)."""
        if self._owns_verifier:
            self.verifier.close()

    def step(self, step: int) -> dict[str, dict[str, Any]]:
        """One rollout batch and one update of every policy; returns metrics per model."""
        planned = self.exchange(step, self.sampler.batch(step))
        sampled, outcomes, records, plans = planned.sampled, planned.outcomes, planned.records, planned.plans
        updates = self.backend.update(UpdateRequest(step, tuple(plans[name] for name in self.names), records))
        metrics: dict[str, dict[str, Any]] = {}
        for name, update in zip(self.names, updates, strict=True):
            if update.compatibility is not None:
                scores = dataclasses.asdict(update.compatibility)
                append_jsonl(self.files.compatibility, {k: v for k, v in scores.items() if v is not None})
            row = self.metrics_row(name, planned, update.metrics)
            if self.resume_changed_inputs and step == self.start_step:
                row["resume_changed_inputs"] = ", ".join(self.resume_changed_inputs)
            timings = {k: v for k, v in row.items() if k.startswith("time_") and k != "time_step"}
            row["time_step"] = sum(timings.values())
            metrics[name] = row
        for name, row in metrics.items():
            assert self.logger is not None
            self.logger.log({"step": step, "model": name, "method": self.method.name, **row})
        self._log_samples(step, sampled, outcomes)
        rescues = [row for name in self.names for row in planned.rescues.get(name, ())]
        if rescues:
            append_jsonl(self.files.rescues, rescues)
        return metrics

    def score_peers(
        self,
        step: int,
        planned: StepExchange,
        plans: Mapping[str, ExchangePlan] | None = None,
        scoring: Method | None = None,
        contrast: bool = True,
    ) -> dict[str, PeerScores]:
        """The update's row building without the optimizer (``graftrl probe``): each receiver's
        peer rows of ``plans`` (default: the step's own), scored as the update would score them,
        or with ``scoring``'s rule; ``contrast``: measure each moved group's contrast."""
        plans = planned.plans if plans is None else plans
        scored = self.backend.score_peers(
            PeerScoringRequest(
                step,
                tuple(plans[name] for name in self.names),
                planned.records,
                scoring=scoring,
                contrast=contrast,
            )
        )
        return dict(zip(self.names, scored, strict=True))

    def metrics_row(self, name: str, planned: StepExchange, row: dict[str, Any]) -> dict[str, Any]:
        """Policy ``name``'s metrics.jsonl row at the step: ``row`` (its update's metrics, or a
        scoring pass's) with the step's outcomes, sampling, stored peers, plan and phase timings."""
        row.update(self.outcome_metrics(name, planned.outcomes, planned.shared, planned.problems))
        row.update(planned.sampled[name].info)
        row.update(planned.stored_info)
        row.update(planned.plans[name].diagnostics)
        row.update(planned.sampled[name].timings)
        return row

    def exchange(self, step: int, problems: list[MathProblem]) -> StepExchange:
        """The step up to the update: every policy samples and scores ``problems`` (concurrently
        under Ray), stored peers join, and the method plans each receiver's groups. ``step``
        seeds the sampling and the plan (``graftrl probe`` runs this without an update)."""
        self.backend.reset_peak_memory()
        sampled: dict[str, PolicyRollout] = dict(
            zip(self.names, self.backend.rollout(RolloutRequest(step, problems)), strict=True)
        )
        outcomes = {name: s.outcomes for name, s in sampled.items()}
        records = {name: s.records for name, s in sampled.items()}
        shared = {name: s.shared for name, s in sampled.items()}
        receivers = dict(outcomes)  # what the sources see: the co-trained policies' groups
        peer_info: dict[str, float] = {}
        peer_rows = []
        answered: dict[str, list[int]] = {}
        for source in self.sources:  # stored, served (docs/served-peer.md) and registered peers
            got = source.groups(step, problems, receivers, self.peer_verifier)
            outcomes[source.name], records[source.name] = got.outcomes, got.records
            if got.shared:  # groups on the whole shared batch: complementarity figures
                shared[source.name] = got.outcomes
            peer_info.update(got.info)
            peer_rows += got.rows
            if got.answered is not None:
                answered[source.name] = got.answered
        own_rows = [row for s in sampled.values() for row in s.store_rows] if self.config.store.record else []
        if self.recorder is not None and own_rows + peer_rows:
            self.recorder.write_step(step, own_rows + peer_rows)

        rescued = None
        if isinstance(self.method, RescuePhase):  # the receivers' rescue round, from every cold round
            rescued = run_rescue(
                self.method,
                self.backend,
                step,
                self.names,
                problems,
                sampled,
                outcomes,
                records,
                self.config.data.prompt_suffix,
                texts=self.config.logging.log_transfers,
            )
        generator = torch.Generator().manual_seed(step_seed(self.config.seed, step, PLAN_STREAM))
        plans = self.method.plan(outcomes, generator)
        if rescued is not None:
            for name, diagnostics in rescued.diagnostics.items():
                plans[name].diagnostics.update(diagnostics)
        rescues = rescued.rows if rescued is not None else {}
        return StepExchange(problems, sampled, outcomes, records, shared, plans, peer_info, answered, rescues)

    def peer_inputs(self) -> dict[str, dict[str, str]]:
        """What the peer sources read (``peers.<name>`` -> path and sha256; a resume's check)."""
        return {key: value for source in self.sources for key, value in source.inputs().items()}

    def outcome_metrics(
        self,
        name: str,
        outcomes: dict[str, GroupOutcomes],
        shared: dict[str, GroupOutcomes],
        problems: Sequence[MathProblem],
    ) -> dict[str, Any]:
        """Reward of what the policy trains on; complementarity and per-family figures on the shared batch."""
        own = outcomes[name]
        threshold = self.config.reward.success_threshold
        all_fail, all_pass = group_outcome_fractions(own.rewards, threshold)
        row: dict[str, Any] = {
            "reward_mean": float(own.rewards.mean()),
            "all_fail_frac": float(all_fail),
            "all_pass_frac": float(all_pass),
            "all_fail_signal_frac": float(all_fail_signal_fraction(own.rewards, threshold)),
        }
        for peer, other in shared.items():
            if peer != name:
                row[f"complementarity/{peer}"] = float(
                    complementarity(shared[name].successes, other.successes)
                )
        # Per family: does the policy learn a sub-skill it starts near 0 on ("beyond what it samples")?
        families = [p.family for p in problems]
        for family in sorted({f for f in families if f is not None}):
            rows = torch.tensor([f == family for f in families])  # [P]
            rewards = shared[name].rewards[rows]  # [P_family, n]
            row[f"family_reward/{family}"] = float(rewards.mean())
            row[f"family_all_fail/{family}"] = float(group_outcome_fractions(rewards, threshold)[0])
        return row

    def _log_samples(
        self, step: int, sampled: dict[str, PolicyRollout], outcomes: dict[str, GroupOutcomes]
    ) -> None:
        count = self.config.logging.log_samples
        if not count:
            return
        n = self.n
        append_jsonl(
            self.files.samples,
            [
                {
                    "step": step,
                    "model": name,
                    "prompt_id": part.problems[row // n].id,
                    "answer": part.problems[row // n].answer,
                    "response": part.records[row].response,
                    "reward": float(outcomes[name].rewards.view(-1)[row]),
                }
                for name, part in sampled.items()
                for row in range(0, min(count * n, len(part.records)), n)
            ],
        )

    # ----- validation ---------------------------------------------------------------------
    def validate(self, step: int) -> list[dict[str, Any]]:
        """Validate every policy now (each in its worker, with its own engine), keep the best checkpoints."""
        assert self.validator is not None
        rows = []
        start = time.perf_counter()
        scores = self.backend.validation_scores()
        seconds = time.perf_counter() - start
        for index, (name, score) in enumerate(zip(self.names, scores, strict=True)):
            rows.append(
                self.validator.record(
                    step,
                    name,
                    score,
                    lambda folder, i=index: self.backend.save_policy(SavePolicyRequest(i, folder)),
                    seconds,
                )
            )
        self.validator.report(step, rows)
        return rows
